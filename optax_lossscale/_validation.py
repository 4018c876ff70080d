"""Argument checks shared by the public constructors and functions."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
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
  number: Any
  if isinstance(value, numbers.Real):
    number = value
  elif isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if np.ndim(value) != 0:
      raise ValueError(
        f"{where} must be a scalar, got an array of shape {np.shape(value)}."
      )
    array = np.asarray(value)
    if not is_real(array.dtype):
      raise TypeError(
        f"{where} must be a real number, got an array of dtype {array.dtype}."
      )
    number = array.item() if is_integer(array.dtype) else float(array)
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


def is_integer(dtype: Any) -> bool:
  """Whether `dtype` is a signed or unsigned integer dtype (not bool)."""
  return bool(np.issubdtype(dtype, np.integer))


def is_real(dtype: Any) -> bool:
  """Whether `dtype` is an integer or real floating dtype, bfloat16 included."""
  return is_integer(dtype) or bool(jnp.issubdtype(dtype, jnp.floating))


def _describe(value: Any) -> str:
  """`value` and its type, for a message."""
  if isinstance(value, jax.core.Tracer):
    return f"a traced array of dtype {value.dtype}"
  if isinstance(value, numbers.Number) and not isinstance(value, np.generic):
    return f"the Python {type(value).__name__} {value!r:.80}"
  if np.ndim(value) == 0 and not isinstance(value, jax.ShapeDtypeStruct):
    return f"{value!r:.80}"
  return f"an array of dtype {value.dtype}"


def state_dtype(where: str, value: Any, dtype: Any, *, convert: bool) -> None:
  """Raises `TypeError` unless `value` can be a state array of `dtype`.

  Without `convert`, a number or array must be of `dtype` itself (a Python
  number is refused: under `jit` it would become a weakly typed array). With
  `convert`, any real value may be given for a float dtype and any integer
  for an integer dtype (`state_array` then converts it, if it is exact); a
  tracer only of a dtype that converts exactly whatever its values. Bools are
  never a number here. Anything else (None, a container) is not checked.
  """
  dtype = np.dtype(dtype)
  if isinstance(value, (jax.core.Tracer, jax.ShapeDtypeStruct)):
    got = value.dtype
    ok = got == dtype or (
      convert
      and isinstance(value, jax.core.Tracer)
      and np.bool_ not in (got, dtype)
      and np.can_cast(got, dtype, "safe")
    )
  elif isinstance(value, (np.ndarray, np.generic, jax.Array, numbers.Number)):
    # A Python number is refused without `convert`: under `jit` it would be
    # weakly typed.
    array = isinstance(value, (np.ndarray, np.generic, jax.Array))
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
      got = np.dtype(value.dtype)  # a JAX array is not read
    else:
      got = np.asarray(value).dtype
    if got == np.bool_ and dtype != np.bool_:
      ok = False
    elif convert:
      ok = is_integer(got) or (is_real(got) and not is_integer(dtype))
    else:
      ok = got == dtype and array
  else:
    return
  if ok:
    return
  also = ""
  if convert:
    kind = "an integer" if is_integer(dtype) else "a real number"
    also = f", or {kind} exact in {dtype}"
  raise TypeError(f"{where} must be {dtype}{also}, got {_describe(value)}.")


def state_array(where: str, value: Any, dtype: Any) -> Any:
  """`value` as an array of `dtype`, or raises `ValueError` if not exact.

  `value` has passed `state_dtype(..., convert=True)`. A tracer is cast; a
  JAX array of another dtype is cast where it lives (keeping its sharding);
  a Python number or NumPy value becomes a NumPy array, after every element
  is checked to convert exactly. Anything else is returned as it is.
  """
  dtype = np.dtype(dtype)
  if isinstance(value, (jax.Array, np.ndarray)) and value.dtype == dtype:
    return value  # a tracer included
  if isinstance(value, jax.core.Tracer):
    return value.astype(dtype)
  for offset, data in host_pieces(value):
    if data.dtype == dtype:
      continue
    with np.errstate(over="ignore", invalid="ignore"):
      ok = data.astype(dtype).astype(data.dtype) == data
    index = first_bad(ok)
    if index is not None:
      got = element(offset, data, index)
      raise ValueError(
        f"{where} must be exact in {dtype}, the state's dtype, got {got}"
        f" ({data.dtype}); round it first, with np.{dtype}(...), if that is"
        " what you mean."
      )
  if isinstance(value, jax.Array):
    return value.astype(dtype)
  if isinstance(value, (numbers.Number, np.ndarray, np.generic)):
    return np.asarray(value, dtype)
  return value


def shape_of(value: Any) -> tuple[int, ...] | None:
  """`value`'s shape: () for a number, None for what is not an array."""
  if isinstance(value, numbers.Number):
    return ()
  if isinstance(
    value,
    (np.ndarray, np.generic, jax.Array, jax.ShapeDtypeStruct),
  ):
    return tuple(value.shape)
  return None


def same_shape(
  where: str, shape: tuple[int, ...], of: str, expected: tuple[int, ...]
) -> None:
  """Raises `ValueError` unless `shape` is `expected`, the shape of `of`."""
  if shape != expected:
    raise ValueError(
      f"{where} must have the shape of {of}, {expected} (a leading replica"
      f" axis included), got {shape}."
    )


def host_pieces(value: Any) -> list[tuple[tuple[int, ...], np.ndarray]]:
  """`value` read on the host, as `(offset, array)` pieces; [] if abstract.

  A Python number, NumPy array or scalar, or `jax.Array` that is not a tracer
  is concrete: it is read here (a device array synchronises). An array spread
  over processes is read shard by shard, each at its offset in the global
  array. Anything else (a tracer, None, a `jax.ShapeDtypeStruct`, a sharding)
  gives no pieces: there is nothing to read.
  """
  if isinstance(value, jax.core.Tracer):
    return []
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    return [
      (
        tuple(s.start or 0 for s in shard.index),
        np.asarray(shard.data),
      )
      for shard in value.addressable_shards
    ]
  if isinstance(value, (numbers.Number, np.ndarray, np.generic, jax.Array)):
    array = np.asarray(value)
    return [((0,) * array.ndim, array)]
  return []


def first_bad(ok: np.ndarray) -> tuple[int, ...] | None:
  """The index of the first False element of `ok`, or None."""
  if ok.all():
    return None
  return tuple(int(i) for i in np.argwhere(~ok)[0])


def element(
  offset: tuple[int, ...], data: np.ndarray, index: tuple[int, ...]
) -> str:
  """`data[index]` for a message, with its global index in an array."""
  got = repr(data[index].item())
  if data.ndim:
    at = tuple(o + i for o, i in zip(offset, index, strict=True))
    got += f" at index {at}"
  return got


def elements(
  where: str,
  value: Any,
  *,
  integer: bool,
  low: float,
  high: float | None = None,
  high_open: bool = False,
  expected: str,
) -> None:
  """Raises unless every element of a concrete `value` is in range.

  Abstract values (see `host_pieces`) pass. Each element, whatever the shape
  (a state stacked over replicas has a leading axis), must be finite and in
  `[low, high]` (`[low, high)` with `high_open`; `high=None` is no bound).
  Floating-point values are compared in float32, as the state holds them.

  Args:
    where: the call and argument, as the message names them.
    value: the value to check.
    integer: whether the value must be of an integer dtype.
    low: the lowest valid value.
    high: the highest valid value, or None.
    high_open: whether `high` itself is invalid.
    expected: what the value must be, for the message ("in [0, 3)").

  Raises:
    TypeError: if the value is a bool, not real, or not of an integer dtype
      when `integer`.
    ValueError: naming the first offending element (and its index, for an
      array), if an element is out of range.
  """
  for offset, data in host_pieces(value):
    if not (is_integer(data.dtype) if integer else is_real(data.dtype)):
      kind = "an integer" if integer else "a real number"
      got = f"{value!r:.80}" if data.ndim == 0 else f"dtype {data.dtype}"
      raise TypeError(f"{where} must be {kind}, got {got}.")
    with np.errstate(over="ignore"):  # beyond float32 is inf: not finite
      x = data if integer else data.astype(np.float32)
    ok = np.isfinite(x) & (x >= low)
    if high is not None:
      ok &= (x < high) if high_open else (x <= high)
    index = first_bad(ok)
    if index is not None:
      got = element(offset, data, index)
      raise ValueError(f"{where} must be {expected}, got {got}.")
