"""The forward and backward pass with a scaled loss."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from optax_lossscale._loss_scale import LossScale
from optax_lossscale._states import get_loss_scale

__all__ = ["scaled_value_and_grad"]


def scaled_value_and_grad(
  fun: Callable[..., Any],
  *,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """`jax.value_and_grad` of the scaled loss, returning the unscaled value.

  In the spirit of flax's `DynamicScale.value_and_grad`: the returned function
  takes the loss scale (or an optimizer state holding one) before `fun`'s own
  arguments, multiplies the loss by the scale, differentiates, and returns
  the loss value as `fun` computed it (with `aux` when `has_aux`) and the
  *scaled* gradients, ready for `loss_scale_optimizer` or
  `unscale_gradients`, which unscale them.

  Args:
    fun: the loss function; it returns a scalar, or `(scalar, aux)` when
      `has_aux`.
    argnums: which positional arguments of `fun` to differentiate.
    has_aux: whether `fun` returns `(loss, aux)`.

  Returns:
    A function `(loss_scale_or_opt_state, *args, **kwargs) -> (value,
    scaled_grads)`, where `value` is `loss` or `(loss, aux)`.

  Raises:
    TypeError: if `fun` is not callable.
    ValueError: when called, if the optimizer state given holds no loss scale
      or several (as `get_loss_scale`).

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
      f"`scaled_value_and_grad(fun)` takes a callable, got {fun!r:.80}."
    )

  def value_and_scaled_grad(
    loss_scale: Any, *args: Any, **kwargs: Any
  ) -> tuple[Any, Any]:
    if not isinstance(loss_scale, LossScale):
      loss_scale = get_loss_scale(loss_scale)

    def scaled(*args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
      out = fun(*args, **kwargs)
      loss, aux = out if has_aux else (out, None)
      return loss_scale.scale(loss), (loss, aux)

    (_, (loss, aux)), grads = jax.value_and_grad(
      scaled, argnums=argnums, has_aux=True
    )(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return value_and_scaled_grad
