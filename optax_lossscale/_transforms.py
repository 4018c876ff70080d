"""Loss scaling as Optax gradient transformations."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_lossscale import _numerics
from optax_lossscale._loss_scale import LossScale

__all__ = [
  "LossScaleOptimizerState",
  "apply_gradients",
  "UnscaleGradientsState",
  "get_loss_scale",
  "loss_scale_optimizer",
  "unscale_gradients",
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
  """The state of `loss_scale_optimizer`.

  Attributes:
    loss_scale: the loss scale to use for the next step.
    inner_state: the state of the wrapped transformation; unchanged by skipped
      steps.
    should_apply: whether the last step was applied (a bool scalar); True
      before the first step.
    skipped_steps: how many steps were skipped in all (int32).
    consecutive_skipped_steps: how many steps were skipped since the last
      applied one (int32).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale())
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


def _check_loss_scale(call: str, loss_scale: Any) -> None:
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
      f"`{call}(loss_scale=...)` must be a LossScale (FixedLossScale,"
      " DynamicLossScale, NoOpLossScale, ...), got"
      f" {type(loss_scale).__name__} {loss_scale!r:.80}; `get` builds one"
      " from a number or 'dynamic'."
    )


def _fresh_copy(loss_scale: LossScale) -> LossScale:
  copy: LossScale = jax.tree.map(jnp.copy, loss_scale)
  return copy


def _zeros_like(tree: Any) -> Any:
  return jax.tree.map(
    lambda s: None if s is None else jnp.zeros(s.shape, s.dtype),
    tree,
    is_leaf=lambda x: x is None,
  )


def _check_state(call: str, state: Any, state_type: type) -> None:
  if not isinstance(state, state_type):
    raise TypeError(
      f"`{call}(...).update(updates, state)` takes the {state_type.__name__}"
      f" that its `init` returned, got {type(state).__name__}."
    )


def _check_structure(call: str, updates: Any, params: Any) -> None:
  if params is None:
    return
  is_none = lambda x: x is None  # noqa: E731
  expected = jax.tree.structure(params, is_leaf=is_none)
  # jax's stubs do not declare PyTreeDef's equality, which is the documented
  # way to compare tree structures.
  actual = jax.tree.structure(updates, is_leaf=is_none)
  if not actual == expected:  # type: ignore[operator]
    raise ValueError(
      f"`{call}(...).update(updates, state, params)`: the structure of"
      " `updates` does not match that of `params`:"
      f" {jax.tree.structure(updates)} vs {jax.tree.structure(params)}."
    )


def unscale_gradients(
  loss_scale: LossScale, *, axis_name: _numerics.AxisName = None
) -> optax.GradientTransformationExtraArgs:
  """Unscales the gradients and updates the loss scale; never skips.

  Put it first in an `optax.chain`. It divides the incoming (scaled)
  gradients by the loss scale, then calls `loss_scale.update` on them and
  stores the new loss scale and `should_apply` in its state. It only reports:
  the rest of the chain runs on every step, so pair it with your own skipping
  (for example `optax.MultiSteps(should_skip_update_fn=...)`), or use
  `loss_scale_optimizer`, which skips for you.

  Args:
    loss_scale: the initial loss scale.
    axis_name: a mapped axis over which replicas must agree (see `all_finite`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is an
    `UnscaleGradientsState`.

  Raises:
    TypeError: if `loss_scale` is not a `LossScale`.

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
  """
  _check_loss_scale("unscale_gradients", loss_scale)

  def init_fn(params: optax.Params) -> UnscaleGradientsState:
    del params
    return UnscaleGradientsState(_fresh_copy(loss_scale), jnp.array(True))

  def update_fn(
    updates: optax.Updates,
    state: UnscaleGradientsState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, UnscaleGradientsState]:
    del extra_args
    _check_state("unscale_gradients", state, UnscaleGradientsState)
    _check_structure("unscale_gradients", updates, params)
    # The check reads the incoming gradients: the unscaling is then fused into
    # the rest of the chain instead of being written out as a separate buffer.
    new_loss_scale, should_apply = state.loss_scale._update_scaled(
      updates, axis_name=axis_name
    )
    return state.loss_scale.unscale(updates), UnscaleGradientsState(
      new_loss_scale, should_apply
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def loss_scale_optimizer(
  inner: optax.GradientTransformation,
  loss_scale: LossScale,
  *,
  skip_nonfinite: bool = True,
  axis_name: _numerics.AxisName = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optimizer with loss scaling: unscale, check, update or skip.

  The Optax counterpart of TensorFlow's `MixedPrecisionLossScaleOptimizer` and
  Keras' `LossScaleOptimizer`. Each step it unscales the incoming (scaled)
  gradients, updates the loss scale, and decides `should_apply`: the loss
  scale's own answer and, when `skip_nonfinite` is True, finite gradients. An
  applied step runs `inner` on the unscaled gradients. A skipped step returns
  zero updates and leaves `inner`'s state bit for bit unchanged, so moments,
  step counts and schedules do not advance.

  The skip is one `lax.cond` around `inner`'s update: nothing is selected
  leaf by leaf, and donated parameters and state are updated in place. The
  gradients are read once, by one reduction, before the `cond`; the unscaling
  is fused into `inner`'s update. The updates `update` returns leave the
  `cond` as a buffer of the parameters' size, which `optax.apply_updates` then
  reads again; `apply_gradients(tx, grads, state, params)` updates the
  parameters inside the `cond` instead and is the faster train step.

  Gradient accumulation: pass an `optax.MultiSteps` as `inner`. Each
  micro-batch is unscaled and checked before it is accumulated, so a
  non-finite micro-batch is dropped alone and never reaches the accumulator;
  the scale grows per completed window (it stays constant within a window) and
  backs off as soon as a micro-batch overflows.

  Args:
    inner: the optimizer to wrap, any Optax transformation (or an
      `optax.MultiSteps`). Extra arguments of `update` are passed through to
      it.
    loss_scale: the initial loss scale.
    skip_nonfinite: also skip non-finite steps when the loss scale would apply
      them (a `FixedLossScale` or `NoOpLossScale`). False gives TensorFlow's
      exact behaviour.
    axis_name: a mapped axis over which replicas must agree (see `all_finite`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `LossScaleOptimizerState`.

  Raises:
    TypeError: if `inner` is not an Optax transformation or `loss_scale` not a
      `LossScale`.

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
  accumulator = inner if isinstance(inner, optax.MultiSteps) else None
  if accumulator is not None:
    inner = accumulator.gradient_transformation()
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      "`loss_scale_optimizer(inner=...)` must be an Optax transformation"
      " (optax.GradientTransformation), got"
      f" {type(inner).__name__} {inner!r:.80}."
    )
  _check_loss_scale("loss_scale_optimizer", loss_scale)
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(
      "`loss_scale_optimizer(skip_nonfinite=...)` must be a bool, got"
      f" {skip_nonfinite!r:.80}."
    )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params: optax.Params) -> LossScaleOptimizerState:
    # Fresh arrays throughout: a donated state must not share buffers with
    # itself or with the loss scale this factory holds.
    return LossScaleOptimizerState(
      loss_scale=_fresh_copy(loss_scale),
      inner_state=inner.init(params),
      should_apply=jnp.array(True),
      skipped_steps=jnp.zeros((), jnp.int32),
      consecutive_skipped_steps=jnp.zeros((), jnp.int32),
    )

  def decide(
    updates: optax.Updates, state: LossScaleOptimizerState, params: Any
  ) -> tuple[LossScale, jax.Array]:
    """Checks the gradients: the next loss scale and `should_apply`."""
    _check_state("loss_scale_optimizer", state, LossScaleOptimizerState)
    _check_structure("loss_scale_optimizer", updates, params)
    loss_scale = state.loss_scale
    if skip_nonfinite or loss_scale._needs_finiteness:
      finite = loss_scale._unscaled_all_finite(updates, axis_name=axis_name)
    else:
      finite = jnp.array(True)
    new_loss_scale, should_apply = loss_scale.adjust(finite)
    if skip_nonfinite:
      should_apply &= finite
    return new_loss_scale, should_apply

  def finish(
    state: LossScaleOptimizerState,
    new_loss_scale: LossScale,
    should_apply: jax.Array,
    inner_state: optax.OptState,
  ) -> LossScaleOptimizerState:
    """The new state, once the inner update has run or been skipped."""
    if accumulator is not None:
      # Gradient accumulation: the scale grows per optimizer step, not per
      # micro-batch, so it stays constant within a window of finite
      # micro-batches. (A non-finite micro-batch is dropped and the scale backs
      # off at once; the accumulator holds unscaled gradients, so nothing
      # accumulated under the old scale is invalidated.)
      hold = should_apply & ~accumulator.has_updated(inner_state)
      new_loss_scale = jax.tree.map(
        lambda old, new: jnp.where(hold, old, new),
        state.loss_scale,
        new_loss_scale,
      )
    return LossScaleOptimizerState(
      loss_scale=new_loss_scale,
      inner_state=inner_state,
      should_apply=should_apply,
      skipped_steps=jnp.where(
        should_apply,
        state.skipped_steps,
        optax.safe_increment(state.skipped_steps),
      ),
      consecutive_skipped_steps=jnp.where(
        should_apply,
        jnp.zeros((), jnp.int32),
        optax.safe_increment(state.consecutive_skipped_steps),
      ),
    )

  def update_fn(
    updates: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleOptimizerState]:
    new_loss_scale, should_apply = decide(updates, state, params)
    loss_scale = state.loss_scale

    def apply(
      updates: optax.Updates, inner_state: optax.OptState
    ) -> tuple[optax.Updates, optax.OptState]:
      result: tuple[optax.Updates, optax.OptState] = inner.update(
        loss_scale.unscale(updates), inner_state, params, **extra_args
      )
      return result

    def skip_like_updates(
      updates: optax.Updates, inner_state: optax.OptState
    ) -> tuple[optax.Updates, optax.OptState]:
      return _zeros_like(updates), inner_state

    def skip_like_inner(
      updates: optax.Updates, inner_state: optax.OptState
    ) -> tuple[optax.Updates, optax.OptState]:
      shapes = jax.eval_shape(apply, updates, inner_state)[0]
      return _zeros_like(shapes), inner_state

    try:
      # Nearly every inner transformation returns updates shaped like its
      # input; then the skip branch needs no second trace of `inner`.
      new_updates, inner_state = lax.cond(
        should_apply, apply, skip_like_updates, updates, state.inner_state
      )
    except TypeError:
      new_updates, inner_state = lax.cond(
        should_apply, apply, skip_like_inner, updates, state.inner_state
      )
    return new_updates, finish(state, new_loss_scale, should_apply, inner_state)

  def apply_gradients_fn(
    grads: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params,
    **extra_args: Any,
  ) -> tuple[optax.Params, LossScaleOptimizerState]:
    new_loss_scale, should_apply = decide(grads, state, params)
    loss_scale = state.loss_scale

    def apply(
      params: optax.Params, inner_state: optax.OptState
    ) -> tuple[optax.Params, optax.OptState]:
      updates, inner_state = inner.update(
        loss_scale.unscale(grads), inner_state, params, **extra_args
      )
      return optax.apply_updates(params, updates), inner_state

    def skip(
      params: optax.Params, inner_state: optax.OptState
    ) -> tuple[optax.Params, optax.OptState]:
      return params, inner_state

    new_params, inner_state = lax.cond(
      should_apply, apply, skip, params, state.inner_state
    )
    return new_params, finish(state, new_loss_scale, should_apply, inner_state)

  # Found by `apply_gradients`, which then updates the parameters inside the
  # `cond` (see there).
  setattr(update_fn, _FUSED_APPLY, apply_gradients_fn)  # noqa: B010
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_FUSED_APPLY = "_optax_lossscale_apply_gradients"


def apply_gradients(
  tx: optax.GradientTransformation,
  grads: optax.Updates,
  opt_state: optax.OptState,
  params: optax.Params,
  **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
  """`tx.update` followed by `optax.apply_updates`, as one step.

  For a `loss_scale_optimizer`, the parameters are updated inside the same
  `lax.cond` as the inner optimizer: the updates never leave it as a separate
  buffer, so they fuse with the parameter update (as in a plain optimizer's
  train step), a skipped step writes nothing at all, and donated parameters
  and state are updated in place. The results are those of `tx.update` then
  `optax.apply_updates`, up to rounding (XLA may fuse the last multiply of the
  update and the addition into one operation). For any other transformation it is
  exactly those two calls.

  Args:
    tx: an Optax transformation, typically from `loss_scale_optimizer`.
    grads: the (scaled) gradients.
    opt_state: the state of `tx`.
    params: the parameters.
    **extra_args: passed to the inner transformation.

  Returns:
    `(new_params, new_opt_state)`.

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
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(
      "`apply_gradients(tx=...)` must be an Optax transformation, got"
      f" {type(tx).__name__}."
    )
  fused = getattr(tx.update, _FUSED_APPLY, None)
  if fused is not None:
    result: tuple[optax.Params, optax.OptState] = fused(
      grads, opt_state, params, **extra_args
    )
    return result
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  return optax.apply_updates(params, updates), opt_state


_STATES = (UnscaleGradientsState, LossScaleOptimizerState)


def get_loss_scale(opt_state: optax.OptState) -> LossScale:
  """Returns the current loss scale held in an optimizer state.

  Searches the whole state, through `optax.chain`, `optax.MultiSteps`,
  `optax.inject_hyperparams`, `optax.multi_transform` and any other nesting,
  for the state of `unscale_gradients` or `loss_scale_optimizer`.

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
      f" state (from `unscale_gradients` or `loss_scale_optimizer`), found"
      f" {len(found)}."
    )
  return found[0].loss_scale
