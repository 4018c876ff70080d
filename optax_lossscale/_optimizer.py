"""`LossScaleOptimizer`: unscale, check, update or skip, in one step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale import _cond, _numerics, _retry, _validation
from optax_lossscale._loss_scale import LossScale, leaf_flags
from optax_lossscale._states import (
  LossScaleOptimizerState,
  SkipRecord,
  find_states,
)
from optax_lossscale._value_and_grad import scaled_value_and_grad

__all__ = ["LossScaleOptimizer"]

# A branch of the step's `lax.cond`: (params, inner_state) -> (out, inner_state).
_Branch = Callable[[Any, Any], tuple[Any, Any]]


def check_loss_scale(call: str, loss_scale: Any) -> None:
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
      f"`{call}(loss_scale=...)` must be a LossScale (FixedLossScale,"
      " DynamicLossScale, NoOpLossScale, ...), got"
      f" {type(loss_scale).__name__} {loss_scale!r:.80}; `ols.get` builds one"
      " from a number or 'dynamic'."
    )


def fresh_copy(loss_scale: LossScale) -> LossScale:
  """The loss scale with fresh arrays: a donated state shares no buffer."""
  copy: LossScale = jax.tree.map(jnp.copy, loss_scale)
  return copy


def check_state_type(call: str, state: Any, state_type: type) -> None:
  if not isinstance(state, state_type):
    raise TypeError(
      f"`{call}.update(updates, state)` takes the {state_type.__name__}"
      f" that its `init` returned, got {type(state).__name__}."
    )


def check_structure(call: str, updates: Any, params: Any) -> None:
  if params is None:
    return
  is_none = lambda x: x is None  # noqa: E731
  expected = jax.tree.structure(params, is_leaf=is_none)
  # jax's stubs do not declare PyTreeDef's equality, which is the documented
  # way to compare tree structures.
  actual = jax.tree.structure(updates, is_leaf=is_none)
  if not actual == expected:  # type: ignore[operator]
    raise ValueError(
      f"`{call}.update(updates, state, params)`: the structure of"
      " `updates` does not match that of `params`:"
      f" {jax.tree.structure(updates)} vs {jax.tree.structure(params)}."
    )
  pairs = zip(
    jax.tree_util.tree_leaves_with_path(updates),
    jax.tree.leaves(params),
    strict=True,
  )
  for (path, g), p in pairs:
    if jnp.shape(g) != jnp.shape(p):
      raise ValueError(
        f"`{call}.update(updates, state, params)`: the gradient at"
        f" {jax.tree_util.keystr(path) or '<root>'} has shape"
        f" {jnp.shape(g)}, but its parameter has shape {jnp.shape(p)}."
      )


def varying_grads_error(call: str, grads: Any) -> ValueError | None:
  """The error naming gradients that vary across devices, or None.

  Inside `shard_map` (with `check_vma`), gradients not averaged across
  devices vary, while the parameters and state usually do not: a step and a
  skip then return different types, and the step's `cond` fails.
  """
  varying = [
    (jax.tree_util.keystr(path) or "<root>", _numerics.varying_axes(g))
    for path, g in jax.tree_util.tree_leaves_with_path(grads)
  ]
  varying = [(name, axes) for name, axes in varying if axes]
  if not varying:
    return None
  axes = sorted(set().union(*(a for _, a in varying)), key=str)
  names = ", ".join(name for name, _ in varying[:3])
  axis_name = axes[0] if len(axes) == 1 else tuple(axes)
  return ValueError(
    f"`{call}`: inside `shard_map`, the gradients at {names} vary across"
    f" devices along mesh axes {axes}, but the parameters or optimizer state"
    " do not, so an applied step and a skipped one would differ in type."
    " Average the gradients across devices before the step:"
    f" `grads = jax.lax.pmean(grads, {axis_name!r})`."
  )


def loss_verdict(call: str, value: Any) -> jax.Array:
  """Whether the loss `value` (a float array) is all finite; local."""
  ok = isinstance(value, (jax.Array, np.ndarray, np.generic, float))
  if not (ok and jnp.issubdtype(jnp.result_type(value), jnp.inexact)):
    raise TypeError(
      f"`{call}(..., value=...)` must be the loss, a floating-point array,"
      f" got {type(value).__name__} {value!r:.80}."
    )
  return jnp.all(jnp.isfinite(value))


def own_verdict(loss_scale: LossScale, grads: Any) -> jax.Array:
  """A loss scale's own `grads_finite` verdict, as a one-element bool vector.

  A Python or NumPy bool is accepted, as a scalar array is.
  """
  verdict = loss_scale.grads_finite(grads)
  if np.ndim(verdict) != 0:
    raise ValueError(
      f"`{type(loss_scale).__name__}.grads_finite(scaled_grads)` must return"
      f" a bool scalar, got shape {np.shape(verdict)}."
    )
  return jnp.asarray(verdict, jnp.bool_).reshape(1)


class Decision(NamedTuple):
  """What a step decided: the next loss scale and whether it applies."""

  loss_scale: LossScale
  should_apply: jax.Array
  loss_finite: jax.Array | None


class Verdicts(NamedTuple):
  """What a step's check found, agreed across replicas.

  `leaf_flags`: per gradient leaf, whether it is finite once unscaled (None
  when a loss scale's own `grads_finite` decided: the skip record then reads
  the gradients again).
  """

  grads_finite: jax.Array
  loss_finite: jax.Array | None
  leaf_flags: jax.Array | None


def verdicts(
  call: str,
  loss_scale: LossScale,
  grads: Any,
  value: Any,
  axis_name: _numerics.AxisName,
) -> Verdicts:
  """What the step's check found: one read of the gradients.

  The gradients' flags, one per leaf, and the loss's verdict are agreed
  across replicas by one collective.
  """
  flags = leaf_flags(loss_scale, grads)
  local = [own_verdict(loss_scale, grads) if flags is None else flags]
  if value is not None:
    local.append(loss_verdict(call, value)[None])
  agreed = _numerics.agree(jnp.concatenate(local), axis_name)
  n = local[0].shape[0]
  return Verdicts(
    grads_finite=jnp.all(agreed[:n]),
    loss_finite=agreed[n] if value is not None else None,
    leaf_flags=None if flags is None else agreed[:n],
  )


def decide(
  loss_scale: LossScale,
  grads_finite: jax.Array,
  loss_finite: jax.Array | None,
  skip_nonfinite: bool,
) -> Decision:
  """The next loss scale and `should_apply`, given the verdicts.

  A non-finite loss skips the step and leaves the loss scale bit for bit
  unchanged: a lower scale cannot fix a non-finite forward pass.
  """
  new_loss_scale, should_apply = loss_scale.adjust(grads_finite)
  if not jax.tree.structure(new_loss_scale) == jax.tree.structure(loss_scale):  # type: ignore[operator]
    raise TypeError(
      f"`{type(loss_scale).__name__}.adjust` must return a loss scale of the"
      " same pytree structure as its own (it is carried through `lax.cond`"
      f" and `lax.scan`), got {jax.tree.structure(new_loss_scale)} for"
      f" {jax.tree.structure(loss_scale)}."
    )
  if skip_nonfinite:
    should_apply &= grads_finite
  if loss_finite is not None:
    should_apply &= loss_finite
    new_loss_scale = optax.tree.where(loss_finite, new_loss_scale, loss_scale)
  return Decision(new_loss_scale, should_apply, loss_finite)


def _count(counter: jax.Array, flag: jax.Array) -> jax.Array:
  return jnp.where(flag, optax.safe_increment(counter), counter)


def _maybe_count(counter: jax.Array | None, flag: jax.Array) -> Any:
  # None in a state restored from a 0.1.0 checkpoint: it stays None.
  return None if counter is None else _count(counter, flag)


def _window_open(inner_state: Any) -> jax.Array | None:
  """Whether gradient accumulation in `inner` has an open window, or None.

  Read from `inner`'s state, wherever an `optax.MultiStepsState` is nested
  (`optax.MultiSteps` and its `gradient_transformation()` alike): a window
  that completes resets its `mini_step` to 0.
  """
  found = find_states(inner_state, (optax.MultiStepsState,))
  if not found:
    return None
  return jnp.any(jnp.stack([jnp.asarray(s.mini_step) != 0 for s in found]))


def _skip_or_apply(
  applies: jax.Array,
  apply: Callable[..., Any],
  skip: Callable[..., Any],
  operands: tuple[Any, ...],
  grads: Any,
) -> Any:
  """The step's one `cond`; gradients left varying get an error naming them."""
  try:
    return _cond.cond(applies, apply, skip, *operands, sharded_like=grads)
  except TypeError as e:  # the branches' types differ
    error = varying_grads_error("LossScaleOptimizer", grads)
    if error is None or "branch" not in str(e):  # not the branches' types
      raise
    raise error from e


def _held_by_window(
  decision: Decision,
  state: LossScaleOptimizerState,
  applies: jax.Array,
  inner_state: Any,
) -> Decision:
  """The decision, its loss scale held while an accumulation window is open.

  Gradient accumulation: a finite micro-batch that leaves its window open is
  not an optimizer step, so the loss scale (good-step counter, growth,
  hysteresis budget) holds until the window completes, as in PyTorch's
  recipe. A non-finite one backs off at once.
  """
  window_open = _window_open(inner_state)
  if window_open is None:
    return decision
  hold = applies & window_open
  return decision._replace(
    loss_scale=optax.tree.where(hold, state.loss_scale, decision.loss_scale)
  )


def _trace_once(fn: _Branch, *args: Any) -> tuple[_Branch, Any]:
  """`fn`, traced once, as a function that replays it, and its output shapes.

  Lets the skip branch return zeros shaped like `fn`'s outputs without
  tracing `fn` (the user's `inner.update`) a second time.
  """
  converted, consts = jax.closure_convert(fn, *args)

  def replay(*args: Any) -> tuple[Any, Any]:
    result: tuple[Any, Any] = converted(*args, *consts)
    return result

  return replay, jax.eval_shape(replay, *args)


def _passing_extra_args(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """`inner` as a transformation whose `update` takes extra arguments.

  `optax.MultiSteps.update` takes extra arguments and passes them to the
  optimizer it wraps, but its `gradient_transformation()` is a plain
  `GradientTransformation`, whose extra arguments
  `optax.with_extra_args_support` would drop: it keeps its own methods.
  """
  if isinstance(getattr(inner.update, "__self__", None), optax.MultiSteps):
    return optax.GradientTransformationExtraArgs(inner.init, inner.update)
  return optax.with_extra_args_support(inner)


class LossScaleOptimizer:
  """Wraps an optimizer with loss scaling: unscale, check, update or skip.

  The Optax counterpart of TensorFlow's `MixedPrecisionLossScaleOptimizer` and
  Keras' `LossScaleOptimizer`, a class like `optax.MultiSteps`. Each step it
  checks the incoming (scaled) gradients, updates the loss scale, and decides
  `should_apply`: the loss scale's own answer and, when `skip_nonfinite` is
  True, finite gradients and a finite loss (when `value=` is given). An
  applied step runs `inner` on the unscaled gradients. A skipped step changes
  no parameter and leaves `inner`'s state bit for bit unchanged, so moments,
  step counts and schedules do not advance.

  The skip is one `lax.cond` around `inner`'s update: nothing is selected
  leaf by leaf, and donated parameters and state are updated in place. The
  gradients are read once, by one fused reduction, before the `cond`; the
  unscaling fuses into `inner`'s update. `apply_gradients` (or `minimize`)
  also updates the parameters inside the `cond` and is the fastest train
  step; `update` returns the updates, which leave the `cond` as a buffer.

  A skipped step also writes a `SkipRecord` into the state (`last_skip`:
  the scales, whether the loss was finite, and per leaf whether its unscaled
  gradients held a non-finite value: the check's own per-leaf verdicts, so
  no gradient is read again); nothing in the step calls the host. Read it
  at your logging cadence with `skip_reports` or a `SkipMonitor`, which also
  stops a run that skips too many steps in a row.

  Use an instance wherever Optax transformations are duck-typed (flax
  linen's `TrainState.create(tx=...)`, `nnx.Optimizer(model, tx, wrt=...)`),
  or `gradient_transformation()` where an `optax.GradientTransformation` is
  required.

  Gradient accumulation: pass `optax.MultiSteps(...)` (or its
  `gradient_transformation()`) as `inner`. Each micro-batch is unscaled and
  checked before it is accumulated, so a non-finite micro-batch is dropped
  alone and never reaches the accumulator, and backs the scale off at once
  (or spends hysteresis budget); the open window goes on with the next
  finite micro-batch. The scale moves once per optimizer step, as in
  PyTorch's recipe: a finite micro-batch counts as a good step, grows the
  scale and refills the hysteresis budget only when it completes a window
  (`increment_period` counts windows). The window is read from `inner`'s
  state (an `optax.MultiStepsState`, wherever it is nested). Extra arguments
  (`value=` included) reach the optimizer inside `MultiSteps` in both forms
  (an `optax.contrib.reduce_on_plateau` there gets the loss). Wrapped in
  anything else first (an `optax.chain`), the `gradient_transformation()`
  form loses them: with optax 0.2.8 it is a plain `GradientTransformation`,
  whose extra arguments the wrapper drops before `MultiSteps` sees them.

  Args:
    inner: the optimizer to wrap, any Optax transformation (or an
      `optax.MultiSteps`). Extra arguments of `update` (`value=` included)
      are passed through to it.
    loss_scale: the initial loss scale.
    skip_nonfinite: skip non-finite steps even when the loss scale would apply
      them (a `FixedLossScale` or `NoOpLossScale`). False gives TensorFlow's
      exact behaviour.
    axis_name: a mapped axis over which replicas must agree (see `all_finite`).

  Raises:
    TypeError: if an argument has the wrong type.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.LossScaleOptimizer(optax.sgd(2.0), ols.DynamicLossScale(
    ...     initial_loss_scale=2.0, increment_period=1))
    >>> params = {"w": jnp.array(5.0)}
    >>> state = tx.init(params)
    >>> loss, grads = ols.scaled_value_and_grad(lambda p: p["w"])(
    ...     state, params)
    >>> params, state = tx.apply_gradients(grads, state, params, value=loss)
    >>> float(params["w"]), float(ols.get_loss_scale(state)())
    (3.0, 4.0)
  """

  def __init__(
    self,
    inner: optax.GradientTransformation | optax.MultiSteps,
    loss_scale: LossScale,
    *,
    skip_nonfinite: bool = True,
    axis_name: _numerics.AxisName = None,
  ) -> None:
    call = "LossScaleOptimizer"
    if isinstance(inner, optax.MultiSteps):
      inner = optax.GradientTransformationExtraArgs(inner.init, inner.update)
    if not isinstance(inner, optax.GradientTransformation):
      raise TypeError(
        f"`{call}(inner=...)` must be an Optax transformation"
        " (optax.GradientTransformation), got"
        f" {type(inner).__name__} {inner!r:.80}."
      )
    check_loss_scale(call, loss_scale)
    _validation.boolean(call, "skip_nonfinite", skip_nonfinite)
    self.inner = _passing_extra_args(inner)
    self.loss_scale = loss_scale
    self.skip_nonfinite = bool(skip_nonfinite)
    self.axis_name = axis_name

  def __repr__(self) -> str:
    return (
      f"LossScaleOptimizer(loss_scale={self.loss_scale!r},"
      f" skip_nonfinite={self.skip_nonfinite}, axis_name={self.axis_name!r})"
    )

  def init(self, params: optax.Params) -> LossScaleOptimizerState:
    """Returns the initial state: the loss scale and `inner`'s state.

    Args:
      params: the parameters, as `inner.init` takes them. Their leaves'
        paths name the leaves of skip reports.

    Returns:
      A `LossScaleOptimizerState` of fresh arrays (safe to donate).
    """
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    names = tuple(
      jax.tree_util.keystr(path) or "<root>"
      for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )
    no = lambda: jnp.array(False)  # noqa: E731
    scale = self.loss_scale()
    return LossScaleOptimizerState(
      loss_scale=fresh_copy(self.loss_scale),
      inner_state=self.inner.init(params),
      should_apply=jnp.array(True),
      skipped_steps=zero(),
      consecutive_skipped_steps=zero(),
      nonfinite_loss_steps=zero(),
      retries=zero(),
      last_skip=SkipRecord(
        loss_scale=jnp.copy(scale),
        next_loss_scale=jnp.copy(scale),
        skipped_steps=zero(),
        consecutive_skipped_steps=zero(),
        loss_given=no(),
        loss_finite=jnp.array(True),
        at_floor=no(),
        nonfinite=jnp.zeros((len(names),), jnp.bool_),
        leaf_names=jnp.asarray(SkipRecord.encode_names(names)),
      ),
    )

  def update(
    self,
    grads: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleOptimizerState]:
    """One step: returns the updates (zeros when skipped) and the new state.

    Args:
      grads: the scaled gradients.
      state: the state `init` returned, or the last `update`'s.
      params: the parameters, if `inner` needs them.
      **extra_args: passed to `inner`; `value=` (the loss) also skips a step
        whose loss is not finite, leaving the loss scale unchanged.

    Returns:
      `(updates, new_state)`.

    Raises:
      ValueError: if `grads` and `params` (when given) differ in structure,
        or a leaf in shape, naming the leaf; or if, inside `shard_map`, the
        gradients vary across devices where the parameters and state do not
        (under `check_vma`, average the loss with `lax.pmean`; without it,
        the gradients); or if a loss scale's own `grads_finite` returns
        something other than a bool scalar.
      TypeError: if `state` is not a `LossScaleOptimizerState`.
    """
    self._check(grads, state, params)
    loss_scale = state.loss_scale

    def inner_update(params: Any, inner_state: Any) -> tuple[Any, Any]:
      result: tuple[Any, Any] = self.inner.update(
        loss_scale.unscale(grads), inner_state, params, **extra_args
      )
      return result

    # `inner` may return updates of another structure or dtype than the
    # gradients: the skip branch returns zeros shaped like what it returned.
    apply, shapes = _trace_once(inner_update, params, state.inner_state)

    def skip(params: Any, inner_state: Any) -> tuple[Any, Any]:
      return _numerics.zeros_of(shapes[0]), inner_state

    return self._step(grads, state, params, extra_args, apply, skip)

  def apply_gradients(
    self,
    grads: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params,
    **extra_args: Any,
  ) -> tuple[optax.Params, LossScaleOptimizerState]:
    """The fused step: `update` then `optax.apply_updates`, inside the `cond`.

    The updates never leave the `cond` as a separate buffer, so they fuse with
    the parameter update, a skipped step writes nothing, and donated
    parameters and state are updated in place. The results are those of
    `update` followed by `optax.apply_updates`, up to rounding (XLA may fuse
    the last multiply of the update and the addition into one operation).

    Args:
      grads: the scaled gradients.
      state: the optimizer state.
      params: the parameters.
      **extra_args: as for `update`.

    Returns:
      `(new_params, new_state)`.

    Raises:
      ValueError: as for `update`.
      TypeError: as for `update`.
    """
    self._check(grads, state, params)
    apply, skip = self._fused(grads, state.loss_scale, extra_args)
    return self._step(grads, state, params, extra_args, apply, skip)

  def _fused(
    self, grads: Any, loss_scale: LossScale, extra_args: dict[str, Any]
  ) -> tuple[_Branch, _Branch]:
    """The branches of the fused step: the parameters change inside."""

    def apply(params: Any, inner_state: Any) -> tuple[Any, Any]:
      updates, inner_state = self.inner.update(
        loss_scale.unscale(grads), inner_state, params, **extra_args
      )
      return optax.apply_updates(params, updates), inner_state

    def skip(params: Any, inner_state: Any) -> tuple[Any, Any]:
      return params, inner_state

    return apply, skip

  def minimize(
    self,
    fun: Callable[..., Any],
    params: optax.Params,
    state: LossScaleOptimizerState,
    *args: Any,
    has_aux: bool = False,
    max_retries: int = 0,
    **kwargs: Any,
  ) -> tuple[Any, optax.Params, LossScaleOptimizerState]:
    """One whole train step: the scaled gradient of `fun`, then the update.

    Differentiates `fun(params, *args, **kwargs)` scaled by the state's loss
    scale, and applies the gradients through `apply_gradients`, with the
    loss as `value=`. With `max_retries=k > 0`, a step whose loss is finite
    but whose gradients are not is recomputed on the same batch, at the scale
    `LossScale.lowered()` gives, up to `k` times, inside the same compiled
    step (a `lax.while_loop` whose predicate all replicas agree on). The
    attempt that succeeds is applied as a finite step, so the batch is not
    lost; retries stop early when the scale cannot be lowered any more or the
    loss is not finite, and the step is then skipped as usual, from the last
    attempt's scale (which a `SkipReport` then shows as `loss_scale`), which
    is then adjusted as on any non-finite step (lowered once more, unless a
    hysteresis budget remains). The update runs inside the loop's last
    iteration, so the loop carries the parameters and the state, never the
    gradients. `fun` is traced once; a step runs one forward and backward
    pass, and one more per retry.

    Args:
      fun: the loss function; it returns a scalar, or `(scalar, aux)` when
        `has_aux`.
      params: the parameters (the first argument of `fun`).
      state: the optimizer state.
      *args: further arguments of `fun` (the batch).
      has_aux: whether `fun` returns `(loss, aux)`.
      max_retries: how many times to recompute an overflowed batch.
      **kwargs: keyword arguments of `fun`.

    Returns:
      `(value, new_params, new_state)`, where `value` is the unscaled loss,
      or `(loss, aux)`.

    Raises:
      ValueError: if `max_retries` is negative, or positive with a loss scale
        that cannot be lowered (`FixedLossScale`, `NoOpLossScale`).
      TypeError: if `fun` is not callable, `has_aux`/`max_retries` have the
        wrong type, or `state` is not a `LossScaleOptimizerState`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import optax_lossscale as ols
      >>> tx = ols.LossScaleOptimizer(optax.sgd(0.1),
      ...                             ols.DynamicLossScale(2.0**24))
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> loss_fn = lambda p: jnp.sum(p["w"].astype(jnp.float16) ** 2)
      >>> loss, params, state = tx.minimize(loss_fn, params, tx.init(params),
      ...                                   max_retries=16)
      >>> float(loss), int(state.skipped_steps), int(state.retries)
      (5.0, 0, 11)
      >>> float(ols.get_loss_scale(state)())  # the scaled float16 loss fits
      8192.0
    """
    call = "LossScaleOptimizer.minimize"
    _validation.boolean(call, "has_aux", has_aux)
    _validation.integer(call, "max_retries", max_retries, minimum=0)
    self._check(None, state, None)
    value_and_grad = scaled_value_and_grad(fun, has_aux=has_aux)

    def attempt(loss_scale: LossScale, params: Any) -> tuple[Any, Any]:
      return value_and_grad(loss_scale, params, *args, **kwargs)

    loss_of = (lambda v: v[0]) if has_aux else (lambda v: v)
    if max_retries == 0:
      value, grads = attempt(state.loss_scale, params)
      new_params, new_state = self.apply_gradients(
        grads, state, params, value=loss_of(value)
      )
      return value, new_params, new_state

    return self._retried_step(attempt, loss_of, params, state, max_retries)

  def _retried_step(
    self,
    attempt: Callable[[LossScale, Any], tuple[Any, Any]],
    loss_of: Callable[[Any], Any],
    params: Any,
    state: LossScaleOptimizerState,
    max_retries: int,
  ) -> tuple[Any, Any, LossScaleOptimizerState]:
    """`minimize` with retries: every attempt runs `_step`, held but the last."""
    if state.loss_scale.lowered() is None:
      raise ValueError(
        "`LossScaleOptimizer.minimize(max_retries=...)` must be 0 with a"
        f" {type(state.loss_scale).__name__}, which cannot be lowered, got"
        f" {max_retries}."
      )

    def check(ls: LossScale, value: Any, grads: Any) -> Verdicts:
      return verdicts(
        "LossScaleOptimizer.minimize", ls, grads, loss_of(value), self.axis_name
      )

    def finish(found: _retry.Found, again: jax.Array, operand: Any) -> Any:
      params, state = operand
      extra_args = {"value": loss_of(found.value)}
      apply, skip = self._fused(found.grads, found.loss_scale, extra_args)
      return self._step(
        found.grads,
        state._replace(loss_scale=found.loss_scale),
        params,
        extra_args,
        apply,
        skip,
        known=found.checks,
        retries=found.retries,
        held=again,
      )

    value, (new_params, new_state) = _retry.retry(
      lambda ls, operand: attempt(ls, operand[0]),
      check,
      finish,
      state.loss_scale,
      max_retries,
      (params, state),
    )
    return value, new_params, new_state

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """Returns this optimizer as an `optax.GradientTransformationExtraArgs`.

    Its `init` and `update` are this object's bound methods, which is how
    `apply_gradients(tx, ...)` recognises it and takes the fused path.

    Returns:
      An `optax.GradientTransformationExtraArgs`.
    """
    return optax.GradientTransformationExtraArgs(self.init, self.update)

  # --- the one step shared by update, apply_gradients and minimize ----------

  def _check(self, grads: Any, state: Any, params: Any) -> None:
    check_state_type("LossScaleOptimizer", state, LossScaleOptimizerState)
    if grads is not None:
      check_structure("LossScaleOptimizer", grads, params)

  def _step(
    self,
    grads: Any,
    state: LossScaleOptimizerState,
    params: Any,
    extra_args: dict[str, Any],
    apply: _Branch,
    skip: _Branch,
    *,
    known: Verdicts | None = None,
    retries: jax.Array | None = None,
    held: jax.Array | None = None,
  ) -> tuple[Any, LossScaleOptimizerState]:
    """Check, decide, one `lax.cond` around `inner`, and the new state.

    `known` holds verdicts already computed, `retries` the retries made and
    `held` whether a retry follows (`minimize`'s retries): a held attempt
    writes nothing and reports nothing. It is folded into the one `cond`
    (a second conditional around it would make XLA copy the parameters and
    state that the retry loop carries).
    """
    if known is None:
      known = verdicts(
        "LossScaleOptimizer.update",
        state.loss_scale,
        grads,
        extra_args.get("value"),
        self.axis_name,
      )
    decision = decide(
      state.loss_scale,
      known.grads_finite,
      known.loss_finite,
      self.skip_nonfinite,
    )

    applies = decision.should_apply
    if held is not None:
      applies = applies & ~held

    def apply_(params: Any, inner_state: Any, record: Any) -> Any:
      return *apply(params, inner_state), record

    def skip_(params: Any, inner_state: Any, record: Any) -> Any:
      # The record is written here, on skipped steps only: the gradients are
      # already operands of this cond (the update reads them), and a cond of
      # its own would cost a second conditional per step.
      if record is not None:
        new = self._record(grads, state, decision, known.leaf_flags)
        record = new if held is None else optax.tree.where(held, record, new)
      return *skip(params, inner_state), record

    out, inner_state, record = _skip_or_apply(
      applies,
      apply_,
      skip_,
      (params, state.inner_state, state.last_skip),
      grads,
    )
    decision = _held_by_window(decision, state, applies, inner_state)
    new_state = self._next_state(state, decision, inner_state, retries)
    new_state = new_state._replace(last_skip=record)
    if held is not None:
      # A held attempt keeps the counters and the attempt's loss scale (the
      # loop carries the lowered one apart); `inner_state` was kept by the
      # cond.
      kept = optax.tree.where(
        held,
        state._replace(inner_state=None),
        new_state._replace(inner_state=None),
      )
      new_state = kept._replace(inner_state=inner_state)
    return out, new_state

  def _next_state(
    self,
    state: LossScaleOptimizerState,
    decision: Decision,
    inner_state: Any,
    retries: jax.Array | None,
  ) -> LossScaleOptimizerState:
    skipped = ~decision.should_apply
    nonfinite_loss = state.nonfinite_loss_steps
    if decision.loss_finite is not None:
      nonfinite_loss = _maybe_count(nonfinite_loss, ~decision.loss_finite)
    total_retries = state.retries
    if retries is not None and total_retries is not None:
      total_retries = total_retries + retries
    return LossScaleOptimizerState(
      loss_scale=decision.loss_scale,
      inner_state=inner_state,
      should_apply=decision.should_apply,
      skipped_steps=_count(state.skipped_steps, skipped),
      consecutive_skipped_steps=jnp.where(
        skipped,
        optax.safe_increment(state.consecutive_skipped_steps),
        jnp.zeros((), jnp.int32),
      ),
      nonfinite_loss_steps=nonfinite_loss,
      retries=total_retries,
    )

  def _nonfinite(
    self,
    grads: Any,
    loss_scale: LossScale,
    flags: jax.Array | None,
    slots: int,
  ) -> jax.Array:
    """Per gradient leaf, whether it had a non-finite unscaled value.

    From the check's flags; where a loss scale's own `grads_finite` decided,
    from the unscaled gradients, read again on this skipped step, a leaf at
    a time (no array constant: a `vmap`ped `cond` over a sharded member axis
    refuses them). A state whose parameters had no leaf (`init(None)`) has
    no slot: its records name no leaf.
    """
    if slots == 0:
      return jnp.zeros((0,), jnp.bool_)
    n = len(jax.tree.leaves(grads))
    if n != slots:
      raise ValueError(
        "`LossScaleOptimizer.update(updates, state)`: `updates` has"
        f" {n} leaves, but the parameters `init` was given had {slots}."
      )
    if flags is None:
      unscaled = jax.tree.leaves(loss_scale.unscale(grads))
      # Concatenated, not stacked: see `_numerics.finite_flags`.
      flags = jnp.concatenate(
        [_numerics.all_finite(x).reshape(1) for x in unscaled]
      )
      flags = _numerics.agree(flags, self.axis_name)
    return ~flags

  def _record(
    self,
    grads: Any,
    state: LossScaleOptimizerState,
    decision: Decision,
    flags: jax.Array | None,
  ) -> SkipRecord:
    """The record of a skipped step, from the state before it."""
    record = state.last_skip
    assert record is not None
    loss_scale = state.loss_scale
    slots = record.nonfinite.shape[-1]
    lowered = loss_scale.lowered()
    loss_finite = decision.loss_finite
    return dataclasses.replace(
      record,
      loss_scale=loss_scale(),
      next_loss_scale=decision.loss_scale(),
      skipped_steps=optax.safe_increment(state.skipped_steps),
      consecutive_skipped_steps=optax.safe_increment(
        state.consecutive_skipped_steps
      ),
      loss_given=jnp.array(loss_finite is not None),
      loss_finite=jnp.array(True) if loss_finite is None else loss_finite,
      at_floor=(
        jnp.array(True) if lowered is None else lowered() >= loss_scale()
      ),
      nonfinite=self._nonfinite(grads, loss_scale, flags, slots),
    )


def optimizer_of(tx: Any) -> LossScaleOptimizer | None:
  """The `LossScaleOptimizer` behind `tx`, or None.

  `tx` is the optimizer itself, or what its `gradient_transformation()`
  returned, whose `update` is the optimizer's bound method.
  """
  if isinstance(tx, LossScaleOptimizer):
    return tx
  owner = getattr(getattr(tx, "update", None), "__self__", None)
  return owner if isinstance(owner, LossScaleOptimizer) else None
