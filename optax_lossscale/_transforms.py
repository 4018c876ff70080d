"""Loss scaling as Optax gradient transformations."""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import optax

from optax_lossscale import _numerics
from optax_lossscale._loss_scale import LossScale
from optax_lossscale._optimizer import (
  LossScaleOptimizer,
  check_loss_scale,
  check_state_type,
  check_structure,
  decide,
  fresh_copy,
  optimizer_of,
  verdicts,
)
from optax_lossscale._states import UnscaleGradientsState

__all__ = ["apply_gradients", "loss_scale_optimizer", "unscale_gradients"]


def unscale_gradients(
  loss_scale: LossScale, *, axis_name: _numerics.AxisName = None
) -> optax.GradientTransformationExtraArgs:
  """Unscales the gradients and updates the loss scale; never skips.

  Put it first in an `optax.chain`. It divides the incoming (scaled)
  gradients by the loss scale, then updates the loss scale from them (see
  `LossScale.grads_finite`) and stores the new loss scale and `should_apply`
  in its state. It only reports: the rest of the chain runs on every step.
  Given the loss as `value=`, a step whose loss is not finite reports
  `should_apply` False and leaves the loss scale unchanged.

  To skip non-finite steps, use `LossScaleOptimizer`, which skips for you, or
  skip *after* this transformation, so that its `update` runs on every step:
  only that call lowers the scale. Pairings that back off on an overflow:

  - `optax.chain(unscale_gradients(loss_scale), optax.apply_if_finite(inner,
    max_consecutive_errors=...))`: `inner` skips the steps whose unscaled
    gradients are not finite (but after `max_consecutive_errors` of them in a
    row, `apply_if_finite` applies one anyway);
  - your own `lax.cond` on this state's `should_apply` that keeps this
    transformation's new state on a skipped step, and only the rest of the
    old state (the train-step guide, docs/guides/train_step.md).

  Pitfall: a skip *before* it stalls the loss scale. On a skipped step this
  `update` is not called, so the scale is never lowered, and a scale too high
  for the gradients keeps every step skipped, for ever. This happens
  with `optax.MultiSteps(chain(unscale_gradients(...), ...),
  should_skip_update_fn=optax.skip_not_finite)`, with
  `optax.apply_if_finite(chain(unscale_gradients(...), ...))`, and with a
  `lax.cond` that keeps the whole old optimizer state on a skipped step.

  Args:
    loss_scale: the initial loss scale.
    axis_name: a mapped axis over which replicas must agree (see `all_finite`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is an
    `UnscaleGradientsState`.

  Raises:
    TypeError: if `loss_scale` is not a `LossScale`. Its `update` raises
      ValueError when `params` are given and the gradients differ from them
      in structure or a leaf's shape (naming the leaf).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = optax.chain(ols.unscale_gradients(ols.FixedLossScale(4.0)),
    ...                  optax.sgd(1.0))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> updates, state = tx.update({"w": jnp.array([4.0, 8.0])}, state)
    >>> updates["w"]
    Array([-1., -2.], dtype=float32)

    Skipping after it, with `optax.apply_if_finite`: a NaN step is skipped
    and lowers the scale.

    >>> tx = optax.chain(
    ...     ols.unscale_gradients(ols.DynamicLossScale(8.0)),
    ...     optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=100))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 8.0])}, state)
    >>> updates["w"], float(ols.get_loss_scale(state)())
    (Array([0., 0.], dtype=float32), 4.0)
  """
  check_loss_scale("unscale_gradients", loss_scale)

  def init_fn(params: optax.Params) -> UnscaleGradientsState:
    del params
    return UnscaleGradientsState(fresh_copy(loss_scale), jnp.array(True))

  update_fn = functools.partial(_unscale_update, axis_name)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _unscale_update(
  axis_name: _numerics.AxisName,
  updates: optax.Updates,
  state: UnscaleGradientsState,
  params: optax.Params | None = None,
  **extra_args: Any,
) -> tuple[optax.Updates, UnscaleGradientsState]:
  """`unscale_gradients`' update: unscale, check, and the new state."""
  call = "unscale_gradients"
  check_state_type(call, state, UnscaleGradientsState)
  check_structure(call, updates, params)
  # The check reads the incoming gradients: the unscaling is then fused into
  # the rest of the chain instead of being written out as a separate buffer.
  checks = verdicts(
    call, state.loss_scale, updates, extra_args.get("value"), axis_name
  )
  decision = decide(
    state.loss_scale,
    checks.grads_finite,
    checks.loss_finite,
    skip_nonfinite=False,
  )
  return state.loss_scale.unscale(updates), UnscaleGradientsState(
    decision.loss_scale, decision.should_apply
  )


def loss_scale_optimizer(
  inner: optax.GradientTransformation,
  loss_scale: LossScale,
  **kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """`LossScaleOptimizer(inner, loss_scale, ...).gradient_transformation()`.

  The factory form of `LossScaleOptimizer`, for code that expects a plain
  Optax transformation; `apply_gradients` still takes the fused path with it.

  Args:
    inner: the optimizer to wrap.
    loss_scale: the initial loss scale.
    **kwargs: the keyword arguments of `LossScaleOptimizer` (`skip_nonfinite`,
      `axis_name`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `LossScaleOptimizerState`.

  Raises:
    TypeError: if `inner` is not an Optax transformation, `loss_scale` not a
      `LossScale`, or a keyword argument is not one of `LossScaleOptimizer`'s.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(2.0), ols.DynamicLossScale(
    ...     initial_loss_scale=2.0, increment_period=1))
    >>> params = {"w": jnp.array(5.0)}
    >>> state = tx.init(params)
    >>> grads = jax.grad(lambda p: ols.get_loss_scale(state).scale(p["w"]))(
    ...     params)
    >>> updates, state = tx.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"], ols.get_loss_scale(state)()
    (Array(3., dtype=float32), Array(4., dtype=float32))
  """
  return LossScaleOptimizer(
    inner, loss_scale, **kwargs
  ).gradient_transformation()


def apply_gradients(
  tx: optax.GradientTransformation | LossScaleOptimizer,
  grads: optax.Updates,
  opt_state: optax.OptState,
  params: optax.Params,
  **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
  """`tx.update` followed by `optax.apply_updates`, as one step.

  When `tx` is a `LossScaleOptimizer`, or what its `gradient_transformation()`
  (or `loss_scale_optimizer`) returned, this is
  `LossScaleOptimizer.apply_gradients`: the parameters are updated inside the
  same `lax.cond` as the inner optimizer, so the updates never leave it as a
  separate buffer, a skipped step writes nothing, and donated parameters and
  state are updated in place. The results are those of `tx.update` then
  `optax.apply_updates`, up to rounding (XLA may fuse the last multiply of the
  update and the addition into one operation). For any other transformation
  it is exactly those two calls.

  Args:
    tx: a `LossScaleOptimizer` or any Optax transformation.
    grads: the (scaled) gradients.
    opt_state: the state of `tx`.
    params: the parameters.
    **extra_args: passed to `tx` (`value=`, the loss, included).

  Returns:
    `(new_params, new_opt_state)`.

  Raises:
    TypeError: if `tx` has no `update` method.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.FixedLossScale(4))
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> state = tx.init(params)
    >>> params, state = ols.apply_gradients(
    ...     tx, {"w": jnp.array([4.0, 8.0])}, state, params)
    >>> params["w"]
    Array([0., 0.], dtype=float32)
    >>> params, state = ols.apply_gradients(
    ...     tx, {"w": jnp.array([jnp.nan, 8.0])}, state, params)
    >>> params["w"], int(state.skipped_steps)
    (Array([0., 0.], dtype=float32), 1)
  """
  optimizer = optimizer_of(tx)
  if optimizer is not None:
    return optimizer.apply_gradients(grads, opt_state, params, **extra_args)
  if not callable(getattr(tx, "update", None)):
    raise TypeError(
      "`apply_gradients(tx=...)` must be an Optax transformation (anything"
      f" with `update`) or a LossScaleOptimizer, got {type(tx).__name__}."
    )
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  new_params: optax.Params = optax.apply_updates(params, updates)
  return new_params, opt_state
