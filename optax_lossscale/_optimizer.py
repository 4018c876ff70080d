"""`LossScaleOptimizer`: unscale, check, clip, update or skip, in one step."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.tree import where as tree_where

from optax_lossscale import _cond, _inputs, _numerics, _retry, _validation
from optax_lossscale._loss_scale import LossScale, multiply_floats
from optax_lossscale._read import Checks, check, masked
from optax_lossscale._states import (
  LossScaleOptimizerState,
  SkipRecord,
  WriteRecord,
)
from optax_lossscale._value_and_grad import scaled_value_and_grad

__all__ = ["LossScaleOptimizer"]


class _Step(NamedTuple):
  """A step's inputs, and the attempt it applies."""

  state: LossScaleOptimizerState
  params: Any
  extra_args: dict[str, Any]
  fused: bool
  mask: Any
  attempt: _retry.Attempt


_FLOAT16 = (
  "LossScaleOptimizer.init: float16 parameters with a float16 inner state: if"
  " `inner` divides by an `eps` (Adam's 1e-8 is 0 in float16), a zero gradient"
  " makes a NaN update. Keep float32 parameters, cast in the forward pass."
)


def _float16(tree: Any) -> bool:
  return jnp.float16 in [getattr(x, "dtype", 0) for x in jax.tree.leaves(tree)]


def decide(
  loss_scale: LossScale, checks: Checks, skip_nonfinite: bool
) -> tuple[LossScale, jax.Array]:
  """The next loss scale and whether the step applies.

  A non-finite loss skips the step and keeps the loss scale: no scale fixes
  a forward pass that failed.
  """
  new, should_apply = loss_scale.adjust(checks.grads_finite)
  if skip_nonfinite:
    should_apply &= checks.grads_finite
  if checks.loss_finite is not None:
    should_apply &= checks.loss_finite
    new = tree_where(checks.loss_finite, new, loss_scale)
  return new, should_apply


def _count(counter: jax.Array, flag: jax.Array | bool) -> jax.Array:
  return jnp.where(flag, optax.safe_increment(counter), counter)


def _write_record(
  state: LossScaleOptimizerState, params: Any, axis_name: Any
) -> WriteRecord:
  """The write record of a skipped step, given `params`.

  Non-finite values there were written by an applied step before it. A
  diagnostic of skipped steps only: checking what every applied step writes
  reads the parameters and state again (1.6x the fused step, XLA:CPU). The
  inner state is not read: on XLA:CPU, each leaf checked needs a byte per
  element of temporary memory, which every step allocates.
  """
  last = state.last_nonfinite_write
  leaves = jax.tree.leaves(_inputs.like_grads(params))
  if len(leaves) != last.nonfinite.shape[-1]:  # `update` without parameters
    return last
  finite = _numerics.agree(_numerics.finite_flags(leaves), axis_name)
  applied = state.steps - state.consecutive_skipped_steps - 1  # the last one
  new = WriteRecord(applied, ~finite)
  return tree_where(jnp.all(finite) | (applied < 0), last, new)  # type: ignore[no-any-return]


def _next_state(
  state: LossScaleOptimizerState,
  loss_scale: LossScale,
  should_apply: jax.Array,
  attempt: _retry.Attempt,
) -> LossScaleOptimizerState:
  """The counters and the skip record after a step (of `attempt`, unless a
  retry follows it); the inner state and the write record come apart.

  The record's scale is the step's; the attempt's says whether the scale
  reached its floor.
  """
  skipped, checks, tried = ~should_apply, attempt.checks, attempt.loss_scale
  loss_finite, lowered = checks.loss_finite, tried.lowered()
  consecutive = optax.safe_increment(state.consecutive_skipped_steps)
  slots = state.last_skip.nonfinite.shape[-1]  # none after `init(None)`
  record = dataclasses.replace(
    state.last_skip,
    step=state.steps,
    loss_scale=state.loss_scale(),
    next_loss_scale=loss_scale(),
    consecutive_skipped_steps=consecutive,
    loss_given=jnp.array(loss_finite is not None),
    loss_finite=jnp.array(True) if loss_finite is None else loss_finite,
    at_floor=jnp.array(True) if lowered is None else lowered() >= tried(),
    nonfinite=~checks.flags[:slots],
  )
  loss_failed = False if loss_finite is None else ~loss_finite
  dropped = skipped & jnp.logical_not(attempt.held)
  return state._replace(
    last_skip=tree_where(dropped, record, state.last_skip),
    loss_scale=loss_scale,
    should_apply=should_apply,
    skipped_steps=_count(state.skipped_steps, skipped),
    consecutive_skipped_steps=jnp.where(skipped, consecutive, 0),
    nonfinite_loss_steps=_count(state.nonfinite_loss_steps, loss_failed),
    retries=state.retries + attempt.retries,
    steps=optax.safe_increment(state.steps),
  )


def _accumulation(
  call: str, multi: optax.MultiSteps | None
) -> tuple[Any, bool]:
  """The windows an `optax.MultiSteps` asks for: their length (None: no
  accumulation) and mean.

  `MultiSteps` has no public accessor for them (Optax 0.2.8): they are read
  from its attributes, once (tests/test_accumulation.py would see a rename).
  """
  if multi is None:
    return None, True
  skip = multi._should_skip_update_fn
  if "MultiSteps.__init__" not in getattr(skip, "__qualname__", ""):
    raise ValueError(
      f"`{call}(inner=...)` must be an `optax.MultiSteps` without a"
      f" `should_skip_update_fn`, got {_validation.describe(skip)}: each"
      " non-finite micro-batch is dropped before it is accumulated."
    )
  return multi._every_k_schedule, multi._use_grad_mean


class LossScaleOptimizer:
  """Wraps an optimizer with loss scaling: unscale, check, clip, update or skip.

  The Optax counterpart of Keras' `LossScaleOptimizer`, a class like
  `optax.MultiSteps`. Each step reads the (scaled) gradients once: the sum
  of the squares of the gradients gives whether they are all
  finite, the global norm (`state.grad_norm`) and, with `max_norm`, the
  clip factor, which multiplies the unscaling. It updates the loss scale
  and decides whether to apply the step: the loss scale's own answer and,
  with `skip_nonfinite`, finite gradients and a finite loss (given as
  `value=`). An applied step runs `inner` on the unscaled (and clipped)
  gradients. A skipped step changes no parameter and leaves `inner`'s
  state bit for bit unchanged; it writes a `SkipRecord` into the state, for
  `skip_reports` and `SkipMonitor` to read later. Nothing calls the host.

  The skip is one conditional around `inner`'s update. `apply_gradients`
  (and `minimize`) update the parameters inside it: the fastest step, and
  the one to use with donated parameters and state. `update` returns the
  updates, for code that needs the Optax interface. A sum of squares that
  is not finite (an overflow, or finite gradients whose squares exceed
  float32) runs a small conditional that checks each leaf exactly.

  Parameters may differ in structure from the gradients where `inner`
  allows it: `optax.lookahead`'s `LookaheadParams` are checked, and their
  leaves named, by the fast weights.

  Use the instance wherever Optax transformations are duck-typed (a linen
  `TrainState`, an `nnx.Optimizer`), or `gradient_transformation()` where an
  `optax.GradientTransformation` is required.

  Gradient accumulation: pass an `optax.MultiSteps(opt, k)` as `inner`.
  The optimizer steps at every k-th micro-batch, counting the dropped ones,
  on the mean (or, with `use_grad_mean=False`, the sum) of the micro-batches
  the window kept; a window that kept none is skipped. Each micro-batch is
  checked before it is accumulated, and a non-finite one is dropped alone:
  it lowers the loss scale at once, and finite ones raise it once per
  window. `max_norm` clips the window's gradient, and at the window's last
  micro-batch `grad_norm` is its norm. The state's `inner_state` is an `optax.MultiStepsState`.

  An applied step can write non-finite parameters from finite gradients (a
  float16 Adam state divides 0 by 0); the next steps then skip. A skipped
  step checks the parameters it is given and records such values in
  `last_nonfinite_write`; `SkipMonitor` raises on it.

  FP8 scales and amax histories (flax's `_overwrite_with_gradient`
  collection) get new values, not gradients, from the backward pass. Such
  leaves are checked but not unscaled, are not in the norm, have no `inner`
  state, take their "gradient" as their value on an applied step (or kept
  micro-batch) and are kept on a skipped one.

  Args:
    inner: the optimizer to wrap, any Optax transformation, or an
      `optax.MultiSteps` without `should_skip_update_fn`. Extra arguments
      of `update` (`value=` included) are passed to it.
    loss_scale: the initial loss scale.
    max_norm: clip the unscaled gradients (under accumulation, the window's
      gradient) by their global norm, as `optax.clip_by_global_norm` first
      in `inner` would; None does not clip. Gradients that are not finite
      (applied with `skip_nonfinite=False`), and a window whose norm is not
      finite, are applied unclipped: 0 * inf would make a NaN.
    skip_nonfinite: skip non-finite steps even when the loss scale would
      apply them (`FixedLossScale`, `NoOpLossScale`). False gives
      TensorFlow's exact behaviour.
    axis_name: a mapped axis whose replicas must agree (see `all_finite`).
      Inside `shard_map`, the norm sums the gradients that vary along it.
    overwrite_with_gradient: which leaves the gradient overwrites: a
      function of a leaf's key path that returns a bool, or a pytree of
      bools (the parameters' structure, or a prefix of it). By default, the
      leaves under a top-level key `"_overwrite_with_gradient"` (flax's
      rule).

  Raises:
    TypeError: if an argument has the wrong type.
    ValueError: if `max_norm` is not positive, or `inner` is an
      `optax.MultiSteps` with a `should_skip_update_fn`.

  Examples:
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
    >>> float(params["w"]), float(state.loss_scale()), float(state.grad_norm)
    (3.0, 4.0, 1.0)

    Clipping by the global norm, in the same read:

    >>> tx = ols.LossScaleOptimizer(optax.sgd(1.0), ols.FixedLossScale(8.0),
    ...                             max_norm=1.0)
    >>> params = {"w": jnp.zeros(2)}
    >>> params, state = tx.apply_gradients(
    ...     {"w": jnp.array([24.0, 32.0])}, tx.init(params), params)
    >>> params["w"], float(state.grad_norm)
    (Array([-0.6, -0.8], dtype=float32), 5.0)
  """

  def __init__(
    self,
    inner: optax.GradientTransformation | optax.MultiSteps,
    loss_scale: LossScale,
    *,
    max_norm: float | None = None,
    skip_nonfinite: bool = True,
    axis_name: _numerics.AxisName = None,
    overwrite_with_gradient: Any = None,
  ) -> None:
    call = "LossScaleOptimizer"
    self._multi = inner if isinstance(inner, optax.MultiSteps) else None
    self._every_k, self._mean = _accumulation(call, self._multi)
    inner = inner if self._multi is None else self._multi.inner_opt
    if not isinstance(inner, optax.GradientTransformation):
      swapped = isinstance(inner, LossScale)
      order = "; the arguments are (inner, loss_scale)" if swapped else ""
      raise TypeError(
        f"`{call}(inner=...)` must be an Optax transformation, got"
        f" {_validation.describe(inner)}{order}."
      )
    _inputs.check_loss_scale(call, loss_scale)
    self.inner = optax.with_extra_args_support(inner)
    self.loss_scale = loss_scale
    if max_norm is not None:
      max_norm = _validation.scalar(call, "max_norm", max_norm)
      if not max_norm > 0:
        raise ValueError(
          f"`{call}(max_norm=...)` must be positive, got {max_norm}."
        )
    self.max_norm = max_norm
    self.skip_nonfinite = _validation.boolean(
      call, "skip_nonfinite", skip_nonfinite
    )
    self.axis_name = axis_name
    self.overwrite_with_gradient = overwrite_with_gradient
    # What every state's own leaves are (outside any trace: under
    # `shard_map`, the loss scale's arrays could not be closed over).
    self._dtypes = jax.eval_shape(lambda: self._fresh(None, []))

  def init(self, params: optax.Params) -> LossScaleOptimizerState:
    """Returns the initial state: the loss scale and `inner`'s state.

    Args:
      params: the parameters, as `inner.init` takes them; their paths name
        the leaves in skip reports.

    Returns:
      A `LossScaleOptimizerState` of fresh arrays (safe to donate).
    """
    names = _inputs.leaf_names(_inputs.like_grads(params))
    mask = self._mask("LossScaleOptimizer.init", params)
    if params is not _inputs.like_grads(params) and any(jax.tree.leaves(mask)):
      raise ValueError(
        "`LossScaleOptimizer.init`: overwritten (FP8) leaves are not"
        " supported in `optax.lookahead`'s parameters."
      )
    trained = masked(mask, params)
    inner_state = (self._multi or self.inner).init(trained)
    if _float16(trained) and _float16(inner_state):  # once per call site
      warnings.warn(_FLOAT16, stacklevel=2)
    return self._fresh(inner_state, names)

  def _fresh(
    self, inner_state: Any, names: list[str]
  ) -> LossScaleOptimizerState:
    # The loss scale, the inner state, `should_apply`, four counters (fresh
    # arrays each: a donated state shares no buffer), the skip record, the
    # step count, the write record, the norm and the window's count.
    scale = jax.tree.map(jnp.copy, self.loss_scale)
    own = [scale, inner_state, jnp.array(True)]
    own += [jnp.zeros((), jnp.int32) for _ in range(4)]
    own.append(SkipRecord.empty(self.loss_scale(), names))
    own.append(jnp.zeros((), jnp.int32))
    own.append(WriteRecord.empty(names))
    own += [jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)]
    return LossScaleOptimizerState._make(own)

  def _mask(self, call: str, tree: Any) -> Any:
    return _inputs.overwrite_mask(call, self.overwrite_with_gradient, tree)

  def update(
    self,
    grads: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleOptimizerState]:
    """One step: returns the updates (zeros when skipped) and the new state.

    `inner.update` is traced once, as on every route.

    Args:
      grads: the scaled gradients.
      state: the state `init` returned, or the last step's.
      params: the parameters, if `inner` needs them.
      **extra_args: passed to `inner`; `value=` (the loss) also skips a step
        whose loss is not finite, keeping the loss scale.

    Returns:
      `(updates, new_state)`.

    Raises:
      ValueError: if `grads` and `params` differ in structure or a leaf's
        shape, naming the leaf; if `params` has other leaves than `init`
        had, naming its subtrees; or if, inside `shard_map`, the gradients
        vary across devices where the state does not.
      TypeError: if `state` is not a `LossScaleOptimizerState`, or a field
        of it was cast to another dtype (naming it), at trace time; or if
        the step fails on an `inner_state` that is not of the structure
        `init` gives (another optimizer's state).
    """
    call = "LossScaleOptimizer.update"
    return self._step(call, grads, state, params, extra_args, fused=False)

  def apply_gradients(
    self,
    grads: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params,
    **extra_args: Any,
  ) -> tuple[optax.Params, LossScaleOptimizerState]:
    """The fused step: `update` and `optax.apply_updates`, inside the `cond`.

    The updates never leave the `cond` as a buffer, a skipped step writes
    nothing, and donated parameters and state are updated in place. The
    results are those of `update` then `optax.apply_updates`, up to rounding
    (XLA may fuse the update's last multiply and the addition).

    Args:
      grads: the scaled gradients.
      state: the optimizer state.
      params: the parameters.
      **extra_args: as for `update`; pass the loss as `value=`.

    Returns:
      `(new_params, new_state)`.

    Raises:
      ValueError: as `update` does.
      TypeError: as `update` does.
    """
    call = "LossScaleOptimizer.apply_gradients"
    return self._step(call, grads, state, params, extra_args, fused=True)

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
    scale and applies the gradients as `apply_gradients` does, with the loss
    as `value=`. With `max_retries=k > 0`, a batch whose loss is finite but
    whose gradients are not is recomputed at `LossScale.lowered()` scales,
    up to `k` times, inside the same compiled step, until its gradients are
    finite; the batch is then applied. A recomputed batch is applied at the
    scale it fit at, and the loss scale moves exactly as it would for one
    overflowed step without retries (hysteresis included): retries save the
    batch, they never change the scale's course. `fun` is traced once; each
    retry costs one more forward and backward pass.

    Args:
      fun: the loss function; it returns a scalar, or `(scalar, aux)` with
        `has_aux`.
      params: the parameters (the first argument of `fun`).
      state: the optimizer state.
      *args: further arguments of `fun` (the batch).
      has_aux: whether `fun` returns `(loss, aux)`.
      max_retries: how many times to recompute an overflowed batch.
      **kwargs: keyword arguments of `fun`.

    Returns:
      `(value, new_params, new_state)`: `value` is the unscaled loss, or
      `(loss, aux)`.

    Raises:
      ValueError: if `max_retries` is negative, or positive with a loss
        scale that cannot be lowered.
      TypeError: if `fun` is not callable, an argument has the wrong type,
        or `fun` returns a tuple without `has_aux=True`; for the state, as
        `update` does.

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
      >>> float(state.loss_scale())  # one halving, as for one overflow
      8388608.0
    """
    call = "LossScaleOptimizer.minimize"
    _inputs.check_minimize(call, fun, params)
    _validation.integer(call, "max_retries", max_retries, minimum=0)
    _inputs.check_inputs(call, None, state, params, self._dtypes)
    value_and_grad = scaled_value_and_grad(fun, has_aux=has_aux)
    loss_of = (lambda v: v[0]) if has_aux else (lambda v: v)

    if max_retries == 0:
      value, grads = value_and_grad(state.loss_scale, params, *args, **kwargs)
      extra = {"value": loss_of(value)}
      return value, *self._step(call, grads, state, params, extra, True)

    def finish(found: _retry.Attempt, operand: Any) -> Any:
      params, state = operand
      extra = {"value": loss_of(found.value)}
      return self._step(call, found.grads, state, params, extra, True, found)

    value, (params, state) = _retry.retry(
      call,
      lambda ls, operand: value_and_grad(ls, operand[0], *args, **kwargs),
      lambda ls, value, g: check(
        call, ls, g, loss_of(value), self.axis_name, self._mask(call, g)
      ),
      finish,
      state.loss_scale,
      max_retries,
      (params, state),
    )
    return value, params, state

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This optimizer as an `optax.GradientTransformationExtraArgs`.

    Returns:
      A transformation whose `init` and `update` are this object's methods.
    """
    return optax.GradientTransformationExtraArgs(self.init, self.update)

  def _step(
    self,
    call: str,
    grads: Any,
    state: LossScaleOptimizerState,
    params: Any,
    extra_args: dict[str, Any],
    fused: bool,
    attempt: _retry.Attempt | None = None,
  ) -> tuple[Any, LossScaleOptimizerState]:
    """Read, decide, one conditional around `inner`, and the new state.

    `attempt` is one of `minimize`'s attempts (None: `grads` are checked
    here). An attempt that a retry follows (`held`) writes nothing; that is
    folded into the one conditional (a second would make XLA copy what the
    retry loop carries; carrying the gradients out of the loop instead took
    1.5x the temporary memory on benchmarks/train_step.py's model).
    """
    _inputs.check_inputs(call, grads, state, params, self._dtypes)
    mask = self._mask(call, grads)
    if params is None and any(jax.tree.leaves(mask)):
      raise ValueError(f"`{call}(params=None)`: overwritten leaves need them.")
    if attempt is None:  # `held` a Python bool (see `_retry.Attempt`)
      value = extra_args.get("value")
      checks = check(call, state.loss_scale, grads, value, self.axis_name, mask)
      attempt = _retry.Attempt(value, grads, state.loss_scale, checks, 0, False)
    step = _Step(state, params, extra_args, fused, mask, attempt)
    checks, retries = attempt.checks, attempt.retries
    skip = self.skip_nonfinite
    loss_scale, should_apply = decide(attempt.loss_scale, checks, skip)
    if not isinstance(retries, int):  # the scale moves as for one overflow
      first = checks._replace(grads_finite=checks.grads_finite & (retries == 0))
      loss_scale = decide(state.loss_scale, first, skip)[0]
    try:  # `inner` reads its state here
      index, closes, counters = self._schedule(
        state, should_apply, attempt.held
      )
      out, inner, wrote, norm = _cond.switch(
        index,
        self._branches(step, should_apply),
        *(params, state.inner_state, state.last_nonfinite_write),
        sharded_like=grads,
      )
    except Exception as error:
      self._foreign(call, step, error)
      raise
    # A kept micro-batch in an open window holds the scale (unless retried).
    hold = should_apply & ~closes & (retries == 0)
    loss_scale = tree_where(hold, state.loss_scale, loss_scale)
    new = _next_state(state, loss_scale, should_apply, attempt)
    if counters is not None:
      inner = inner._replace(mini_step=counters[0], gradient_step=counters[1])
      new = new._replace(accumulated=counters[2])
    new = new._replace(
      inner_state=inner, last_nonfinite_write=wrote, grad_norm=norm
    )
    if attempt.held is not False:  # a held attempt keeps scale and counters
      new = tree_where(attempt.held, state._replace(inner_state=inner), new)
    return out, new

  def _foreign(self, call: str, step: _Step, error: Exception) -> None:
    """Raises a `TypeError` naming `inner_state` if the step's is not of the
    structure `init` gives: a step that failed (`error`) on another
    optimizer's state says so. Otherwise the step's own error stands."""
    given = step.attempt.grads if step.params is None else step.params
    try:  # `inner.init` may need values, which a failed step cannot give
      like = jax.tree.structure(jax.eval_shape(self.init, given).inner_state)
    except Exception:
      return
    if like != jax.tree.structure(step.state.inner_state):  # type: ignore[operator]
      raise TypeError(
        f"`{call}`: the state's `inner_state` is not of the structure `init`"
        " gives: another optimizer's, or the parameters' containers changed."
      ) from error

  def _schedule(
    self, state: LossScaleOptimizerState, should_apply: Any, held: Any
  ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...] | None]:
    """The branch, whether a window closes, and the window's counters.

    Branch 0 skips; without accumulation 1 steps; with it 1 accumulates
    and 2 steps, at the window's last micro-batch if the window kept any.
    """
    applies = (should_apply & jnp.logical_not(held)).astype(jnp.int32)
    if self._every_k is None:
      return applies, jnp.array(True), None
    window, held = state.inner_state, jnp.asarray(held)
    closes = window.mini_step + 1 >= self._every_k(window.gradient_step)
    kept = state.accumulated + applies
    # A held attempt skips: the retry that follows it may close the window.
    index = jnp.where(closes & (kept > 0) & ~held, 2, applies)
    position = jnp.where(closes, 0, window.mini_step + 1)
    mini_step = jnp.where(held, window.mini_step, position)
    gradient_step = window.gradient_step + (index == 2).astype(jnp.int32)
    return index, closes, (mini_step, gradient_step, jnp.where(closes, 0, kept))

  def _branches(self, step: _Step, kept: jax.Array) -> list[Callable[..., Any]]:
    """The branches: skip, (accumulate,) step. Each returns the output, the
    inner state, the write record and the norm (at a window's step, the
    window's). The skip stays branch 0, which XLA passes donated buffers
    through uncopied (jax#39449; tests/test_accelerator_ready.py)."""
    window, state = self._every_k is not None, step.state
    checks = step.attempt.checks
    opt = lambda inner: inner.inner_opt_state if window else inner  # noqa: E731
    # What `inner` is given: under accumulation, the window's gradient in
    # the accumulator's dtype, as `optax.MultiSteps` gives it.
    grads = masked(step.mask, step.attempt.grads)
    given = state.inner_state.acc_grads if window else grads
    output, update = self._output(step, given, opt(state.inner_state))
    # Without accumulation the clip multiplies the unscaling: one scalar,
    # computed outside the conditional, since XLA copies a scalar computed
    # inside it into every leaf's kernel (benchmarks/LLM_STACK.md's compiles).
    finite = checks.grads_finite
    clip = jnp.float32(1) if window else self._factor(checks.norm, finite)
    factor = step.attempt.loss_scale.unscale(clip)

    def skip(params: Any, inner: Any, wrote: Any) -> Any:
      new = _write_record(state, params, self.axis_name)
      new = tree_where(step.attempt.held, wrote, new)
      return output(params, None, False), inner, new, checks.norm

    def accumulate(params: Any, inner: Any, wrote: Any) -> Any:
      new = inner._replace(acc_grads=self._gradient(step, kept, factor))
      return output(params, None, kept), new, wrote, checks.norm

    def apply(params: Any, inner: Any, wrote: Any) -> Any:
      g, norm = self._gradient(step, kept, factor), checks.norm
      if window:  # the window's norm, not the micro-batch's verdict
        read = _numerics.pieces(jax.tree.leaves(g))
        norm = _numerics.root(_numerics.squares(read, self.axis_name)[0])
        g = multiply_floats(g, self._factor(norm, jnp.isfinite(norm)))
      updates, new = update(g, opt(inner), masked(step.mask, params))
      if window:
        zeros = optax.tree.zeros_like(inner.acc_grads)
        new = inner._replace(inner_opt_state=new, acc_grads=zeros)
      return output(params, updates, kept), new, wrote, norm

    return [skip, accumulate, apply] if window else [skip, apply]

  def _factor(self, norm: jax.Array, finite: jax.Array) -> jax.Array:
    """What clips gradients of global `norm` to `max_norm` (1 without it).
    Gradients that are not `finite` (applied with `skip_nonfinite=False`; a
    window whose norm is not) are left as they are: 0 * inf is a NaN."""
    if self.max_norm is None:
      return jnp.ones((), jnp.float32)
    keep = (norm < self.max_norm) | ~finite
    return jnp.where(keep, 1.0, self.max_norm / norm)

  def _gradient(self, step: _Step, kept: jax.Array, factor: jax.Array) -> Any:
    """The gradients times `factor` (the unscaling, and without accumulation
    the clip); under accumulation, the window's mean (or sum), with this
    micro-batch if it is kept: `optax.MultiSteps`' running mean, in the
    accumulator's dtype."""
    unscaled = masked(step.mask, multiply_floats(step.attempt.grads, factor))
    if self._every_k is None:
      return unscaled
    n = (step.state.accumulated + 1).astype

    def add(u: jax.Array, acc: jax.Array) -> jax.Array:
      u = u.astype(acc.dtype)
      new = acc + (u - acc) / n(acc.dtype) if self._mean else acc + u
      return jnp.where(kept, new, acc)

    return jax.tree.map(add, unscaled, step.state.inner_state.acc_grads)

  def _output(
    self, step: _Step, given: Any, opt_state: Any
  ) -> tuple[Callable[[Any, Any, Any], Any], Callable[..., Any]]:
    """A branch's output from `inner`'s updates (None: no update), and
    `inner.update`.

    The fused step returns the parameters, `update` the updates: zeros when
    skipped, of the shapes `inner` returns, so `inner.update` is traced
    once, here, on `given` (what it is given), and replayed in the step.
    Each overwritten leaf is assigned its gradient where `assign` holds.
    """
    mask, fused = step.mask, step.fused

    update = lambda g, s, p: self.inner.update(g, s, p, **step.extra_args)  # noqa: E731
    operands = (given, opt_state, masked(mask, step.params))
    eager = jax.config.jax_disable_jit  # type: ignore[attr-defined]
    if not fused and eager:  # `inner` as it is: its traceback whole
      like = jax.eval_shape(update, *operands)[0]
    elif not fused:  # `inner` may return another dtype or structure
      replay, consts, (like, _) = _cond.hoist(update, operands)
      update = functools.partial(replay, consts)

    def output(params: Any, updates: Any, assign: Any) -> Any:
      if not fused:
        base = optax.tree.zeros_like(like) if updates is None else updates
      elif updates is not None:
        base = optax.apply_updates(masked(mask, params), updates)
      else:
        base = params

      def pick(m: bool, b: Any, g: Any, p: Any) -> Any:
        new = g.astype(p.dtype) if fused else g.astype(p.dtype) - p
        keep = p if fused else jnp.zeros_like(p)
        return jnp.where(assign, new, keep) if m else b

      if not any(jax.tree.leaves(mask)):
        return base
      return jax.tree.map(pick, mask, base, step.attempt.grads, params)

    return output, update
