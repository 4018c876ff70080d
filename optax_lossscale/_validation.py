"""Argument checks shared by the public constructors and functions."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = int(np.iinfo(np.int32).max)


def scalar(call: str, name: str, value: Any) -> float:
  """Returns `value` as a Python float, or raises naming `call(name=...)`.

  Accepts Python ints and floats and numpy or jax scalars (0-d arrays);
  refuses bools, strings, None, sequences, arrays of other shapes, tracers and
  values that are NaN, infinite, or too large for float32.
  """
  where = f"`{call}({name}=...)`"
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{where} must be a number, got the bool {value!r}.")
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{where} must be a concrete number (a Python hyperparameter), got a"
      " traced value; build the loss scale outside `jit`."
    )
  if isinstance(value, numbers.Real):
    number = value
  elif isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if np.ndim(value) != 0:
      raise ValueError(
        f"{where} must be a scalar, got an array of shape {np.shape(value)}."
      )
    kind = np.asarray(value).dtype.kind
    if kind not in "iuf":
      raise TypeError(
        f"{where} must be a real number, got an array of dtype"
        f" {np.asarray(value).dtype}."
      )
    number = np.asarray(value).item()
  else:
    raise TypeError(
      f"{where} must be a number, got {type(value).__name__} {value!r:.80}."
    )
  try:
    result = float(number)
  except OverflowError:
    raise ValueError(f"{where} must be finite, got {number!r:.80}.") from None
  if not math.isfinite(result) or abs(result) > FLOAT32_MAX:
    raise ValueError(f"{where} must be finite in float32, got {value!r:.80}.")
  return result


def integer(call: str, name: str, value: Any, *, minimum: int) -> int:
  """Returns `value` as a Python int in `[minimum, int32 max]`, or raises."""
  where = f"`{call}({name}=...)`"
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (numbers.Integral, np.integer)
  ):
    raise TypeError(
      f"{where} must be an int, got {type(value).__name__} {value!r:.80}."
    )
  result = int(value)
  if not minimum <= result <= INT32_MAX:
    raise ValueError(
      f"{where} must be an int in [{minimum}, {INT32_MAX}], got {result}."
    )
  return result


def boolean(call: str, name: str, value: Any) -> bool:
  """Returns `value` if it is a Python or NumPy bool, or raises."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
      f"`{call}({name}=...)` must be a bool, got {type(value).__name__}"
      f" {value!r:.80}."
    )
  return bool(value)
