"""The optimizer states that hold a loss scale, and `get_loss_scale`."""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax

from optax_lossscale._loss_scale import LossScale

__all__ = [
  "LossScaleOptimizerState",
  "UnscaleGradientsState",
  "get_loss_scale",
]


class UnscaleGradientsState(NamedTuple):
  """The state of `unscale_gradients`.

  Attributes:
    loss_scale: the loss scale to use for the next step.
    should_apply: whether the last step's gradients were fit to apply (a bool
      scalar); True before the first step.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> tx = ols.unscale_gradients(ols.DynamicLossScale(8.0))
    >>> _, state = tx.update({"w": jnp.array([jnp.inf])}, tx.init(None))
    >>> float(state.loss_scale()), bool(state.should_apply)
    (4.0, False)
  """

  loss_scale: LossScale
  should_apply: jax.Array


class LossScaleOptimizerState(NamedTuple):
  """The state of `LossScaleOptimizer` (and `loss_scale_optimizer`).

  Attributes:
    loss_scale: the loss scale to use for the next step.
    inner_state: the state of the wrapped transformation; unchanged by skipped
      steps.
    should_apply: whether the last step was applied (a bool scalar); True
      before the first step.
    skipped_steps: how many steps were skipped in all (int32): batches
      dropped, whatever the reason.
    consecutive_skipped_steps: how many steps were skipped since the last
      applied one (int32).
    nonfinite_loss_steps: how many of the skipped steps had a non-finite loss
      (`value=`), int32.
    retries: how many times `minimize` recomputed a batch at a lower scale
      (int32).

  A 0.1.0 checkpoint (five fields) restores into a dict of the first five
  fields, `{k: v for k, v in tx.init(params)._asdict().items() if k not in
  ("nonfinite_loss_steps", "retries")}`, and then into the full state with
  `tx.init(params)._replace(**restored)`. A state whose two new counters are
  None steps too, and keeps them None.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
    >>> params = {"w": jnp.zeros(2)}
    >>> _, state = tx.update(
    ...   {"w": jnp.array([jnp.nan, 1.0])}, tx.init(params), params
    ... )
    >>> int(state.skipped_steps), bool(state.should_apply)
    (1, False)
  """

  loss_scale: LossScale
  inner_state: optax.OptState
  should_apply: jax.Array
  skipped_steps: jax.Array
  consecutive_skipped_steps: jax.Array
  nonfinite_loss_steps: jax.Array | None = None
  retries: jax.Array | None = None


_STATES = (UnscaleGradientsState, LossScaleOptimizerState)


def get_loss_scale(opt_state: optax.OptState) -> LossScale:
  """Returns the current loss scale held in an optimizer state.

  Searches the whole state, through `optax.chain`, `optax.MultiSteps`,
  `optax.inject_hyperparams`, `optax.multi_transform` and any other nesting,
  for the state of `unscale_gradients` or `LossScaleOptimizer`.

  Args:
    opt_state: an optimizer state.

  Returns:
    The `LossScale` to scale the next step's loss with.

  Raises:
    ValueError: if the state holds no loss scale, or more than one.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = optax.chain(optax.clip(1.0), ols.loss_scale_optimizer(
    ...     optax.adam(1e-3), ols.FixedLossScale(256)))
    >>> ols.get_loss_scale(tx.init(jnp.zeros(3)))
    FixedLossScale(loss_scale_value=256.0)
  """
  found = [
    node
    for node in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, _STATES)
    )
    if isinstance(node, _STATES)
  ]
  if len(found) != 1:
    raise ValueError(
      "`get_loss_scale(opt_state)` expects exactly one loss scale in the"
      f" state (from `unscale_gradients` or `LossScaleOptimizer`), found"
      f" {len(found)}."
    )
  return found[0].loss_scale
