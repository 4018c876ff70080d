"""Timing, compiling and memory helpers shared by the benchmark scripts.

Every script measures its configurations in turns in one process and reports
ratios; these are the pieces they share: a timed first compile of a donated
step, its temporary memory, timed steps whose outputs are fed back, and the
description of the machine that goes beside every figure.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib
import optax


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


def environment() -> dict[str, str]:
  """What a figure was measured on: backend, device, versions, date."""
  device = jax.devices()[0]
  return {
    "backend": jax.default_backend(),
    "device kind": f"{device.device_kind} x {jax.device_count()}",
    "host": (
      f"{platform.processor() or platform.machine()},"
      f" {os.cpu_count()} CPU cores, python {platform.python_version()}"
    ),
    "versions": (
      f"jax {jax.__version__}, jaxlib {jaxlib.__version__},"
      f" optax {optax.__version__}"
    ),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
  }


def ratio(a: float, b: float) -> str:
  """`a / b` as a table cell (`-` when it is not a number)."""
  r = a / b if b else float("nan")
  return f"{r:.2f}x" if math.isfinite(r) else "-"
