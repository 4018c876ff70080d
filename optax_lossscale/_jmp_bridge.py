"""From a jmp loss scale to the equivalent `optax_lossscale` loss scale."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale import _jmp_loss_scale, _loss_scale, _validation

__all__ = ["to_loss_scale"]

_CALL = "to_loss_scale"


def _jmp_class(loss_scale: Any) -> str | None:
  """The class name of one of jmp's (or this package's jmp) loss scales."""
  cls = type(loss_scale)
  ours = (
    _jmp_loss_scale.NoOpLossScale,
    _jmp_loss_scale.StaticLossScale,
    _jmp_loss_scale.DynamicLossScale,
  )
  # jmp itself is not imported: its classes are recognised by their module.
  from_jmp = cls.__module__.split(".")[0] == "jmp"
  if cls in ours or (from_jmp and cls.__name__ in [c.__name__ for c in ours]):
    return cls.__name__
  return None


def _field(loss_scale: Any, name: str) -> float:
  value = getattr(loss_scale, name)
  if (
    isinstance(value, (np.ndarray, np.generic, jax.Array))
    and not isinstance(value, jax.core.Tracer)
    and jnp.issubdtype(value.dtype, jnp.floating)
  ):
    value = np.asarray(value, np.float64)  # exact, bfloat16 included
  return _validation.scalar(_CALL, f"loss_scale.{name}", value)


def _one_replica(ls: Any) -> None:
  """Refuses a state with a leading replica axis, saying how to pick one."""
  for name in ("loss_scale", "counter"):
    value = getattr(ls, name)
    if np.ndim(value) != 0:
      raise ValueError(
        f"`{_CALL}(loss_scale)`: its {name} must be a scalar, got an array of"
        f" shape {np.shape(value)}. A loss scale returned by `pmap` has one"
        " copy per replica: pass one replica,"
        " `jax.tree.map(lambda x: x[0], loss_scale)`."
      )


def _dynamic(ls: Any) -> _loss_scale.DynamicLossScale:
  _one_replica(ls)
  period_value = _field(ls, "period")
  if not period_value.is_integer() or period_value < 1:
    raise ValueError(
      f"`{_CALL}(loss_scale)`: its period must be a positive integer, got"
      f" {ls.period!r}."
    )
  period = int(period_value)
  factor = _field(ls, "factor")
  # The floor as float32, as both loss scales compare against it.
  minimum = float(np.float32(_field(ls, "min_loss_scale")))
  scale = _field(ls, "loss_scale")
  counter = _field(ls, "counter")
  if not factor > 1:
    raise ValueError(
      f"`{_CALL}(loss_scale)`: its factor must be greater than 1 for"
      f" `DynamicLossScale(multiplier=...)`, got {ls.factor!r}."
    )
  if not minimum > 0:
    raise ValueError(
      f"`{_CALL}(loss_scale)`: its min_loss_scale must be greater than 0 for"
      f" `DynamicLossScale(min_loss_scale=...)`, got {ls.min_loss_scale!r}."
    )
  current = np.float32(scale)
  if current < minimum:
    raise ValueError(
      f"`{_CALL}(loss_scale)`: its loss_scale {scale!r} is below its"
      f" min_loss_scale {minimum!r}; `DynamicLossScale` keeps its scale at"
      " or above the floor. Lower the floor first, e.g."
      " `dataclasses.replace(loss_scale, min_loss_scale=np.float32(...))`."
    )
  if not counter.is_integer() or not 0 <= counter < period:
    raise ValueError(
      f"`{_CALL}(loss_scale)`: its counter must be an integer in [0,"
      f" period={period}), got {ls.counter!r}."
    )
  return _loss_scale.DynamicLossScale(
    initial_loss_scale=float(current),
    increment_period=period,
    multiplier=factor,
    min_loss_scale=minimum,
    current_loss_scale=jnp.asarray(current),
    num_good_steps=jnp.asarray(counter, jnp.int32),
  )


def to_loss_scale(loss_scale: Any) -> _loss_scale.LossScale:
  """Returns the `optax_lossscale` loss scale equivalent to a jmp loss scale.

  So that a job checkpointed with jmp resumes under `LossScaleOptimizer` with
  its current scale and good-step count. Takes this module's loss scales and
  jmp's own (recognised without importing jmp), with their state as Python
  numbers or NumPy or JAX scalars (as a checkpoint restores them):

  - `DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale)`
    becomes `ols.DynamicLossScale(initial_loss_scale=loss_scale,
    increment_period=period, multiplier=factor,
    min_loss_scale=min_loss_scale, current_loss_scale=loss_scale,
    num_good_steps=counter)`, with float32 arithmetic: the two produce the
    same scales, bit for bit, on the same finite and non-finite steps. jmp's
    growth stops where the product would be infinite, and so does
    `ols.DynamicLossScale` with its default `max_loss_scale=None` (float32's
    maximum). A jmp scale in float16 or bfloat16 is read exactly, then
    evolves in float32.
  - `StaticLossScale(s)` becomes `ols.FixedLossScale(s)`.
  - `NoOpLossScale()` becomes `ols.NoOpLossScale()`.

  Call it outside `jit`: it reads the state's values. A loss scale
  replicated by `pmap` (each leaf with a leading replica axis) is refused:
  pass one replica, `jax.tree.map(lambda x: x[0], loss_scale)`.

  Args:
    loss_scale: a jmp loss scale.

  Returns:
    An `optax_lossscale.LossScale`.

  Raises:
    TypeError: if `loss_scale` is not a jmp loss scale, or a field is not
      a concrete real number.
    ValueError: if a jmp state has no `optax_lossscale` equivalent: a period
      that is not a positive integer, a factor of at most 1, a floor of at
      most 0, a scale below its floor or not finite in float32, or a counter
      outside `[0, period)` (a `StaticLossScale` below 1 is refused by
      `ols.FixedLossScale`), or a state with a replica axis. Values are never
      clipped.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> from optax_lossscale import jmp
    >>> old = jmp.DynamicLossScale(jnp.float32(2.0**12), jnp.int32(7),
    ...                            period=100)
    >>> new = jmp.to_loss_scale(old)
    >>> new()
    Array(4096., dtype=float32)
    >>> new.num_good_steps, new.increment_period, new.multiplier
    (Array(7, dtype=int32), 100, 2.0)
  """
  name = _jmp_class(loss_scale)
  if name == "DynamicLossScale":
    return _dynamic(loss_scale)
  if name == "StaticLossScale":
    return _loss_scale.FixedLossScale(_field(loss_scale, "loss_scale"))
  if name == "NoOpLossScale":
    return _loss_scale.NoOpLossScale()
  raise TypeError(
    f"`{_CALL}(loss_scale=...)` must be a jmp NoOpLossScale, StaticLossScale"
    f" or DynamicLossScale, got {type(loss_scale).__name__}"
    f" {loss_scale!r:.80}."
  )
