"""Argument checks that name the call, the argument and the value."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def describe(value: Any) -> str:
  """`value` for a message: its repr, cut with an ellipsis, typed once."""
  if hasattr(value, "dtype") and hasattr(value, "shape") and np.ndim(value):
    return f"an array of {value.dtype} and shape {value.shape}"
  text = " ".join(repr(value).split())
  text = text if len(text) <= 60 else text[:57] + "..."
  name = type(value).__name__
  return text if text.startswith((name, f"np.{name}")) else f"{name} {text}"


def must(kind: type[Exception], where: str, wanted: str, got: Any) -> Exception:
  """A `kind` error saying that `where` must be `wanted` and what `got` is."""
  return kind(f"{where} must be {wanted}, got {describe(got)}.")


def scalar(call: str, name: str, value: Any) -> float:
  """`value` as a Python float, finite in float32, or raises naming it."""
  where = f"`{call}({name}=...)`"
  dtype = getattr(value, "dtype", None) or object
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{where} must be a Python number, not a traced value.")
  real = ("real floating", "integral")  # not bool: np.bool_ fails too
  if isinstance(value, bool) or not (
    isinstance(value, numbers.Real)
    or (np.ndim(value) == 0 and jnp.isdtype(dtype, real))
  ):
    raise must(TypeError, where, "a real number", value)
  try:
    result = float(value)
  except OverflowError:  # a Python int beyond float64
    result = np.inf
  if not abs(result) <= FLOAT32_MAX:
    raise must(ValueError, where, "finite in float32", value)
  return result


def positive(call: str, name: str, value: Any) -> float:
  """`value` as a positive Python float (see `scalar`), or raises."""
  result = scalar(call, name, value)
  if not result > 0:
    raise ValueError(f"`{call}({name}=...)` must be positive, got {result}.")
  return result


def integer(
  call: str, name: str, value: Any, *, minimum: int, maximum: int = INT32_MAX
) -> int:
  """`value` as a Python int in `[minimum, maximum]`, or raises."""
  where = f"`{call}({name}=...)`"
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise must(TypeError, where, "an int", value)
  if not minimum <= int(value) <= maximum:
    raise ValueError(
      f"{where} must be an int in [{minimum}, {maximum}], got {value}."
    )
  return int(value)


def boolean(call: str, name: str, value: Any) -> bool:
  """`value` if it is a Python or NumPy bool, or raises."""
  if not isinstance(value, (bool, np.bool_)):
    raise must(TypeError, f"`{call}({name}=...)`", "a bool", value)
  return bool(value)


def array_dtype(where: str, value: Any, dtype: Any) -> None:
  """Raises a `TypeError` unless `value` is an array of `dtype`.

  Arrays, tracers and `jax.ShapeDtypeStruct`s are checked; anything else
  that a tree map may put in a state (None, shardings, axis numbers) passes.
  """
  got = getattr(value, "dtype", None)
  if got is not None and not isinstance(value, np.dtype) and got != dtype:
    raise TypeError(
      f"{where} must be {np.dtype(dtype)}, got {got}: the state was cast"
      " (restore checkpoints into a target built by `init`, not a cast"
      " one); `check_state` checks a restored state."
    )


def host_values(value: Any) -> np.ndarray | None:
  """`value` on the host if it is concrete (read, waiting for it), or None.

  An array spread over several processes is read from its local shards.
  """
  concrete = (np.ndarray, np.generic, jax.Array, numbers.Number)
  if isinstance(value, jax.core.Tracer) or not isinstance(value, concrete):
    return None
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    return np.concatenate([np.ravel(s.data) for s in value.addressable_shards])
  return np.asarray(value)


def in_range(where: str, value: Any, low: float, high: float) -> None:
  """Raises a `ValueError` naming the first element outside `[low, high]`."""
  data = host_values(value)
  if data is None:
    return
  bad = data[~((data >= low) & (data <= high))]  # NaN included
  if bad.size:
    span = f"in [{low:g}, {high:g}]" if high < np.inf else f"at least {low:g}"
    raise ValueError(f"{where} must be {span}, got {bad.flat[0].item()!r}.")
