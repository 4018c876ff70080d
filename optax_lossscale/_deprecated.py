"""Names that another route replaces; each works, with a warning, through 0.3."""

from __future__ import annotations

from typing import Any

import optax

from optax_lossscale._loss_scale import LossScale
from optax_lossscale._optimizer import LossScaleOptimizer
from optax_lossscale._serialization import from_identifier
from optax_lossscale._states import find_loss_scale

# The replacement of each deprecated name, as its warning says it.
REPLACEMENTS = {
  "apply_gradients": "`LossScaleOptimizer.apply_gradients`",
  "get": "the loss scale's class, or `deserialize` for a config dict",
  "get_loss_scale": "`opt_state.loss_scale` (`opt_state[i]...` in a chain)",
  "loss_scale_optimizer": "`LossScaleOptimizer.gradient_transformation()`",
}


def get(identifier: Any) -> LossScale | None:
  """TensorFlow's `get`: a loss scale from a number, "dynamic" or a dict."""
  return None if identifier is None else from_identifier(identifier, "get")


def get_loss_scale(opt_state: optax.OptState) -> LossScale:
  """The one loss scale held in `opt_state`, at any depth."""
  return find_loss_scale("`get_loss_scale(opt_state)`", opt_state)


def loss_scale_optimizer(
  inner: optax.GradientTransformation, loss_scale: LossScale, **kwargs: Any
) -> optax.GradientTransformationExtraArgs:
  """`LossScaleOptimizer(inner, loss_scale, ...).gradient_transformation()`."""
  tx = LossScaleOptimizer(inner, loss_scale, **kwargs)
  return tx.gradient_transformation()


def apply_gradients(
  tx: Any, grads: Any, opt_state: Any, params: Any, **extra_args: Any
) -> tuple[Any, Any]:
  """`tx.update` then `optax.apply_updates`; fused for a `LossScaleOptimizer`.

  A `LossScaleOptimizer` is recognised as itself or as the `update` method
  its `gradient_transformation()` holds.
  """
  update = getattr(tx, "update", None)
  if not callable(update):
    raise TypeError(
      f"`apply_gradients(tx=...)` must be an Optax transformation, got {tx!r:.60}."
    )
  owner = getattr(update, "__self__", tx)
  if isinstance(owner, LossScaleOptimizer):
    return owner.apply_gradients(grads, opt_state, params, **extra_args)
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  return optax.apply_updates(params, updates), opt_state
