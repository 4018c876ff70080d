"""TensorFlow's loss scales in the tests: its own traces, and a model beyond.

`load_tf_traces()` reads `tests/data/tf_traces.json`, written by TensorFlow
2.21's own `DynamicLossScale`, `FixedLossScale` and `serialize` (see
`tests/data/README.md`): the ground truth, used bit for bit.

`tf_dynamic_loss_scale` is a plain-Python float32 model of TensorFlow's
`DynamicLossScale.update`, written from
`tensorflow/python/training/experimental/loss_scale.py`: the scale is a
float32 variable, the multiplier a Python float converted to float32, the
increase is assigned only if finite, and the decrease is floored (at 1 in
TensorFlow; at `min_loss_scale` here). `tests/test_tf_traces.py` checks its
scales and `should_apply` against every traced run, bit for bit. Use it where
the traces do not reach: the good-step counter (the traces omit it; the model
raises the scale at exactly the traced steps, so its counter wraps where
TensorFlow's does), `min_loss_scale`, `max_loss_scale`, other multipliers and
long runs.
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
