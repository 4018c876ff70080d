"""A GPT-2-shaped model's train step, with and without loss scaling.

Usage: python benchmarks/model_step.py [--quick] [--peers] [--out PATH]

The step users feel: forward, backward and Adam update of a 12-block,
149-leaf transformer (GPT-2 small's tree at a reduced width; float32 master
weights, float16 compute), jitted with the parameters and the optimizer
state donated. Against the same step without loss scaling
(`jax.value_and_grad`, `optax.adam`, `optax.apply_updates`), it measures
`LossScaleOptimizer(adam, DynamicLossScale()).minimize` and
`scaled_value_and_grad` + `apply_gradients`: the step time (configurations
timed in turns, the median of each round's median, over several rounds), the
first compile (the median of several first compiles, each with another
learning rate so that none is served from JAX's cache, in turns) and the
temporary memory (`compiled.memory_analysis()`), and checks them against the
bounds 1.05x, 1.10x and 1.05x. `--peers` adds the flax `DynamicScale`
pattern (compiled once; jmp's step takes minutes to compile and is left to
`train_step.py`). Writes benchmarks/MODEL_STEP.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
from collections.abc import Callable
from typing import Any

import _model
import _steps
import _timing
import jax

import optax_lossscale as ols

FULL = _model.Transformer()
# A smoke run's model: the same code, one block at a small width.
QUICK = _model.Transformer(
  layers=1, d_model=16, heads=2, seq=8, batch=2, vocab=32
)
LR = 1e-3
OUT = pathlib.Path(__file__).with_name("MODEL_STEP.md")
PLAIN = "plain adam: value_and_grad + apply_updates"
MINIMIZE = "LossScaleOptimizer.minimize"
APPLY = "scaled_value_and_grad + apply_gradients"
FLAX = "flax DynamicScale pattern (peer)"
# What "the same cost" means: the ratio to plain adam must not exceed these.
BOUNDS = {"step": 1.05, "compile": 1.10, "temp": 1.05}

Factory = Callable[[_steps.Loss, float], _steps.Config]
CONFIGS: dict[str, Factory] = {
  PLAIN: _steps.plain,
  MINIMIZE: lambda loss, lr: _steps.minimize(loss, lr, ols.DynamicLossScale()),
  APPLY: lambda loss, lr: _steps.apply_gradients(
    loss, lr, ols.DynamicLossScale()
  ),
}
PEERS: dict[str, Factory] = {
  FLAX: lambda loss, lr: _steps.flax_pattern(
    loss, lr, float(ols.DynamicLossScale()())
  ),
}


@dataclasses.dataclass
class Run:
  """One configuration's compiled step, its state and its measurements."""

  name: str
  compiled: Any
  carry: tuple[Any, ...]
  temp: float
  compiles: list[float]
  medians: list[float] = dataclasses.field(default_factory=list)
  skipped: int = 0


def _skipped(state: Any) -> int:
  """Steps skipped so far, by a state that counts them (else 0)."""
  if isinstance(state, ols.LossScaleOptimizerState):
    return int(state.skipped_steps)
  return 0


def measure(
  model: _model.Transformer,
  *,
  rounds: int,
  steps: int,
  compiles: int,
  peers: bool = False,
) -> list[dict[str, Any]]:
  """Measures every configuration against plain adam, in turns.

  Args:
    model: the model.
    rounds: rounds of timed steps; each configuration runs `steps` donated
      steps per round, in turns.
    steps: steps per configuration per round.
    compiles: first compiles of each configuration (not of the peers, which
      compile once), in turns, in alternating order.
    peers: whether to add the peers.

  Returns:
    One dict per configuration, plain adam first: `name`, `step` (seconds),
    `compile` (seconds), `temp` (bytes), their ratios to plain adam
    (`step_ratio`, `compile_ratio`, `temp_ratio`), `within` (whether the
    three ratios are within `BOUNDS`; None for plain adam and the peers) and
    `skipped` (steps skipped while timed).
  """
  params = model.init_params(jax.random.key(0))
  batch = model.make_batch(jax.random.key(1))
  factories = {**CONFIGS, **(PEERS if peers else {})}
  runs: dict[str, Run] = {}
  for k in range(compiles):
    order = list(factories) if k % 2 == 0 else list(reversed(factories))
    for name in order:
      if k > 0 and name in PEERS:
        continue
      lr = LR * (1 + k)
      compiled, seconds, carry = _timing.compile_model_step(
        factories[name], model, params, batch, lr
      )
      if k == 0:
        temp = _timing.temp_bytes(compiled)
        runs[name] = Run(name, compiled, carry, temp, [seconds])
      else:
        runs[name].compiles.append(seconds)
  runs = {name: runs[name] for name in factories}
  for run in runs.values():  # warm up; the loss must be finite
    *carry, loss = run.compiled(*run.carry, batch)
    run.carry = tuple(carry)
    if not math.isfinite(float(loss)):
      raise RuntimeError(f"{run.name}: non-finite loss {float(loss)}.")
    run.skipped = -_skipped(run.carry[1])
  for _ in range(rounds):
    for run in runs.values():
      times, run.carry = _timing.step_times(
        run.compiled, run.carry, (batch,), steps
      )
      run.medians.append(statistics.median(times))
  plain = runs[PLAIN]
  return [_row(run, plain) for run in runs.values()]


def _row(run: Run, plain: Run) -> dict[str, Any]:
  step = statistics.median(run.medians)
  compile_s = statistics.median(run.compiles)
  ratios = {
    "step_ratio": step / statistics.median(plain.medians),
    "compile_ratio": compile_s / statistics.median(plain.compiles),
    "temp_ratio": run.temp / plain.temp if plain.temp else float("nan"),
  }
  within = None
  if run.name in CONFIGS and run.name != PLAIN:
    # Judged on the ratios as the table shows them, to two decimals.
    within = all(
      round(ratios[f"{key}_ratio"], 2) <= BOUNDS[key] for key in BOUNDS
    )
  return dict(
    name=run.name,
    step=step,
    compile=compile_s,
    temp=run.temp,
    within=within,
    skipped=run.skipped + _skipped(run.carry[1]),
    compiles=len(run.compiles),
    **ratios,
  )


def describe(model: _model.Transformer) -> str:
  """The model in words: blocks, width, leaves, parameters, batch."""
  params = jax.eval_shape(model.init_params, jax.random.key(0))
  leaves = jax.tree.leaves(params)
  return (
    f"{model.layers} blocks, width {model.d_model}, {len(leaves)} leaves,"
    f" {sum(x.size for x in leaves):,} float32 parameters; batch"
    f" {model.batch} x {model.seq} tokens, vocabulary {model.vocab}"
  )


def markdown(
  rows: list[dict[str, Any]], model: _model.Transformer, cmd: str, note: str
) -> str:
  """The table: ratios to plain adam, the bounds, and where it ran."""
  plain = rows[0]
  bounds = " / ".join(f"{b:.2f}x" for b in BOUNDS.values())
  lines = [
    "# A model's train step, with and without loss scaling",
    "",
    # docs/performance.md includes what lies between the markers.
    "<!-- --8<-- [start:table] -->",
    _timing.header(cmd),
    f"- model: {describe(model)}; float16 compute, float32 master weights",
    "",
    *([note, ""] if note else []),
    f"Ratios to `{PLAIN}` (every step jitted with the parameters and the"
    " optimizer state donated). Step: the median over rounds of each round's"
    " median step, configurations timed in turns. Compile: the median of"
    f" {plain['compiles']} first compiles (fresh learning rates, so none is"
    " served from JAX's cache), in turns; peers compile once. Temporary"
    " memory: `compiled.memory_analysis().temp_size_in_bytes`. Plain adam on"
    f" this machine: {plain['step'] * 1e3:.1f} ms a step, {plain['compile']:.1f}"
    f" s to compile, {plain['temp'] / 2**20:.1f} MiB of temporary memory.",
    "",
    f"| configuration | step | first compile | temporary memory | within"
    f" {bounds} | steps skipped while timed |",
    "|---|---|---|---|---|---|",
  ]
  for r in rows:
    within = {None: "-", True: "yes", False: "no"}[r["within"]]
    lines.append(
      f"| {r['name']} | {r['step_ratio']:.2f}x | {r['compile_ratio']:.2f}x"
      f" | {r['temp_ratio']:.2f}x | {within} | {r['skipped']} |"
    )
  lines.append("<!-- --8<-- [end:table] -->")
  return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="a smoke run on a 1-block model"
  )
  parser.add_argument("--peers", action="store_true", help="add the peers")
  parser.add_argument("--out", default=str(OUT), help="the markdown file")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--compiles", type=int, default=None)
  parser.add_argument(
    "--note", default="", help="a line written above the table"
  )
  args = parser.parse_args()
  for name, quick, full in [("rounds", 1, 5), ("steps", 2, 10)]:
    if getattr(args, name) is None:
      setattr(args, name, quick if args.quick else full)
  if args.compiles is None:
    args.compiles = 1 if args.quick else 3
  for name in ("rounds", "steps", "compiles"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be at least 1, got {getattr(args, name)}.")
  return args


def main() -> None:
  args = parse_args()
  model = QUICK if args.quick else FULL
  print(describe(model), flush=True)
  rows = measure(
    model,
    rounds=args.rounds,
    steps=args.steps,
    compiles=args.compiles,
    peers=args.peers,
  )
  for r in rows:
    print(
      f"{r['name']:45} step {r['step'] * 1e3:8.2f} ms ({r['step_ratio']:.2f}x)"
      f"  compile {r['compile']:6.2f} s ({r['compile_ratio']:.2f}x)"
      f"  temp {r['temp'] / 2**20:7.1f} MiB ({r['temp_ratio']:.2f}x)"
    )
  flags = " ".join(
    f"--{name}={getattr(args, name)}"
    for name in ("rounds", "steps", "compiles")
  )
  cmd = (
    "python benchmarks/model_step.py"
    + (" --quick" if args.quick else "")
    + (" --peers" if args.peers else "")
    + f" {flags}"
  )
  pathlib.Path(args.out).write_text(markdown(rows, model, cmd, args.note))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
