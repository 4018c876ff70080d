"""The fused step's first compile against plain Adam's, and where it goes.

Usage: PYTHONPATH=. python benchmarks/compile_step.py [--compiles N]
         [--release REV] [--no-passes] [--out DIR]

Two tables, written to benchmarks/COMPILE.md:

- First compiles at 400 and 2000 leaves of 1000: plain Adam, plain Adam
  inside one `lax.cond` (nothing else: what the conditional alone costs),
  the fused step of the release `REV` (default `7f7800e`, 0.1.0; read with
  `git archive`, skipped where git or the commit is missing), and this
  checkout's fused step (`LossScaleOptimizer.apply_gradients`) with and
  without a skip record. The median of `--compiles` fresh compiles (a
  learning rate apart, so that none is served from JAX's cache), the
  configurations in turns in one process, as ratios to plain Adam's.
- XLA's time per HLO pass for one compile of each at 400 leaves, from its
  own log (`TF_CPP_VMODULE=hlo_pass_pipeline=1`, in a child process), the
  passes that take the most: where a conditional's compile time goes on the
  backend it ran on. `--no-passes` leaves it out.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import subprocess
import sys
import tarfile
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

RELEASE = "7f7800e"  # 0.1.0
RELEASE_PACKAGE = "optax_lossscale_release"
PASS_LEAVES = 400
TOP_PASSES = 6

Config = Callable[[float], tuple[Any, Any]]


def _adam_in_one_cond(lr: float) -> tuple[Any, Any]:
  """Plain Adam inside one `lax.cond` on a gradient's finiteness.

  The conditional's own cost, which any step that skips with one pays: no
  check, unscaling or record. Returns `(init, step)`.
  """
  tx = optax.adam(lr)

  def step(params, state, grads):
    def apply(params, state):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    pred = jnp.isfinite(jax.tree.leaves(grads)[0].ravel()[0])
    return jax.lax.cond(pred, apply, lambda p, s: (p, s), params, state)

  return tx.init, step


def load_release(rev: str) -> Any | None:
  """The package as it was at commit `rev`, importable beside this one.

  Read with `git archive` and renamed `optax_lossscale_release`; None (with
  a message) where git, the repository or the commit is missing.
  """
  try:
    tar = subprocess.run(
      ["git", "-C", str(_timing.ROOT), "archive", rev, "optax_lossscale"],
      capture_output=True,
      check=True,
    ).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    print(f"release {rev} not read ({e}): its column is left out", flush=True)
    return None
  root = tempfile.mkdtemp()
  tarfile.open(fileobj=io.BytesIO(tar)).extractall(root, filter="data")
  package = os.path.join(root, RELEASE_PACKAGE)
  os.rename(os.path.join(root, "optax_lossscale"), package)
  for name in os.listdir(package):
    if name.endswith(".py"):
      path = os.path.join(package, name)
      with open(path) as f:
        text = f.read().replace("optax_lossscale", RELEASE_PACKAGE)
      with open(path, "w") as f:
        f.write(text)
  sys.path.insert(0, root)
  return importlib.import_module(RELEASE_PACKAGE)


def _release_fused(release: Any) -> Config:
  """0.1.0's fused step: `apply_gradients(loss_scale_optimizer(...))`."""

  def config(lr: float) -> tuple[Any, Any]:
    tx = release.loss_scale_optimizer(
      optax.adam(lr), release.DynamicLossScale(step_overhead.SCALE)
    )

    def step(params, state, grads):
      return release.apply_gradients(tx, grads, state, params)

    return tx.init, step

  return config


def configs(release: Any | None) -> dict[str, Config]:
  """The configurations, by column name, plain Adam first."""
  out: dict[str, Config] = {
    "plain adam": lambda lr: step_overhead.optax_step(optax.adam(lr)),
    "adam in one lax.cond": _adam_in_one_cond,
  }
  if release is not None:
    out["0.1.0 fused"] = _release_fused(release)
  out["fused"] = lambda lr: step_overhead.fused_step(lr)
  out["fused, no record"] = lambda lr: step_overhead.fused_step(
    lr, record=False
  )
  return out


def _compile(config: Config, params: Any, lr: float) -> float:
  init, step = config(lr)
  p = jax.tree.map(jnp.copy, params)
  grads = jax.tree.map(lambda x: x * 1e-3, params)
  return _timing.compile_step(step, p, init(p), grads)[1]


def compile_rows(compiles: int, release: Any | None) -> tuple[str, list[str]]:
  """The first-compile table's head and rows, printed as they come."""
  names = list(configs(release))
  columns = ["workload", "plain adam (s)", *names[1:], "record"]
  if release is not None:
    columns.append("fused vs 0.1.0")
  head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
  print(head, flush=True)
  rows = []
  for n in (400, 2000):
    params = step_overhead.make_tree(n, 1000)
    seconds: dict[str, list[float]] = {c: [] for c in names}
    for k in range(compiles):
      for name, config in configs(release).items():
        seconds[name].append(_compile(config, params, 1e-3 * (2 + k)))
    median = {c: float(np.median(s)) for c, s in seconds.items()}
    cells = [f"{n} leaves x 1000", f"{median['plain adam']:.2f}"]
    cells += [_timing.ratio(median[c], median["plain adam"]) for c in names[1:]]
    cells.append(_timing.ratio(median["fused"], median["fused, no record"]))
    if release is not None:
      cells.append(_timing.ratio(median["fused"], median["0.1.0 fused"]))
    rows.append("| " + " | ".join(cells) + " |")
    print(rows[-1], flush=True)
  return head, rows


_PASS_LINE = re.compile(r"HLO pass: (.+?) time: ([0-9.]+) (us|ms|s)\b")
_MODULE_LINE = re.compile(r"Running HLO pass pipeline on module (\S+?):")
_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def pass_times(log: str) -> Counter[str]:
  """Milliseconds per HLO pass in XLA's log, for the module `jit_step`."""
  times: Counter[str] = Counter()
  module = ""
  for line in log.splitlines():
    found = _MODULE_LINE.search(line)
    if found:
      module = found.group(1)
      continue
    found = _PASS_LINE.search(line)
    if found and module == "jit_step":
      times[found.group(1)] += float(found.group(2)) * _UNIT[found.group(3)]
  return times


def _logged_compile(name: str, release_rev: str | None) -> None:
  """In the child: one compile of `name` at `PASS_LEAVES` leaves."""
  release = load_release(release_rev) if release_rev else None
  params = step_overhead.make_tree(PASS_LEAVES, 1000)
  _compile(configs(release)[name], params, 1.234e-3)


def pass_rows(
  names: list[str], release_rev: str | None
) -> tuple[str, list[str]]:
  """XLA's time per pass (ms) for one compile of each configuration."""
  env = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL="0",
    TF_CPP_MAX_VLOG_LEVEL="1",
    TF_CPP_VMODULE="hlo_pass_pipeline=1",
  )
  times = {}
  for name in names:
    command = [sys.executable, __file__, "--logged-compile", name]
    if release_rev:
      command += ["--release", release_rev]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    times[name] = pass_times(run.stdout + run.stderr)
  last = names[-1]
  top = [p for p, _ in times[last].most_common(TOP_PASSES)]
  head = (
    "| pass (ms) | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1)
  )
  rows = [
    f"| {p} | " + " | ".join(f"{times[n][p]:.0f}" for n in names) + " |"
    for p in top
  ]
  rows.append(
    "| all passes | "
    + " | ".join(f"{sum(times[n].values()):.0f}" for n in names)
    + " |"
  )
  print(head + "\n" + "\n".join(rows), flush=True)
  return head, rows


TEXT = (
  "Median of {compiles} first compiles (lower and compile, fresh HLO each),"
  " the configurations in turns in one process, as ratios to plain Adam's."
  " `fused` is `LossScaleOptimizer(adam, DynamicLossScale())"
  ".apply_gradients`, donated; `no record` is its state without a skip"
  " record; `record` is the ratio of the two. `adam in one lax.cond` is"
  " plain Adam inside one conditional on a gradient's finiteness, with no"
  " check, unscaling or record: what the conditional alone costs to compile"
  " on this backend."
)
RELEASE_TEXT = (
  " `0.1.0 fused` is 0.1.0's fused step"
  " (`apply_gradients(loss_scale_optimizer(adam, DynamicLossScale()))`,"
  " commit `{rev}`), compiled by the same JAX in the same process."
)
PASS_TEXT = (
  "XLA's own time per HLO pass for one compile of each at"
  f" {PASS_LEAVES} leaves (its log, `TF_CPP_VMODULE=hlo_pass_pipeline=1`;"
  " the logging slows each compile), the passes that take the fused step"
  " the longest."
)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--compiles", type=int, default=3)
  parser.add_argument("--release", default=RELEASE)
  parser.add_argument("--no-passes", action="store_true")
  parser.add_argument("--out", default=os.path.dirname(__file__))
  parser.add_argument("--logged-compile", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.logged_compile:
    _logged_compile(args.logged_compile, args.release)
    return
  print(_timing.header(), flush=True)
  release = load_release(args.release) if args.release else None
  rev = args.release if release is not None else None
  head, rows = compile_rows(args.compiles, release)
  text = "# First compile of the fused step\n\n" + _timing.header() + "\n\n"
  text += TEXT.format(compiles=args.compiles)
  text += RELEASE_TEXT.format(rev=rev) if rev else ""
  text += "\n\n"
  text += head + "\n" + "\n".join(rows) + "\n"
  if not args.no_passes:
    pass_head, pass_body = pass_rows(list(configs(release)), rev)
    text += "\n" + PASS_TEXT + "\n\n" + pass_head + "\n"
    text += "\n".join(pass_body) + "\n"
  with open(os.path.join(args.out, "COMPILE.md"), "w") as f:
    f.write(text)


if __name__ == "__main__":
  main()
