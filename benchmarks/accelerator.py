"""Loss scaling on whatever backend JAX finds, in one table of ratios.

Usage: benchmarks/accelerator.sh [OUT.md] [--quick]   (runs this, after the
       finiteness-check sweep)
       python benchmarks/accelerator.py [--quick] [--out PATH] [--sweep FILE]

Measures, in one process, configurations in turns, ratios only:

- `step_overhead.py`'s main rows: plain adam, the fused step
  (`LossScaleOptimizer.apply_gradients`), `chain(unscale_gradients,
  adam)` and `LossScaleOptimizer.update` + `apply_updates`, on 16M float32
  parameters in 8 leaves and on 400 and 100 leaves of 1,000 (gradients an
  input, parameters and state donated);
- cond or select: the fused step as the library writes it (one `lax.cond`
  around the inner update) against the same step with the new parameters and
  state chosen leaf by leaf (`optax.tree.where`), on the same trees. On a
  GPU, XLA's conditional reads its predicate on the host, so a select might
  win on small steps and the cond on large ones;
- `model_step.py`'s rows: a GPT-2-shaped model's whole train step against
  plain adam.

Writes a markdown file (default benchmarks/ACCELERATOR_<backend>.md) with
`_timing.header()` under its title (the command, backend, device, host,
versions and date), the sweep's table (from `--sweep`, the output of
`benchmarks/finite_sweep.py --quick`), and one table of the rest. `--quick`
is a smoke run on small trees and a one-block model: its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import time
from typing import Any

import _timing
import jax
import jax.numpy as jnp
import model_step
import optax
import step_overhead

import optax_lossscale as ols

PLAIN = "plain adam"
COND = "LossScaleOptimizer.apply_gradients"
SELECT = "fused step, per-leaf select (optax.tree.where)"
STEP_ROWS = [
  PLAIN,
  COND,
  "chain(unscale_gradients, adam)",
  "LossScaleOptimizer.update",
]
# (workload, leaves, parameters a leaf)
TREES = [
  ("16M / 8 leaves", 8, 2_000_000),
  ("400 leaves x 1000", 400, 1000),
  ("100 leaves x 1000", 100, 1000),
]
QUICK_TREES = [
  ("8k / 8 leaves", 8, 1000),
  ("16 leaves x 100", 16, 100),
  ("4 leaves x 100", 4, 100),
]
# Below this much temporary memory, a ratio to it says nothing.
MIN_TEMP = 2**20
PARTS = ("step_overhead", "cond or select", "model step")
COLUMNS = (
  "part",
  "workload",
  "configuration",
  "vs",
  "step",
  "first compile",
  "temporary memory",
  "step (ms)",
)


def fused_select() -> tuple[Any, Any]:
  """The fused step with a per-leaf select in place of the `lax.cond`.

  Written here for the comparison only, from the public API: the loss
  scale's verdict and adjustment, Adam on the unscaled gradients, then
  `optax.tree.where` over the parameters and Adam's state. It updates the
  state's scale and skip counters but writes no skip record.
  """
  adam = optax.adam(1e-3)
  tx = ols.LossScaleOptimizer(adam, ols.DynamicLossScale(step_overhead.SCALE))

  def step(params, state, grads):
    loss_scale = state.loss_scale
    finite = ols.all_finite(grads)
    new_scale, applies = loss_scale.adjust(finite)
    updates, inner = adam.update(
      loss_scale.unscale(grads), state.inner_state, params
    )
    new_params = optax.apply_updates(params, updates)
    skipped = (~applies).astype(jnp.int32)
    return optax.tree.where(applies, new_params, params), state._replace(
      loss_scale=new_scale,
      inner_state=optax.tree.where(applies, inner, state.inner_state),
      should_apply=applies,
      skipped_steps=state.skipped_steps + skipped,
      consecutive_skipped_steps=(state.consecutive_skipped_steps + 1) * skipped,
    )

  return tx.init, step


def _row(part, workload, name, vs, run, base) -> dict[str, Any]:
  return dict(
    part=part,
    workload=workload,
    configuration=name,
    vs=vs,
    step=run["step"] / base["step"],
    compile=run["compile"] / base["compile"],
    temp=run["temp"] / base["temp"] if base["temp"] >= MIN_TEMP else math.nan,
    temp_mib=run["temp"] / 2**20,
    step_ms=run["step"] * 1e3,
  )


def trees(workloads, rounds: int, steps: int) -> list[dict[str, Any]]:
  """`step_overhead`'s main rows and the cond-or-select rows, per tree."""
  rows: list[dict[str, Any]] = []
  configs = {name: None for name in STEP_ROWS} | {SELECT: fused_select}
  for workload, n_leaves, leaf_size in workloads:
    params = step_overhead.make_tree(n_leaves, leaf_size)
    runs = {
      name: step_overhead.prepare(name, params, jnp.float32, config=config)
      for name, config in configs.items()
    }
    medians: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
      for name, run in runs.items():
        run["times"] = []
        step_overhead.time_steps(run, steps)
        medians[name].append(statistics.median(run["times"]))
    for name, run in runs.items():
      run["step"] = statistics.median(medians[name])
    print(f"measured {workload}", flush=True)
    for name in STEP_ROWS:
      rows.append(
        _row("step_overhead", workload, name, PLAIN, runs[name], runs[PLAIN])
      )
    for name in (COND, SELECT):
      rows.append(
        _row("cond or select", workload, name, COND, runs[name], runs[COND])
      )
  return rows


def model_rows(quick: bool, rounds: int, steps: int) -> list[dict[str, Any]]:
  """`model_step.py`'s rows (one first compile each)."""
  model = model_step.QUICK if quick else model_step.FULL
  measured = model_step.measure(model, rounds=rounds, steps=steps, compiles=1)
  workload = f"{model.layers}-block transformer"
  plain = measured[0]
  rows = []
  for r in measured:
    rows.append(
      dict(
        part="model step",
        workload=workload,
        configuration=r["name"],
        vs=plain["name"],
        step=r["step_ratio"],
        compile=r["compile_ratio"],
        temp=r["temp_ratio"] if plain["temp"] >= MIN_TEMP else math.nan,
        temp_mib=r["temp"] / 2**20,
        step_ms=r["step"] * 1e3,
      )
    )
  print(f"measured the model step ({model_step.describe(model)})", flush=True)
  return rows


def sweep_section(sweep: str | None, note: str) -> list[str]:
  """The sweep's markdown table from its output, or why there is none."""
  lines = [
    "## Finiteness-check sweep (`benchmarks/finite_sweep.py --quick`)",
    "",
  ]
  if sweep is None:
    return [*lines, note or "Not run.", ""]
  text = pathlib.Path(sweep).read_text()
  table = [line for line in text.splitlines() if line.startswith("|")]
  if table:
    if len(table) < 2 or set(table[1]) - set("|-: "):
      # A table printed row by row may lack the line under its header.
      table.insert(1, "|" + "---|" * (table[0].count("|") - 1))
    return [*lines, *table, ""]
  return [
    *lines,
    "Its output (no markdown table in it):",
    "",
    "```",
    text,
    "```",
    "",
  ]


def _cell(x: float) -> str:
  return f"{x:.2f}x" if math.isfinite(x) else "-"


def markdown(rows, sweep_lines, command: str, seconds: float) -> str:
  device = jax.devices()[0].device_kind
  lines = [
    f"# Loss scaling on {jax.default_backend()} ({device})",
    "",
    _timing.header(command),
    f"- ran in {seconds:.0f} s",
    "",
    "Ratios measured in one process, configurations in turns; each ratio is"
    " to the row named in `vs`. Step: the median over rounds of each round's"
    " median step (parameters and optimizer state donated); first compile:"
    " one compile each; temporary memory:"
    " `compiled.memory_analysis().temp_size_in_bytes`, as a ratio where the"
    " row it is compared to needs at least 1 MiB, and in MiB. `step (ms)` and"
    " the MiB are absolute, on this machine only.",
    "",
    *sweep_lines,
    "## Steps",
    "",
    "| " + " | ".join(COLUMNS) + " |",
    "|" + "---|" * len(COLUMNS),
  ]
  for r in rows:
    cells = [r["part"], r["workload"], r["configuration"], r["vs"]]
    cells += [_cell(r[key]) for key in ("step", "compile")]
    cells.append(f"{_cell(r['temp'])} ({r['temp_mib']:.1f} MiB)")
    cells.append(f"{r['step_ms']:.2f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a smoke run")
  parser.add_argument(
    "--out", help="the markdown file (default ACCELERATOR_<backend>.md)"
  )
  parser.add_argument("--sweep", help="a file with the sweep's output")
  parser.add_argument(
    "--sweep-note", default="", help="why there is no sweep output"
  )
  parser.add_argument(
    "--command",
    default=None,
    help="the command to name in the file (default: this one)",
  )
  parser.add_argument(
    "--seconds-before",
    type=float,
    default=0.0,
    help="seconds spent before this script started (the sweep)",
  )
  return parser.parse_args()


def main() -> None:
  t0 = time.perf_counter()
  args = parse_args()
  out = args.out or str(
    pathlib.Path(__file__).with_name(f"ACCELERATOR_{jax.default_backend()}.md")
  )
  rounds, steps = (1, 2) if args.quick else (3, 5)
  rows = trees(QUICK_TREES if args.quick else TREES, rounds, steps)
  rows += model_rows(args.quick, rounds, steps)
  command = args.command or _timing.command_line()
  seconds = args.seconds_before + time.perf_counter() - t0
  sweep_lines = sweep_section(args.sweep, args.sweep_note)
  pathlib.Path(out).write_text(markdown(rows, sweep_lines, command, seconds))
  print(f"wrote {out} ({seconds:.0f} s)")


if __name__ == "__main__":
  main()
