"""`unscale_gradients`: loss scaling as one link of an `optax.chain`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lossscale import _inputs, _numerics
from optax_lossscale._loss_scale import LossScale
from optax_lossscale._states import UnscaleGradientsState, check_like
from optax_lossscale._verdict import decide, read

__all__ = ["unscale_gradients"]


def unscale_gradients(
  loss_scale: LossScale, *, axis_name: _numerics.AxisName = None
) -> optax.GradientTransformationExtraArgs:
  """Unscales the gradients and updates the loss scale; never skips.

  Put it first in an `optax.chain`. It divides the incoming (scaled)
  gradients by the loss scale, updates the loss scale from whether they are
  finite (`LossScale.adjust`), and stores the new loss scale, its
  `should_apply` and whether the step was `finite` in its state. It only
  reports: the rest of the chain runs on every step.
  Given the loss as `value=`, a step whose loss is not finite reports
  `should_apply` False and leaves the loss scale unchanged.

  To skip non-finite steps, use `LossScaleOptimizer`, which skips for you, or
  skip *after* this transformation, so that its `update` runs on every step:
  only that call lowers the scale. Pairings that back off on an overflow:

  - `optax.chain(unscale_gradients(loss_scale), optax.apply_if_finite(inner,
    max_consecutive_errors=...))`: `inner` skips the steps whose unscaled
    gradients are not finite (but after `max_consecutive_errors` of them in a
    row, `apply_if_finite` applies one anyway);
  - your own `lax.cond` on this state's `finite` that keeps this
    transformation's new state on a skipped step, and only the rest of the
    old state (the train-step guide, docs/guides/train_step.md). Read
    `finite`, not `should_apply`: a `FixedLossScale` or `NoOpLossScale`
    answers `should_apply` True whatever the gradients, as TensorFlow's.

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
      in structure or a leaf's shape (naming the leaf), and warns
      (`UserWarning`) when the loss is given as `loss=` without `value=`.

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
    >>> updates["w"], float(state[0].loss_scale())
    (Array([0., 0.], dtype=float32), 4.0)
  """
  _inputs.check_loss_scale("unscale_gradients", loss_scale)
  call = "unscale_gradients.update"

  def init_fn(params: optax.Params) -> UnscaleGradientsState:
    copy = jax.tree.map(jnp.copy, loss_scale)  # a donated state shares none
    return UnscaleGradientsState(
      loss_scale=copy, should_apply=jnp.array(True), finite=jnp.array(True)
    )

  def update_fn(
    updates: optax.Updates,
    state: UnscaleGradientsState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, UnscaleGradientsState]:
    check_like(call, state, jax.eval_shape(init_fn, None))
    _inputs.check_loss_name(call, extra_args)
    _inputs.check_structure(call, updates, params)
    value = extra_args.get("value")
    verdict = read(call, state.loss_scale, updates, value, axis_name)
    new, should_apply = decide(state.loss_scale, verdict, skip_nonfinite=False)
    finite = verdict.grads_finite
    if verdict.loss_finite is not None:
      finite &= verdict.loss_finite
    return state.loss_scale.unscale(updates), UnscaleGradientsState(
      loss_scale=new, should_apply=should_apply, finite=finite
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
