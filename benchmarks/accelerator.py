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
  plain adam;
- command buffers: the fused step against plain adam on the same trees, in
  two fresh processes, one with XLA_FLAGS as given and one with
  `--xla_gpu_enable_command_buffer=+CONDITIONAL` appended (XLA reads its
  flags when the backend starts). On a GPU, that flag records the step's
  conditional in the CUDA graph (CUDA 12.4+) instead of reading its predicate
  on the host; other backends ignore it. Each process also counts the `copy`
  instructions in the fused step's compiled HLO: those of a leaf's size or
  more that keep the layout duplicate a parameter or state buffer.

Writes a markdown file (default benchmarks/ACCELERATOR_<backend>.md) with
`_timing.header()` under its title (the command, backend, device, host,
versions and date), the sweep's table (from `--sweep`, the output of
`benchmarks/finite_sweep.py --quick`), one table of the steps and one of
the command buffers. `--quick` is a smoke run on small trees and a one-block
model: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
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
Workload = tuple[str, int, int]
# A configuration prepared by `step_overhead.prepare`.
Run = dict[str, Any]
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
CONDITIONAL_FLAG = "--xla_gpu_enable_command_buffer=+CONDITIONAL"
# `name = dtype[dims]{layout} op(`, in any computation of the HLO text.
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<dtype>[a-z]\w*)"
  r"\[(?P<dims>[\d,]*)\](?P<layout>\{[^}]*\})?\s+(?P<op>[\w\-]+)\((?P<args>.*)"
)
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

  def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
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


def _row(
  part: str, workload: str, name: str, vs: str, run: Run, base: Run
) -> dict[str, Any]:
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


def trees(
  workloads: list[Workload], rounds: int, steps: int
) -> list[dict[str, Any]]:
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


def count_copies(hlo: str, min_size: int) -> tuple[int, int]:
  """`(buffer copies, all copies)` among the `copy` instructions of `hlo`.

  A buffer copy has `min_size` elements or more and keeps its operand's
  layout: a second buffer of the same array (a parameter or state leaf when
  `min_size` is the smallest leaf's size). A copy that changes the layout is
  a transpose. As `tests/test_accelerator_ready.py` counts them.
  """
  layouts: dict[str, str | None] = {}
  buffers = total = 0
  for line in hlo.splitlines():
    found = _INSTRUCTION.match(line)
    if not found:
      continue
    layouts[found["name"]] = found["layout"]
    if found["op"] != "copy":
      continue
    total += 1
    size = math.prod(int(d) for d in found["dims"].split(",") if d)
    operand = found["args"].split(")")[0].split()[-1].lstrip("%")
    if (
      size >= min_size
      and layouts.get(operand, found["layout"]) == found["layout"]
    ):
      buffers += 1
  return buffers, total


def fused_and_plain(
  workloads: list[Workload], rounds: int, steps: int
) -> list[dict[str, Any]]:
  """The fused step against plain adam in this process, and its copies."""
  rows = []
  for workload, n_leaves, leaf_size in workloads:
    params = step_overhead.make_tree(n_leaves, leaf_size)
    runs = {
      name: step_overhead.prepare(name, params, jnp.float32)
      for name in (PLAIN, COND)
    }
    medians: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
      for name, run in runs.items():
        run["times"] = []
        step_overhead.time_steps(run, steps)
        medians[name].append(statistics.median(run["times"]))
    step = {name: statistics.median(m) for name, m in medians.items()}
    buffers, total = count_copies(runs[COND]["compiled"].as_text(), leaf_size)
    rows.append(
      dict(
        workload=workload,
        ratio=step[COND] / step[PLAIN],
        step_ms=step[COND] * 1e3,
        buffer_copies=buffers,
        copies=total,
      )
    )
    print(f"measured {workload}", flush=True)
  return rows


def flag_run(out: str, quick: bool, rounds: int, steps: int) -> None:
  """This process's part of the command-buffer table, as JSON in `out`.

  `quick`: the first of the quick trees only (a smoke run of the two
  processes; the steps table has all three).
  """
  rows = fused_and_plain(QUICK_TREES[:1] if quick else TREES, rounds, steps)
  result = dict(xla_flags=os.environ.get("XLA_FLAGS", ""), rows=rows)
  pathlib.Path(out).write_text(json.dumps(result))


def command_buffer_runs(quick: bool) -> list[dict[str, Any]]:
  """`flag_run` in two fresh processes, with and without the flag.

  The first process has XLA_FLAGS as given, the second the same with
  `CONDITIONAL_FLAG` appended.
  """
  given = os.environ.get("XLA_FLAGS", "")
  runs: list[dict[str, Any]] = []
  with tempfile.TemporaryDirectory() as tmp:
    for label, flags in [
      ("as given", given),
      (f"+ `{CONDITIONAL_FLAG}`", f"{given} {CONDITIONAL_FLAG}".strip()),
    ]:
      out = pathlib.Path(tmp, f"run{len(runs)}.json")
      command = [sys.executable, __file__, "--flag-run", str(out)]
      command += ["--quick"] if quick else []
      print(f"== command buffers, XLA_FLAGS={flags!r}", flush=True)
      done = subprocess.run(
        command,
        env={**os.environ, "XLA_FLAGS": flags},
        capture_output=True,
        text=True,
        check=False,
      )
      print(done.stdout, end="", flush=True)
      run: dict[str, Any] = dict(label=label, xla_flags=flags, rows=[])
      if done.returncode == 0 and out.exists():
        run.update(json.loads(out.read_text()))
      else:
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        run["error"] = f"exit {done.returncode}: {tail[:200]}"
        print(done.stderr[-2000:], end="", flush=True)
      runs.append(run)
  return runs


def command_buffer_section(runs: list[dict[str, Any]]) -> list[str]:
  """The command-buffer table: one row per process and workload."""
  lines = [
    "## Command buffers for the conditional",
    "",
    "The fused step against plain adam, each process on its own (XLA reads"
    " its flags when the backend starts), on the trees above; the ratios of"
    " the two processes compare. On a GPU, the flag records the step's"
    " conditional in the CUDA graph (CUDA 12.4+) instead of reading its"
    " predicate on the host; other backends ignore it. Copies: the `copy`"
    " instructions in the fused step's compiled HLO; buffer copies are those"
    " of a leaf's size or more that keep the layout, each a duplicate of a"
    " parameter or state buffer (0 expected).",
    "",
    "| XLA_FLAGS | workload | fused step vs plain adam | buffer copies"
    " | copies | fused step (ms) |",
    "|---|---|---|---|---|---|",
  ]
  notes = []
  for run in runs:
    for r in run["rows"]:
      lines.append(
        f"| {run['label']} | {r['workload']} | {_cell(r['ratio'])} |"
        f" {r['buffer_copies']} | {r['copies']} | {r['step_ms']:.2f} |"
      )
    if "error" in run:
      notes.append(
        f"The process with XLA_FLAGS {run['label']} failed ({run['error']})."
      )
  flags = "; ".join(
    f"{run['label']}: "
    + (f"`{run['xla_flags']}`" if run["xla_flags"] else "none")
    for run in runs
  )
  return [*lines, "", f"XLA_FLAGS in each process: {flags}.", *notes, ""]


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


def markdown(
  rows: list[dict[str, Any]],
  sweep_lines: list[str],
  command: str,
  seconds: float,
  flag_lines: Sequence[str] = (),
) -> str:
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
  lines += ["", *flag_lines]
  return "\n".join(lines).rstrip("\n") + "\n"


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
    "--flag-run",
    metavar="JSON",
    help="only measure the command-buffer part in this process, into JSON",
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
  rounds, steps = (1, 2) if args.quick else (3, 5)
  if args.flag_run:
    flag_run(args.flag_run, args.quick, rounds, steps)
    return
  # First, while this process holds no device memory: on a GPU, JAX's
  # preallocation in this process would leave the others too little.
  flag_lines = command_buffer_section(command_buffer_runs(args.quick))
  out = args.out or str(
    pathlib.Path(__file__).with_name(f"ACCELERATOR_{jax.default_backend()}.md")
  )
  rows = trees(QUICK_TREES if args.quick else TREES, rounds, steps)
  rows += model_rows(args.quick, rounds, steps)
  command = args.command or _timing.command_line()
  seconds = args.seconds_before + time.perf_counter() - t0
  sweep_lines = sweep_section(args.sweep, args.sweep_note)
  text = markdown(rows, sweep_lines, command, seconds, flag_lines)
  pathlib.Path(out).write_text(text)
  print(f"wrote {out} ({seconds:.0f} s)")


if __name__ == "__main__":
  main()
