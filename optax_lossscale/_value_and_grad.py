"""The forward and backward pass with a scaled loss."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale import _states, _validation
from optax_lossscale._loss_scale import LossScale, NoOpLossScale


def _may_pass_float16(loss_scale: LossScale) -> bool:
  """Whether the scale can pass float16's largest value, 65504."""
  if isinstance(loss_scale, NoOpLossScale):
    return False
  config = loss_scale.get_config()  # a ceiling, or a fixed value, if any
  top = config.get("max_loss_scale", config.get("loss_scale_value"))
  return top is None or top > 65504


__all__ = ["scaled_value_and_grad"]


def scaled_value_and_grad(
  fun: Callable[..., Any],
  *,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """`jax.value_and_grad` of the scaled loss, returning the unscaled value.

  The returned function takes the optimizer state (or a loss scale) before
  `fun`'s own arguments, multiplies the loss by the scale, differentiates,
  and returns the loss as `fun` computed it (with `aux` when `has_aux`) and
  the *scaled* gradients, which `LossScaleOptimizer` unscales.

  Args:
    fun: the loss function; it returns a scalar, or `(scalar, aux)` with
      `has_aux`.
    argnums: which positional arguments of `fun` to differentiate.
    has_aux: whether `fun` returns `(loss, aux)`.

  Returns:
    A function `(opt_state_or_loss_scale, *args, **kwargs) -> (value,
    scaled_grads)`, where `value` is `loss` or `(loss, aux)`.

  Raises:
    TypeError: if `fun` is not callable; when called, if `fun` returns a
      tuple without `has_aux=True`.
    ValueError: when called, if the first argument holds no loss scale (the
      parameters passed first, say) or several.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> loss_fn = lambda w: jnp.sum(w.astype(jnp.float16) ** 2)
    >>> loss, grads = ols.scaled_value_and_grad(loss_fn)(
    ...     ols.FixedLossScale(1024), jnp.array([1e-4, 2.0]))
    >>> loss, grads
    (Array(4., dtype=float16), Array([2.0483398e-01, 4.0960000e+03], dtype=float32))
  """
  if not callable(fun):
    raise TypeError(
      "`scaled_value_and_grad(fun)` takes a callable, got"
      f" {_validation.describe(fun)}."
    )
  _validation.boolean("scaled_value_and_grad", "has_aux", has_aux)

  def value_and_scaled_grad(
    opt_state: Any, *args: Any, **kwargs: Any
  ) -> tuple[Any, Any]:
    loss_scale = opt_state
    if not isinstance(opt_state, LossScale):
      where = "`scaled_value_and_grad(fun)(opt_state, params, ...)`: the first"
      where += " argument, the optimizer state (did you pass the parameters?),"
      loss_scale = _states.find_loss_scale(where, opt_state)

    def scaled(*args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
      out = fun(*args, **kwargs)
      if isinstance(out, (tuple, list)) != has_aux:
        raise TypeError(
          f"`fun` returned {_validation.describe(out)} with has_aux={has_aux}:"
          " return a scalar loss, or return `(loss, aux)` and pass `has_aux=True`."
        )
      loss, aux = out if has_aux else (out, None)
      if jnp.result_type(loss) == jnp.float16 and _may_pass_float16(loss_scale):
        warnings.warn(
          "`scaled_value_and_grad` (and `minimize`): the loss is float16, so"
          " is its cotangent,"
          " the loss scale: a scale above 65504 makes every gradient inf, so"
          " each growth past 2**15 costs a skipped step. Return the loss in"
          " float32 (`loss.astype(jnp.float32)` after a float16 forward pass),"
          " or cap the scale: `DynamicLossScale(..., max_loss_scale=2.0**15)`.",
          stacklevel=4,
        )
      return loss_scale.scale(loss), ((loss, aux) if has_aux else loss)

    grads, value = jax.grad(scaled, argnums, has_aux=True)(*args, **kwargs)
    return value, grads

  return value_and_scaled_grad
