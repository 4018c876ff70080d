"""The fused step's first compile against plain Adam's, and where it goes.

Usage: PYTHONPATH=. python benchmarks/first_compile.py [--compiles N]
         [--baseline REV] [--leaves N [N ...]] [--no-passes] [--out DIR]

Two tables, written to benchmarks/COMPILE.md:

- First compiles at 400 and 2000 leaves of 1000: plain Adam, plain Adam
  inside one `lax.cond` (nothing else: what the conditional alone costs),
  the same with its gradients unscaled inside the `cond` by a scale in its
  state (what a loss-scaled step adds before its check and record), the
  fused step at commit `REV` (default `7f7800e`, the last fused step
  before `LossScaleOptimizer`, `apply_gradients(loss_scale_optimizer(...))`;
  `LossScaleOptimizer.apply_gradients` at a commit that has it; read with
  `git archive`, and left out where git, the commit or its import fails;
  `--baseline ""` leaves it out), and this checkout's fused step
  (`LossScaleOptimizer.apply_gradients`). The
  median of `--compiles` fresh compiles (a learning rate apart, so that none
  is served from JAX's caches), the configurations in turns in one process,
  the order rotated each round: the median and the range of each round's
  ratio to plain Adam's compile in the same round. The times include JAX's
  tracing and lowering.
- XLA's time per HLO pass for one compile of each at the first of
  `--leaves` (400 by default), from its
  own log (`TF_CPP_VMODULE=hlo_pass_pipeline=1`, in a child process per
  configuration), the passes that take the fused step the longest; nested
  pipelines are left out so that nothing is counted twice. A pass is
  credited to the module whose pipeline last started: right on XLA's CPU
  backend, which compiles one module at a time; a backend that compiles
  other modules inside a pass (GPU autotuning) may lose the passes after
  it. `--no-passes` leaves the table out.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import _timing
import jax
import jax.numpy as jnp
import numpy as np
import optax
import step_overhead

BASELINE = "7f7800e"
TOP_PASSES = 6

Config = Callable[[float], tuple[Any, Any]]


def adam_in_one_cond(lr: float, unscale: bool = False) -> tuple[Any, Any]:
  """Plain Adam inside one `lax.cond` on a gradient's finiteness.

  The conditional's own cost, which any step that skips with one pays: no
  check or record. With `unscale`, the gradients are unscaled inside the
  `cond` by a scale the state carries (multiplied by its reciprocal, as a
  loss scale's `unscale` does): what every loss-scaled step adds to it
  before its check. Returns `(init, step)`.
  """
  tx = optax.adam(lr)

  def init(params):
    return tx.init(params), jnp.float32(step_overhead.SCALE)

  def step(params, state, grads):
    inner, scale = state

    def apply(params, inner):
      unscaled = grads
      if unscale:  # one reciprocal, as a loss scale's `unscale` computes
        inverse = 1 / scale
        unscaled = jax.tree.map(lambda g: g * inverse, grads)
      updates, inner = tx.update(unscaled, inner, params)
      return optax.apply_updates(params, updates), inner

    pred = jnp.isfinite(jax.tree.leaves(grads)[0].ravel()[0])
    params, inner = jax.lax.cond(pred, apply, lambda *x: x, params, inner)
    return params, (inner, scale)

  return init, step


def configs(baseline: Any | None, rev: str) -> dict[str, Config]:
  """The configurations, by column name, plain Adam first."""
  out: dict[str, Config] = {
    "plain adam": lambda lr: step_overhead.optax_step(optax.adam(lr)),
    "adam in one lax.cond": adam_in_one_cond,
    "adam in one lax.cond, unscaled": lambda lr: adam_in_one_cond(
      lr, unscale=True
    ),
  }
  if baseline is not None:
    out[f"fused at {rev}"] = lambda lr: step_overhead.fused_step_of(
      baseline, lr
    )
  out["fused"] = lambda lr: step_overhead.fused_step(lr)
  return out


def first_compile(config: Config, params: Any, lr: float) -> float:
  """Seconds to lower and compile `config(lr)`'s donated step on `params`."""
  init, step = config(lr)
  p = jax.tree.map(jnp.copy, params)
  grads = jax.tree.map(lambda x: x * 1e-3, params)
  return _timing.compile_step(step, p, init(p), grads)[1]


def compile_rows(
  compiles: int, leaves: list[int], named: dict[str, Config]
) -> tuple[str, list[str]]:
  """The first-compile table's head and rows, printed as they come."""
  names = list(named)
  columns = ["workload", "plain adam (s)", *names[1:]]
  head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
  print(head, flush=True)
  # One compile first, discarded: the process's one-time costs.
  first_compile(named["plain adam"], step_overhead.make_tree(8, 1000), 0.5)
  rows = []
  for n in leaves:
    params = step_overhead.make_tree(n, 1000)
    seconds: dict[str, list[float]] = {c: [] for c in names}
    for k in range(compiles):
      for name in names[k % len(names) :] + names[: k % len(names)]:
        seconds[name].append(first_compile(named[name], params, 1e-3 * (2 + k)))
    base = seconds["plain adam"]
    spread = f"{np.min(base):.2f}-{np.max(base):.2f}"
    cells = [f"{n} leaves x 1000", f"{np.median(base):.2f} ({spread})"]
    cells += [_timing.ratio_range(seconds[c], base) for c in names[1:]]
    rows.append("| " + " | ".join(cells) + " |")
    print(rows[-1], flush=True)
  return head, rows


_PASS = re.compile(r"HLO pass: (.+?) time: ([0-9.]+) (us|ms|s)\b")
_PIPELINE = re.compile(r"Running HLO pass pipeline on module (\S+?): (.+)$")
_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def pass_times(log: str, module: str = "jit_step") -> Counter[str]:
  """Milliseconds per HLO pass of `module` in XLA's log.

  Nested pipelines (which XLA logs as passes too, their inner passes
  included) are left out, so that nothing is counted twice.
  """
  times: Counter[str] = Counter()
  pipelines, current = set(), ""
  for line in log.splitlines():
    found = _PIPELINE.search(line)
    if found:
      current = found.group(1)
      pipelines.add(found.group(2).strip())
      continue
    found = _PASS.search(line)
    if found and current == module:
      times[found.group(1)] += float(found.group(2)) * _UNIT[found.group(3)]
  for name in pipelines:
    times.pop(name, None)
  return times


def _child_log(name: str, leaves: int, root: str | None, rev: str) -> str:
  """XLA's log of one compile of `name` at `leaves` leaves, in a child."""
  env = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL="0",
    TF_CPP_VMODULE="hlo_pass_pipeline=1",
  )
  # A global level would log every XLA file and time the logging.
  env.pop("TF_CPP_MAX_VLOG_LEVEL", None)
  command = [sys.executable, __file__, "--logged-compile", name]
  command += ["--leaves", str(leaves), "--baseline", rev]
  command += ["--baseline-root", root or ""]
  run = subprocess.run(command, env=env, capture_output=True, text=True)
  if run.returncode != 0:
    raise RuntimeError(f"compiling {name!r} failed:\n{run.stderr[-2000:]}")
  return run.stdout + run.stderr


def pass_rows(
  names: list[str], leaves: int, root: str | None, rev: str
) -> list[str]:
  """The pass table (ms): one compile of each configuration, in a child."""
  times = {n: pass_times(_child_log(n, leaves, root, rev)) for n in names}
  empty = [n for n, t in times.items() if not t]
  if empty:
    raise RuntimeError(f"no pass times found in XLA's log for {empty}")
  top = [p for p, _ in times["fused"].most_common(TOP_PASSES)]
  cells = {p: [f"{times[n][p]:.0f}" for n in names] for p in top}
  cells["all passes"] = [f"{sum(times[n].values()):.0f}" for n in names]
  rows = ["| pass (ms) | " + " | ".join(names) + " |"]
  rows.append("|" + "---|" * (len(names) + 1))
  rows += [f"| {p} | " + " | ".join(c) + " |" for p, c in cells.items()]
  print("\n".join(rows), flush=True)
  return rows


TEXT = (
  "Median of {compiles} first compiles (lower and compile, fresh HLO each),"
  " the configurations in turns in one process (the order rotated each"
  " round): the median of the rounds' ratios to plain Adam's compile in the"
  " same round, and their range in brackets (plain Adam's own seconds: the"
  " median and range). The times include JAX's tracing and lowering."
  " `fused` is `LossScaleOptimizer(adam,"
  " DynamicLossScale(2**10)).apply_gradients`, donated, as every step here"
  " is. `adam in one"
  " lax.cond` is plain Adam inside one conditional on a gradient's"
  " finiteness, with no check, unscaling or record: what the conditional"
  " alone costs to compile on this backend. `unscaled` is the same with its"
  " gradients multiplied inside the conditional by the reciprocal of a scale"
  " its state carries: what any loss-scaled step costs before its check and"
  " record."
)
BASELINE_TEXT = (
  " `fused at {rev}` is the fused step of commit `{rev}` ({call}),"
  " read with `git archive` and compiled by the same JAX in the same"
  " process."
)
PASS_TEXT = (
  "XLA's own time per HLO pass for one compile of each at"
  " {leaves} leaves (its log, `TF_CPP_VMODULE=hlo_pass_pipeline=1`),"
  " the passes that take the fused step the longest, and all passes"
  " together (nested pipelines left out)."
)


def _logged_compile(name: str, leaves: int, root: str | None, rev: str) -> None:
  """In the child: one compile of `name` at `leaves` leaves."""
  params = step_overhead.make_tree(leaves, 1000)
  baseline = _timing.import_baseline(root)
  first_compile(configs(baseline, rev)[name], params, 1.234e-3)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--compiles", type=int, default=3)
  parser.add_argument("--baseline", default=BASELINE)
  parser.add_argument("--leaves", type=int, nargs="+", default=[400, 2000])
  parser.add_argument("--no-passes", action="store_true")
  parser.add_argument("--out", default=os.path.dirname(__file__))
  parser.add_argument("--logged-compile", help=argparse.SUPPRESS)
  parser.add_argument("--baseline-root", help=argparse.SUPPRESS)
  args = parser.parse_args()
  # A persistent cache would serve a repeated program without compiling it.
  jax.config.update("jax_enable_compilation_cache", False)
  if args.logged_compile:
    root = args.baseline_root or None
    _logged_compile(args.logged_compile, args.leaves[0], root, args.baseline)
    return
  print(_timing.header(), flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    root = (
      tmp
      if args.baseline and _timing.extract_baseline(args.baseline, tmp)
      else None
    )
    baseline = _timing.import_baseline(root)
    root = root if baseline is not None else None
    named = configs(baseline, args.baseline)
    head, rows = compile_rows(args.compiles, args.leaves, named)
    text = "# First compile of the fused step\n\n" + _timing.header() + "\n\n"
    text += TEXT.format(compiles=args.compiles)
    if baseline is not None:
      call = step_overhead.fused_call(baseline)
      text += BASELINE_TEXT.format(rev=args.baseline, call=call)
    text += "\n\n" + head + "\n" + "\n".join(rows) + "\n"
    if not args.no_passes:
      passes = pass_rows(list(named), args.leaves[0], root, args.baseline)
      text += "\n" + PASS_TEXT.format(leaves=args.leaves[0]) + "\n\n"
      text += "\n".join(passes) + "\n"
  with open(os.path.join(args.out, "COMPILE.md"), "w") as f:
    f.write(text)


if __name__ == "__main__":
  main()
