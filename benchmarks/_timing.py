"""Timing, compiling and memory helpers shared by the benchmark scripts.

Every script measures its configurations in turns in one process and reports
ratios; these are the pieces they share: a timed first compile of a donated
step, its temporary memory, timed steps whose outputs are fed back, and the
header every results file has under its title: the command that wrote it,
the machine, the versions and the date; and the package at an earlier
commit, importable beside this checkout's, for "now against then" rows.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import io
import math
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The name the package at an earlier commit is imported under.
BASELINE_PACKAGE = "optax_lossscale_baseline"
# The load average when this module loads, before a script measures anything:
# the header's, wherever the script writes it (at the end, the figure would
# be the script's own load).
LOAD_AT_START = os.getloadavg()


def compile_step(
  step: Callable[..., Any],
  *args: Any,
  donate_argnums: tuple[int, ...] = (0, 1),
) -> tuple[Any, float]:
  """Lowers and compiles `jax.jit(step)` for `args`, timed.

  Args:
    step: the function to compile.
    *args: example arguments (only their shapes, dtypes and shardings are
      used).
    donate_argnums: the arguments donated to the compiled step.

  Returns:
    `(compiled, seconds)`. The seconds are a first compile only when the
    program is new to this process (JAX serves a repeated one from its cache):
    vary a constant, such as a learning rate, between compiles.
  """
  t0 = time.perf_counter()
  lowered = jax.jit(step, donate_argnums=donate_argnums).lower(*args)
  compiled = lowered.compile()
  return compiled, time.perf_counter() - t0


def compile_model_step(
  factory: Callable[..., Any], model: Any, params: Any, batch: Any, lr: float
) -> tuple[Any, float, tuple[Any, Any]]:
  """A first compile of a whole train step at learning rate `lr`.

  `factory(model.loss, lr)` returns `(init, step)`; `step(params, state,
  batch)` is compiled on copies of `params` and their fresh state.

  Returns:
    `(compiled, seconds, (params, state))`: the copies, to run it on.
  """
  init, step = factory(model.loss, lr)
  p = jax.tree.map(jnp.copy, params)
  s = init(p)
  compiled, seconds = compile_step(step, p, s, batch)
  return compiled, seconds, (p, s)


def temp_bytes(compiled: Any) -> float:
  """The compiled program's temporary memory in bytes (nan where unknown)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return float("nan")
  return float(analysis.temp_size_in_bytes)


def step_times(
  step: Callable[..., Any], carry: Sequence[Any], rest: Sequence[Any], n: int
) -> tuple[list[float], tuple[Any, ...]]:
  """Times `n` calls of `step(*carry, *rest)`, each fed the last one's carry.

  Args:
    step: a compiled step whose first `len(carry)` outputs are the next
      call's `carry` (donated parameters and state).
    carry: the donated arguments.
    rest: the other arguments (a batch, gradients).
    n: how many calls.

  Returns:
    `(seconds of each call, the last carry)`.
  """
  carry = tuple(carry)
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    out = step(*carry, *rest)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
    carry = tuple(out[: len(carry)])
  return times, carry


def command_line(argv: Sequence[str] | None = None) -> str:
  """The command that started this process, as a user would type it again.

  Args:
    argv: the arguments, script first (default `sys.argv`). A script inside
      the repository is named by its path from the repository's root, so the
      command reads the same from whichever directory it ran; a `.py` script
      is preceded by `python`.

  Returns:
    The command, its arguments quoted for a POSIX shell where they need it.

  Examples:
    >>> command_line(["benchmarks/step_overhead.py", "--sharded"])
    'python benchmarks/step_overhead.py --sharded'
  """
  args = list(sys.argv if argv is None else argv)
  if not args or not args[0]:
    return "python"
  script = pathlib.Path(args[0]).resolve()
  if script.is_file() and script.is_relative_to(ROOT):
    args[0] = script.relative_to(ROOT).as_posix()
  # `python -c ...` leaves "-c" where the script would be.
  prefix = ["python"] if args[0].endswith(".py") or args[0] == "-c" else []
  return shlex.join([*prefix, *args])


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def environment(
  command: str | None = None, packages: Sequence[str] = ()
) -> dict[str, str]:
  """What a figure was measured on, by which command and when.

  Args:
    command: the command that produced the figures (default
      `command_line()`).
    packages: distributions to name beside jax, jaxlib, optax and
      optax_lossscale (as `pip` names them, e.g. `"dm-haiku"`).

  Returns:
    The command, backend, device (its kind and how many), host, versions,
    load average (`LOAD_AT_START`: a busy machine's figures are noisy) and
    date (UTC), by those names, in that order.
  """
  device = jax.devices()[0]
  names = ("jax", "jaxlib", "optax", "optax_lossscale", *packages)
  versions = [f"{name} {_version(name)}" for name in names]
  versions.append(f"python {platform.python_version()}")
  return {
    "command": f"`{command_line() if command is None else command}`",
    "backend": jax.default_backend(),
    "device": f"{device.device_kind} x {jax.device_count()}",
    "host": (
      f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    ),
    "versions": ", ".join(versions),
    "load average": "{:.2f}, {:.2f}, {:.2f} (1, 5, 15 min, at start)".format(
      *LOAD_AT_START
    ),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
  }


def header(command: str | None = None, packages: Sequence[str] = ()) -> str:
  """The lines every results file has under its title: `environment()`.

  Args:
    command: the command that produced the file (default `command_line()`).
    packages: distributions to name beside jax, jaxlib, optax and
      optax_lossscale (as `pip` names them, e.g. `"dm-haiku"`).

  Returns:
    A markdown list, one `- key: value` line each for the command, backend,
    device, host, versions, load average and date, without a final newline.

  Examples:
    >>> print(header("python benchmarks/train_step.py"))  # doctest: +SKIP
    - command: `python benchmarks/train_step.py`
    - backend: cpu
    - device: cpu x 1
    - host: x86_64, 2 cores, Linux
    - versions: jax 0.10.2, jaxlib 0.10.2, optax 0.2.8, ...
    - load average: 0.31, 0.52, 0.60 (1, 5, 15 min, at start)
    - date: 2026-12-03
  """
  env = environment(command, packages)
  return "\n".join(f"- {key}: {value}" for key, value in env.items())


def ratio_range(seconds: Sequence[float], base: Sequence[float]) -> str:
  """The median and range of the rounds' ratios of `seconds` to `base`.

  Args:
    seconds: one time per round.
    base: the baseline's time in the same rounds.

  Returns:
    A table cell, e.g. `1.02x (0.99-1.05)`.
  """
  ratios = np.asarray(seconds) / np.asarray(base)
  low, median, high = np.min(ratios), np.median(ratios), np.max(ratios)
  return f"{median:.2f}x ({low:.2f}-{high:.2f})"


def ratio(a: float, b: float) -> str:
  """`a / b` as a table cell (`-` when it is not a number)."""
  r = a / b if b else float("nan")
  return f"{r:.2f}x" if math.isfinite(r) else "-"


def extract_baseline(rev: str, root: str) -> bool:
  """Writes the package at commit `rev` to `root`, renamed; False if it can't.

  The copy is `optax_lossscale_baseline` (its own imports renamed too),
  importable beside this checkout's package once `root` is on the path.
  """
  try:
    tar = subprocess.run(
      ["git", "-C", str(ROOT), "archive", rev, "optax_lossscale"],
      capture_output=True,
      check=True,
    ).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    print(f"commit {rev} not read ({e}): its rows are left out", flush=True)
    return False
  # Our own repository's files; the filter where this Python has it.
  safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
  with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
    archive.extractall(root, **safe)
  package = os.path.join(root, BASELINE_PACKAGE)
  os.rename(os.path.join(root, "optax_lossscale"), package)
  for folder, _, files in os.walk(package):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        with open(path) as f:
          text = f.read().replace("optax_lossscale", BASELINE_PACKAGE)
        with open(path, "w") as f:
          f.write(text)
  return True


def import_baseline(root: str | None) -> Any | None:
  """The package `extract_baseline` wrote to `root`; None if it won't serve.

  It serves if it has `LossScaleOptimizer`, or the free functions
  `loss_scale_optimizer` and `apply_gradients` that came before it.
  """
  if root is None:
    return None
  sys.path.insert(0, root)
  try:
    baseline = importlib.import_module(BASELINE_PACKAGE)
    if not hasattr(baseline, "LossScaleOptimizer"):
      baseline.loss_scale_optimizer, baseline.apply_gradients  # noqa: B018
  except (ImportError, AttributeError) as e:
    print(f"the baseline does not serve ({e!r}): left out", flush=True)
    return None
  return baseline
