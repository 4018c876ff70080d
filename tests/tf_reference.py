"""A plain-Python float32 model of TensorFlow's `DynamicLossScale.update`.

Written from `tensorflow/python/training/experimental/loss_scale.py`: the scale
is a float32 variable, the multiplier a Python float converted to float32, the
increase is assigned only if finite, and the decrease is floored (at 1 in
TensorFlow; at `min_loss_scale` here).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


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
