"""A whole float16 train step on a small transformer, with and without scaling.

Usage: python benchmarks/train_step.py [--quick] [--out FILE]

Forward, backward and Adam update of a 12-block transformer (float32 master
weights, float16 compute), jitted with parameters and optimizer state donated,
in six configurations: plain Adam, `scaled_value_and_grad` with
`apply_gradients`, `minimize` without and with retries, jmp and the flax
`DynamicScale` pattern. Measures compile time, temp memory and step time, and
the cost of a step whose first attempt overflows and is retried. Prints the
figures and writes benchmarks/TRAIN_STEP.md.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import _model
import _steps
import _timing
import jax
import jax.numpy as jnp
import numpy as np

import optax_lossscale as ols

MODEL = _model.Transformer(
  layers=12, d_model=128, heads=4, seq=64, batch=8, vocab=256
)
SCALE = 2.0**10
MAX_RETRIES = 4
LR = 1e-3
OUT = pathlib.Path(__file__).with_name("TRAIN_STEP.md")
REFERENCE = "scaled_value_and_grad + apply_gradients"
PLAIN = "plain adam"

init_params = MODEL.init_params
loss_fn = MODEL.loss
make_batch = MODEL.make_batch


def _loss_scale() -> ols.DynamicLossScale:
  return ols.DynamicLossScale(SCALE)


# Configurations: each takes Adam's learning rate and returns `(init, step)`.
CONFIGS: dict[str, Callable[..., _steps.Config]] = {
  PLAIN: lambda lr=LR: _steps.plain(loss_fn, lr),
  REFERENCE: lambda lr=LR: _steps.apply_gradients(loss_fn, lr, _loss_scale()),
  "minimize, max_retries=0": (
    lambda lr=LR: _steps.minimize(loss_fn, lr, _loss_scale(), 0)
  ),
  f"minimize, max_retries={MAX_RETRIES}": (
    lambda lr=LR: _steps.minimize(loss_fn, lr, _loss_scale(), MAX_RETRIES)
  ),
  "jmp select_tree": lambda lr=LR: _steps.jmp_pattern(loss_fn, lr, SCALE),
  "flax DynamicScale pattern": (
    lambda lr=LR: _steps.flax_pattern(loss_fn, lr, SCALE)
  ),
}
RETRY_CONFIG = f"minimize, max_retries={MAX_RETRIES}"
PEERS = ("jmp select_tree", "flax DynamicScale pattern")


def compile_time(name: str, params: Any, batch: Any, lr: float) -> float:
  """Seconds to compile `name`'s step with Adam's learning rate `lr`.

  Each `lr` gives another program, so each compile is a first compile
  (JAX serves a repeated one from its cache).
  """
  init, step = CONFIGS[name](lr)
  return _timing.compile_step(step, params, init(params), batch)[1]


def overflow_scale(params: Any, batch: Any) -> float:
  """The smallest power of 2 at which the float16 gradients overflow."""

  @jax.jit
  def finite(scale):
    grads = jax.grad(lambda p: loss_fn(p, batch) * scale)(params)
    return ols.all_finite(grads)

  for k in range(64):
    if not bool(finite(jnp.float32(2.0**k))):
      if not bool(finite(jnp.float32(2.0 ** (k - 1)))) or k < 1:
        raise RuntimeError(f"float16 gradients overflow at 2**{k - 1} too.")
      return 2.0**k
  raise RuntimeError("float16 gradients never overflow below 2**64.")


def prepare(name: str, params: Any, batch: Any) -> dict[str, Any]:
  """Compiles one configuration (timed) and runs one step."""
  init, step = CONFIGS[name]()
  p = jax.tree.map(jnp.copy, params)
  s = init(p)
  compiled, compile_s = _timing.compile_step(step, p, s, batch)
  p, s, loss = compiled(p, s, batch)
  if not np.isfinite(float(loss)):
    raise RuntimeError(f"{name}: non-finite loss {float(loss)}.")
  return dict(
    name=name,
    compiled=compiled,
    state=(p, s),
    compiles=[compile_s],
    temp=_timing.temp_bytes(compiled),
    medians=[],
  )


def time_steps(run: dict[str, Any], batch: Any, steps: int) -> float:
  """The median time of `steps` donated steps, fed back into each other."""
  times, run["state"] = _timing.step_times(
    run["compiled"], run["state"], (batch,), steps
  )
  return statistics.median(times)


def _with_scale(state: ols.LossScaleOptimizerState, scale: float) -> Any:
  """`state` with its loss scale set to `scale` (same static config)."""
  loss_scale = ols.DynamicLossScale(
    SCALE,
    current_loss_scale=jnp.asarray(scale, jnp.float32),
    num_good_steps=jnp.zeros((), jnp.int32),
  )
  return state._replace(loss_scale=loss_scale)


def step_at_scale(run: dict[str, Any], batch: Any, scale: float):
  """One step from a copy of `run`'s state at loss scale `scale`.

  Returns the step's time and how many retries it made.
  """
  p, s = jax.tree.map(jnp.copy, run["state"])
  s = _with_scale(s, scale)
  jax.block_until_ready((p, s))
  t0 = time.perf_counter()
  _, s, loss = run["compiled"](p, s, batch)
  jax.block_until_ready((s, loss))
  elapsed = time.perf_counter() - t0
  if int(s.skipped_steps) != int(run["state"][1].skipped_steps):
    raise RuntimeError(f"the step at scale {scale} was skipped.")
  return elapsed, int(s.retries) - int(run["state"][1].retries)


def retry_scale(run: dict[str, Any], batch: Any, guess: float) -> float:
  """The lowest power of 2 at which the step retries exactly once."""
  for k in range(1, 64):
    if step_at_scale(run, batch, 2.0**k)[1] == 1:
      return 2.0**k
  raise RuntimeError(f"no scale overflows exactly once (guess {guess}).")


def time_retry(run: dict[str, Any], batch: Any, guess: float, args) -> float:
  """Median over rounds of (overflow-once step) / (normal step) time."""
  over = retry_scale(run, batch, guess)
  print(f"one retry at 2**{int(np.log2(over))}")
  retry, normal = [], []
  for _ in range(args.rounds):
    for scale, times, expected in ((over, retry, 1), (SCALE, normal, 0)):
      steps = [step_at_scale(run, batch, scale) for _ in range(args.steps)]
      if any(n != expected for _, n in steps):
        raise RuntimeError(f"retries at scale {scale}: {steps}.")
      times.append(statistics.median(t for t, _ in steps))
  return statistics.median(retry) / statistics.median(normal)


def markdown(runs: dict[str, dict[str, Any]], retry: float) -> str:
  """The ratios against the reference configuration and plain Adam."""
  ref, plain = runs[REFERENCE], runs[PLAIN]
  lines = [
    "# train_step results",
    "",
    _timing.header(),
    "",
    f"Ratios against `{REFERENCE}` (ref) and `{PLAIN}` (adam). Compile:"
    " the median of several first compiles for all but the peers (jmp, flax),"
    " which compile once.",
    "",
    "| configuration | step vs ref | step vs adam | compile vs ref"
    " | compile vs adam | temp memory vs ref | temp memory vs adam |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, r in runs.items():
    cells = [name]
    for key in ("step", "compile", "temp"):
      cells += [
        _timing.ratio(r[key], ref[key]),
        _timing.ratio(r[key], plain[key]),
      ]
    lines.append("| " + " | ".join(cells) + " |")
  lines += [
    "",
    f"One retry (`minimize`, `max_retries={MAX_RETRIES}`, first attempt"
    f" overflows) vs a normal step of the same: {retry:.2f}x",
    "",
  ]
  return "\n".join(lines)


def print_runs(runs: dict[str, dict[str, Any]]) -> None:
  print(f"{'configuration':42} {'step ms':>8} {'compile s':>9} {'temp MiB':>8}")
  for name, r in runs.items():
    print(
      f"{name:42} {r['step'] * 1e3:8.2f} {r['compile']:9.2f}"
      f" {r['temp'] / 2**20:8.1f}"
    )


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a smoke run")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--out", default=str(OUT), help="the markdown file")
  args = parser.parse_args()
  args.rounds = args.rounds or (2 if args.quick else 5)
  args.steps = args.steps or (3 if args.quick else 10)
  args.compiles = 1 if args.quick else 3
  return args


def main() -> None:
  args = parse_args()
  params = init_params(jax.random.key(0))
  batch = make_batch(jax.random.key(1))
  leaves = jax.tree.leaves(params)
  print(f"{len(leaves)} leaves, {sum(x.size for x in leaves):,} parameters")
  over = overflow_scale(params, batch)
  if over <= 2 * SCALE:
    raise RuntimeError(f"gradients overflow at {over}, SCALE={SCALE} is high.")
  print(f"float16 gradients overflow at 2**{int(np.log2(over))}")
  runs = {}
  for name in CONFIGS:
    runs[name] = prepare(name, params, batch)
    print(f"compiled {name} in {runs[name]['compiles'][0]:.1f} s", flush=True)
  # More first compiles of ours and plain Adam, in turns (the peers compile
  # once: jmp alone takes minutes).
  for k in range(1, args.compiles):
    for name, run in runs.items():
      if name not in PEERS:
        run["compiles"].append(compile_time(name, params, batch, LR * (1 + k)))
  for run in runs.values():
    run["compile"] = statistics.median(run["compiles"])
  for _ in range(args.rounds):
    for run in runs.values():
      run["medians"].append(time_steps(run, batch, args.steps))
  for run in runs.values():
    run["step"] = statistics.median(run["medians"])
  retry = time_retry(runs[RETRY_CONFIG], batch, over, args)
  print_runs(runs)
  print(f"retry step vs normal step: {retry:.2f}x")
  pathlib.Path(args.out).write_text(markdown(runs, retry))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
