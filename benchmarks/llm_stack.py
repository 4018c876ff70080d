"""The float16 LLM stack: clipping, AdamW, accumulation, the norm logged.

Usage: python benchmarks/llm_stack.py [--quick]

Times, in turns in one process, donated train steps on given gradients
(scaled by 2**10 for the loss-scaled ones), and writes
benchmarks/LLM_STACK.md:

- Optax's unscaled `chain(clip_by_global_norm(1), adamw)` logging
  `optax.tree.norm(grads)`, against `LossScaleOptimizer(adamw,
  max_norm=1.0)` logging `state.grad_norm`;
- `LossScaleOptimizer(adamw)` against plain `adamw`;
- per micro-step, Optax's `MultiSteps(chain(clip_by_global_norm(1),
  adamw), 4)` against `LossScaleOptimizer(adamw, max_norm=1.0,
  gradient_accumulation_steps=4)`;
- the first compile at 400 leaves: plain Adam, Adam with its gradients
  unscaled inside one `lax.cond` (the floor any skipping step pays), and
  the fused steps, with and without `max_norm`.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable
from typing import Any

import _timing
import first_compile
import jax
import jax.numpy as jnp
import numpy as np
import optax
import step_overhead

import optax_lossscale as ols

SCALE = step_overhead.SCALE
K = 4  # micro-batches per window
Config = Callable[[float], tuple[Callable[..., Any], Callable[..., Any], bool]]


def _optax(tx: optax.GradientTransformation, log_norm: bool = True) -> Any:
  """Optax's step on unscaled gradients, returning their norm too."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    norm = optax.tree.norm(grads) if log_norm else jnp.zeros(())
    return optax.apply_updates(params, updates), state, norm

  return tx.init, step, False


def _ours(inner: Any, max_norm: float | None, accumulation: int = 1) -> Any:
  """The fused step on scaled gradients, returning `state.grad_norm` too."""
  tx = ols.LossScaleOptimizer(
    inner,
    ols.DynamicLossScale(SCALE),
    max_norm=max_norm,
    gradient_accumulation_steps=accumulation,
  )

  def step(params, state, grads):
    params, state = tx.apply_gradients(grads, state, params)
    return params, state, state.grad_norm

  return tx.init, step, True


def _clip_adamw(lr: float) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))


CONFIGS: dict[str, Config] = {
  "adamw": lambda lr: _optax(optax.adamw(lr), log_norm=False),
  "optax chain(clip, adamw), unscaled": lambda lr: _optax(_clip_adamw(lr)),
  "ours: adamw, max_norm=1": lambda lr: _ours(optax.adamw(lr), 1.0),
  "ours: adamw": lambda lr: _ours(optax.adamw(lr), None),
  "optax MultiSteps(chain(clip, adamw), 4), unscaled": lambda lr: _optax(
    optax.MultiSteps(_clip_adamw(lr), K).gradient_transformation()
  ),
  "ours: adamw, max_norm=1, accumulation 4": lambda lr: _ours(
    optax.adamw(lr), 1.0, K
  ),
}
# (row, configuration, its baseline, the bar)
ROWS = [
  (
    "clip + norm logged",
    "ours: adamw, max_norm=1",
    "optax chain(clip, adamw), unscaled",
    "<= 1.00x, aim 0.60x",
  ),
  ("loss scaling alone", "ours: adamw", "adamw", "<= 1.20x, aim 1.15x"),
  (
    "accumulation, per micro-step",
    "ours: adamw, max_norm=1, accumulation 4",
    "optax MultiSteps(chain(clip, adamw), 4), unscaled",
    "<= 1.00x",
  ),
  ("optax's clip chain", "optax chain(clip, adamw), unscaled", "adamw", ""),
]


def _prepare(name: str, params: Any) -> dict[str, Any]:
  init, step, scaled = CONFIGS[name](1e-3)
  grads = jax.tree.map(lambda x: x * 1e-3 * (SCALE if scaled else 1), params)
  p = jax.tree.map(jnp.copy, params)
  compiled, _ = _timing.compile_step(step, p, init(p), grads)
  return {"step": compiled, "carry": (p, init(p)), "grads": grads, "times": []}


def step_rows(params: Any, rounds: int, steps: int) -> dict[str, float]:
  """The median seconds per step of each configuration, timed in turns."""
  runs = {name: _prepare(name, params) for name in CONFIGS}
  for _ in range(rounds):
    for run in runs.values():
      times, carry = _timing.step_times(
        run["step"], run["carry"], [run["grads"]], steps
      )
      run["carry"] = carry
      run["times"].append(float(np.mean(times)))
  return {name: run["times"] for name, run in runs.items()}


def compile_rows(params: Any, compiles: int) -> dict[str, list[float]]:
  """First compiles of plain Adam, the one-`cond` floor and the fused steps."""
  configs = {
    "plain adam": lambda lr: step_overhead.optax_step(optax.adam(lr)),
    "adam unscaled in one lax.cond": lambda lr: first_compile.adam_in_one_cond(
      lr, unscale=True
    ),
    "fused": lambda lr: step_overhead.fused_step(lr),
    "fused, max_norm=1": lambda lr: step_overhead.fused_step(lr, max_norm=1.0),
  }
  first_compile.first_compile(configs["plain adam"], params, 0.5)  # warm-up
  seconds: dict[str, list[float]] = {name: [] for name in configs}
  names = list(configs)
  for k in range(compiles):
    for name in names[k % len(names) :] + names[: k % len(names)]:
      lr = 1e-3 * (2 + k)
      seconds[name].append(
        first_compile.first_compile(configs[name], params, lr)
      )
  return seconds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small and short")
  parser.add_argument(
    "--out",
    default=str(pathlib.Path(__file__).parent / "LLM_STACK.md"),
    help="the results file to write",
  )
  args = parser.parse_args()
  workloads = (
    [("8 leaves x 20000", step_overhead.make_tree(8, 20_000))]
    if args.quick
    else [
      ("16M / 8 leaves", step_overhead.make_tree(8, 2_000_000)),
      ("400 leaves x 1000", step_overhead.make_tree(400, 1000)),
    ]
  )
  rounds, steps = (2, 4) if args.quick else (7, 2 * K)
  lines = [
    "| workload | row | configuration / baseline | bar |",
    "|---|---|---|---|",
  ]
  for workload, params in workloads:
    times = step_rows(params, rounds, steps)
    for row, name, base, bar in ROWS:
      cell = _timing.ratio_range(times[name], times[base])
      lines.append(
        f"| {workload} | {row}: `{name}` / `{base}` | {cell} | {bar} |"
      )
      print(lines[-1], flush=True)
  leaves = 40 if args.quick else 400
  compiles = 1 if args.quick else 5
  seconds = compile_rows(step_overhead.make_tree(leaves, 1000), compiles)
  base = seconds["plain adam"]
  compile_lines = [
    "| configuration | first compile / plain adam's |",
    "|---|---|",
  ]
  for name, values in seconds.items():
    compile_lines.append(f"| {name} | {_timing.ratio_range(values, base)} |")
  floor = np.median(np.asarray(seconds["adam unscaled in one lax.cond"]) / base)
  for name in ("fused", "fused, max_norm=1"):
    own = np.median(np.asarray(seconds[name]) / base) - floor
    compile_lines.append(
      f"| {name}: the library's own cost, over the floor | +{own:.2f}x |"
    )
  print("\n".join(compile_lines), flush=True)
  text = (
    "# The float16 LLM stack: clip, AdamW, accumulation, the norm logged\n\n"
    f"{_timing.header()}\n\n"
    "Donated train steps on given gradients, in turns in one process:"
    f" {rounds} rounds of {steps} steps per configuration; each cell is the"
    " median ratio of the rounds' mean step times, and their range. The"
    " loss-scaled steps take gradients scaled by 2**10 and log"
    " `state.grad_norm`; Optax's take unscaled ones and log"
    " `optax.tree.norm(grads)`. Accumulation rows are per micro-step (one"
    f" optimizer step in {K}). Measured on a CPU: nothing here is measured on"
    " a GPU.\n\n"
    + "\n".join(lines)
    + f"\n\nFirst compile (lower and compile, donated) at {leaves} leaves of"
    f" 1,000, medians of {compiles} in turns, a fresh program each time. The floor is"
    " plain Adam with its gradients unscaled inside one `lax.cond`, with no"
    " check: what any step that skips pays.\n\n"
    + "\n".join(compile_lines)
    + "\n"
  )
  pathlib.Path(args.out).write_text(text)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
