"""Reference models of the loss scales, for the tests: TensorFlow's own traces,
TensorFlow's algorithm in NumPy, and the hysteresis rule beyond it.

`load_tf_traces()` reads `tests/data/tf_traces.json`, written by TensorFlow
2.21's own `DynamicLossScale`, `FixedLossScale` and `serialize` (see
`tests/data/README.md`): the ground truth, used bit for bit.

`tf_dynamic_loss_scale` is a plain-Python float32 model of TensorFlow's
`DynamicLossScale.update`, written from
`tensorflow/python/training/experimental/loss_scale.py`: the scale is a
float32 variable, the multiplier a Python float converted to float32, the
increase is assigned only if finite, and the decrease is floored (at 1 in
TensorFlow; at `min_loss_scale` here). `tests/test_tf_traces.py` checks it
against every traced run, bit for bit, so the good-step counter it gives (the
traces omit it) wraps where TensorFlow's does.

`hysteresis_loss_scale` is the rule `DynamicLossScale` documents for
`hysteresis` and `consecutive_hysteresis` (Megatron-LM's `hysteresis`,
DeepSpeed's `consecutive_hysteresis`), written here from that statement and
not from the implementation; with `hysteresis=1` it is TensorFlow's.
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Iterable
from typing import Any

import numpy as np

TRACES = pathlib.Path(__file__).parent / "data" / "tf_traces.json"


@functools.cache
def load_tf_traces() -> dict[str, Any]:
  """TensorFlow's traces, as `json.load` reads them (do not mutate)."""
  with TRACES.open() as f:
    return json.load(f)


def trace_grads(step: dict[str, Any]) -> list[np.ndarray]:
  """A traced step's gradient leaves, as float32 scalars (NaN, inf, -inf)."""
  return [np.asarray(float(g), np.float32) for g in step["grads"]]


def trace_finite(step: dict[str, Any]) -> bool:
  """Whether every gradient leaf of a traced step is finite."""
  return all(np.isfinite(trace_grads(step)))


def tf_dynamic_loss_scale(
  finite_steps: Iterable[bool],
  initial_loss_scale: float = 2.0**15,
  increment_period: int = 2000,
  multiplier: float = 2.0,
  min_loss_scale: float = 1.0,
  max_loss_scale: float | None = None,
) -> list[tuple[np.float32, int, bool]]:
  """Returns `(scale, num_good_steps, should_apply)` after each step."""
  scale = np.float32(initial_loss_scale)
  m = np.float32(multiplier)
  floor = np.float32(min_loss_scale)
  good = 0
  out = []
  with np.errstate(over="ignore"):
    for finite in finite_steps:
      if finite:
        if good + 1 >= increment_period:
          raised = np.float32(scale * m)
          if np.isfinite(raised) and (
            max_loss_scale is None or raised <= np.float32(max_loss_scale)
          ):
            scale = raised
          good = 0
        else:
          good += 1
      else:
        scale = max(np.float32(scale / m), floor)
        good = 0
      out.append((scale, good, bool(finite)))
  return out


def hysteresis_loss_scale(
  finite_steps: Iterable[bool],
  *,
  scale: float,
  num_good_steps: int = 0,
  num_bad_steps: int = 0,
  increment_period: int,
  multiplier: float,
  min_loss_scale: float = 1.0,
  max_loss_scale: float | None = None,
  hysteresis: int = 1,
  consecutive_hysteresis: bool = False,
) -> list[tuple[np.float32, int, int]]:
  """Returns `(scale, num_good_steps, num_bad_steps)` after each step.

  From any state, counters outside their usual range included: a finite step
  counts a good step (and, with `consecutive_hysteresis`, forgets the bad
  ones); a full period raises the scale when the product is finite and within
  `max_loss_scale`, and restarts both counts, raised or not. A non-finite
  step restarts the good count and counts a bad step, at most `hysteresis` of
  them; once `hysteresis` have counted, it divides the scale (floored). A
  scale outside `[min_loss_scale, max_loss_scale]` counts as the nearest
  bound, and NaN as the floor.
  """
  scale = np.float32(scale)
  m = np.float32(multiplier)
  top = np.float32(np.inf if max_loss_scale is None else max_loss_scale)
  good, bad = num_good_steps, num_bad_steps
  out = []
  with np.errstate(over="ignore"):
    for finite in finite_steps:
      floor = np.float32(min_loss_scale)
      scale = min(scale, top) if scale >= floor else floor
      if finite:
        good += 1
        if consecutive_hysteresis:
          bad = 0
        if good >= increment_period:
          raised = np.float32(scale * m)
          if np.isfinite(raised) and raised <= top:
            scale = raised
          good, bad = 0, 0
      else:
        good = 0
        bad = min(bad + 1, hysteresis)
        if bad == hysteresis:
          scale = max(np.float32(scale / m), np.float32(min_loss_scale))
      out.append((scale, good, bad))
  return out
