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

from optax_lossscale import (
  _cond,
  _inputs,
  _numerics,
  _retry,
  _spikes,
  _validation,
)
from optax_lossscale._loss_scale import LossScale, multiply_floats, reciprocal
from optax_lossscale._states import LossScaleOptimizerState as State
from optax_lossscale._states import SkipRecord, WriteRecord
from optax_lossscale._value_and_grad import scaled_value_and_grad
from optax_lossscale._verdict import (
  Verdict,
  decide,
  leaves,
  read,
  without_overwritten,
)

__all__ = ["LossScaleOptimizer"]


class _Step(NamedTuple):
  """What a step's branches read: its inputs, and what its read found."""

  state: State
  params: Any
  grads: Any
  extra_args: dict[str, Any]
  fused: bool
  overwritten: Any
  attempt: _retry.Attempt  # the scale and the verdict of its gradients


class _Written(NamedTuple):
  """What the conditional returns besides its output: `inner`'s state, the
  accumulator and the write record after the branch taken, the norm (when
  `inner` steps under accumulation, the window's) and, on a spike, each
  leaf's norm."""

  inner_state: Any
  accumulator: Any
  last_nonfinite_write: WriteRecord
  norm: jax.Array
  leaf_norms: jax.Array


class _Window(NamedTuple):
  """Where a call falls in its accumulation window, and the branch it takes:
  0 skips, 1 steps (with accumulation: 1 accumulates, 2 steps)."""

  branch: jax.Array
  closes: jax.Array
  stepped: jax.Array
  micro_step: jax.Array
  accumulated: jax.Array


_MULTISTEPS = (
  "`{call}(inner=...)` must not hold an `optax.MultiSteps`, which would move"
  " the loss scale at every micro-batch: pass its optimizer and the window's"
  " length, `LossScaleOptimizer(opt, loss_scale, ...,"
  " gradient_accumulation_steps=k)`."
)
_FLOAT16 = (
  "LossScaleOptimizer.init: float16 parameters with a float16 inner state: if"
  " `inner` divides by an `eps` (Adam's 1e-8 is 0 in float16), a zero gradient"
  " makes a NaN update. Keep float32 parameters, cast in the forward pass."
)


def _float16(tree: Any) -> bool:
  return jnp.float16 in [getattr(x, "dtype", 0) for x in jax.tree.leaves(tree)]


def _count(counter: jax.Array, flag: jax.Array | bool) -> jax.Array:
  return jnp.where(flag, optax.safe_increment(counter), counter)


def _held(loss_scale: LossScale) -> LossScale:
  """The scale after a kept micro-batch of an open window: unchanged (it
  grows once per window), but a finite step restarts a consecutive
  hysteresis."""
  if getattr(loss_scale, "consecutive_hysteresis", False):  # Dynamic's
    bad = jnp.zeros_like(loss_scale.num_bad_steps)  # type: ignore[attr-defined]
    return dataclasses.replace(loss_scale, num_bad_steps=bad)  # type: ignore[type-var]
  return loss_scale


def _write_record(state: State, params: Any, axis_name: Any) -> WriteRecord:
  """The write record of a skipped step, given `params`.

  Non-finite values there were written by an applied step before it. A
  diagnostic of skipped steps only: checking what every applied step writes
  reads the parameters and state again. The inner state is not read: on
  XLA:CPU, each leaf checked needs a byte per element of temporary memory,
  which every step allocates.
  """
  last = state.last_nonfinite_write
  flat = leaves(_inputs.like_grads(params))
  if len(flat) != last.nonfinite.shape[-1]:  # `update` without parameters
    return last
  finite = _numerics.agree(_numerics.finite_flags(flat), axis_name)
  applied = state.steps - state.consecutive_skipped_steps - 1  # the last one
  new = WriteRecord(step=applied, nonfinite=~finite)
  return tree_where(jnp.all(finite) | (applied < 0), last, new)  # type: ignore[no-any-return]


def _spike_settings(
  call: str, sigmas: float | None, window: int | None
) -> tuple[float | None, int]:
  """The spike rule's settings, checked: `spike_window` only with
  `spike_sigmas`, and None is 128 (OLMo-core's)."""
  if sigmas is not None:
    sigmas = _validation.positive(call, "spike_sigmas", sigmas)
  elif window is not None:
    raise ValueError(
      f"`{call}(spike_window={window!r})` is the spike rule's: set"
      " `spike_sigmas` too (6.0 is OLMo-core's)."
    )
  window = 128 if window is None else window
  checked = _validation.integer(
    call, "spike_window", window, minimum=4, maximum=2**29
  )
  return sigmas, checked


def _unscaled(step: _Step, factor: jax.Array, twos: Any) -> Any:
  """The step's trained gradients times `factor` and `twos` (`reciprocal`'s
  parts, computed outside the conditional), overwritten leaves left out."""
  grads = multiply_floats(step.grads, factor, twos)
  return without_overwritten(step.overwritten, grads)


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
  state bit for bit unchanged; it records the skip in `state.last_skip`,
  for `skip_reports` and `SkipMonitor` to read later. Nothing calls the
  host.

  The skip is one conditional around `inner`'s update. `apply_gradients`
  (and `minimize`) update the parameters inside it: the fastest step, and
  the one to use with donated parameters and state. `update` returns the
  updates, for code that needs the Optax interface. A sum of squares that
  is not finite (an overflow, or finite gradients whose squares pass
  float32's range), or a loss scale below 1, runs a small conditional that
  checks each leaf exactly and norms the unscaled gradients, so that the
  norm and the clip are `optax.clip_by_global_norm`'s at any scale.

  Parameters may differ in structure from the gradients where `inner`
  allows it: `optax.lookahead`'s `LookaheadParams` are checked, and their
  leaves named, by the fast weights.

  Use the instance wherever Optax transformations are duck-typed (a linen
  `TrainState`, an `nnx.Optimizer`), or `gradient_transformation()` where an
  `optax.GradientTransformation` is required.

  Gradient accumulation (`gradient_accumulation_steps=k`, Keras' and
  DeepSpeed's name): each call is a micro-batch, and `inner` steps at every
  k-th one, counting the dropped ones, on the mean of the micro-batches the
  window kept; a window that kept none does not step. Each micro-batch is
  checked before it is accumulated, and a non-finite one is dropped alone:
  it lowers the loss scale at once, and finite ones raise it once per
  window. `max_norm` clips the window's mean, and when `inner` steps
  (`state.stepped`) `grad_norm` is its norm. The window's counters and
  mean are fields of this optimizer's state; `inner_state` is `inner`'s.

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
    inner: the optimizer to wrap, any Optax transformation but an
      `optax.MultiSteps` (pass its optimizer and
      `gradient_accumulation_steps`). Extra arguments of `update` (`value=`
      included) are passed to it.
    loss_scale: the initial loss scale.
    max_norm: clip the unscaled gradients (under accumulation, the window's
      gradient) by their global norm, as `optax.clip_by_global_norm` first
      in `inner` would; None does not clip. Gradients that are not finite
      (applied with `skip_nonfinite=False`; under accumulation, a window's
      mean that is not) are applied unclipped: 0 * inf would make a NaN.
      Finite gradients whose norm passes float32's range are clipped to 0,
      as Optax's clip does.
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
    gradient_accumulation_steps: how many micro-batches each optimizer step
      averages; 1 (the default) does not accumulate.
    spike_sigmas: skip a step whose global norm, or whose loss when given
      as `value=`, exceeds the mean of the last `spike_window` finite
      steps' by more than this many standard deviations (OLMo-core's rule,
      `docs/guides/bad_batches.md`); judged once the window is half full,
      under accumulation at a window's end by its mean. None (the default)
      judges nothing.
    spike_window: how many recent finite steps the spike rule compares
      with (under accumulation, windows), at least 4; None is 128
      (OLMo-core's). Only with `spike_sigmas`.

  Raises:
    TypeError: if an argument has the wrong type, or `inner` is an
      `optax.MultiSteps` in either form (the message writes out the
      replacement).
    ValueError: if `max_norm` or `spike_sigmas` is not positive,
      `gradient_accumulation_steps` is below 1 or `spike_window` below 4.

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
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    max_norm: float | None = None,
    skip_nonfinite: bool = True,
    axis_name: _numerics.AxisName = None,
    overwrite_with_gradient: Any = None,
    gradient_accumulation_steps: int = 1,
    spike_sigmas: float | None = None,
    spike_window: int | None = None,
  ) -> None:
    call = "LossScaleOptimizer"
    if isinstance(inner, optax.MultiSteps):  # its other forms: in `init`
      raise TypeError(_MULTISTEPS.format(call=call))
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
      max_norm = _validation.positive(call, "max_norm", max_norm)
    self.max_norm = max_norm
    self.skip_nonfinite = _validation.boolean(
      call, "skip_nonfinite", skip_nonfinite
    )
    self.axis_name = axis_name
    self.overwrite_with_gradient = overwrite_with_gradient
    self.gradient_accumulation_steps = _validation.integer(
      call,
      "gradient_accumulation_steps",
      gradient_accumulation_steps,
      minimum=1,
    )
    self.spike_sigmas, self.spike_window = _spike_settings(
      call, spike_sigmas, spike_window
    )
    # What every state's own leaves are (outside any trace: under
    # `shard_map`, the loss scale's arrays could not be closed over).
    self._dtypes = jax.eval_shape(lambda: self._fresh(None, [], ()))

  def init(self, params: optax.Params) -> State:
    """Returns the initial state: the loss scale and `inner`'s state.

    Args:
      params: the parameters, as `inner.init` takes them; their paths name
        the leaves in skip reports.

    Returns:
      A `LossScaleOptimizerState` of fresh arrays (safe to donate).
    """
    names = _inputs.leaf_names(_inputs.like_grads(params))
    overwritten = self._overwritten("LossScaleOptimizer.init", params)
    lookahead = params is not _inputs.like_grads(params)
    if lookahead and any(jax.tree.leaves(overwritten)):
      raise ValueError(
        "`LossScaleOptimizer.init`: overwritten (FP8) leaves are not"
        " supported in `optax.lookahead`'s parameters."
      )
    trained = without_overwritten(overwritten, params)
    inner_state = self.inner.init(trained)
    multi = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
    if any(map(multi, jax.tree.leaves(inner_state, is_leaf=multi))):
      raise TypeError(_MULTISTEPS.format(call="LossScaleOptimizer.init"))
    if _float16(trained) and _float16(inner_state):  # once per call site
      warnings.warn(_FLOAT16, stacklevel=2)
    accumulator: Any = ()
    if self.gradient_accumulation_steps > 1:
      accumulator = optax.tree.zeros_like(_inputs.like_grads(trained))
    return self._fresh(inner_state, names, accumulator)

  def _fresh(
    self, inner_state: Any, names: list[str], accumulator: Any
  ) -> State:
    # Fresh arrays each: a donated state shares no buffer.
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    return State(
      loss_scale=jax.tree.map(jnp.copy, self.loss_scale),
      inner_state=inner_state,
      should_apply=jnp.array(True),
      skipped_steps=zero(),
      consecutive_skipped_steps=zero(),
      nonfinite_loss_steps=zero(),
      retries=zero(),
      last_skip=SkipRecord.empty(self.loss_scale(), names),
      steps=zero(),
      last_nonfinite_write=WriteRecord.empty(names),
      grad_norm=jnp.zeros((), jnp.float32),
      accumulated=zero(),
      stepped=jnp.array(False),
      micro_step=zero(),
      accumulator=accumulator,
      skipped_optimizer_steps=zero(),
      spikes=()
      if self.spike_sigmas is None
      else _spikes.SpikeWindow.empty(self.spike_window),
    )

  def _overwritten(self, call: str, tree: Any) -> Any:
    """Per leaf of `tree`, whether it is an overwritten (FP8) leaf."""
    return _inputs.overwritten_leaves(call, self.overwrite_with_gradient, tree)

  def update(
    self,
    grads: optax.Updates,
    state: State,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, State]:
    """One step: returns the updates (zeros when skipped) and the new state.

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

    Warns:
      UserWarning: if the loss is given as `loss=` without `value=`: no
        check reads it.
    """
    call = "LossScaleOptimizer.update"
    return self._step(call, grads, state, params, extra_args, fused=False)

  def apply_gradients(
    self,
    grads: optax.Updates,
    state: State,
    params: optax.Params,
    **extra_args: Any,
  ) -> tuple[optax.Params, State]:
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
    state: State,
    *args: Any,
    has_aux: bool = False,
    max_retries: int = 0,
    **kwargs: Any,
  ) -> tuple[Any, optax.Params, State]:
    """One whole train step: the scaled gradient of `fun`, then the update.

    Differentiates `fun(params, *args, **kwargs)` scaled by the state's loss
    scale and applies the gradients as `apply_gradients` does, with the loss
    as `value=`. With `max_retries=k > 0`, a batch whose loss is finite but
    whose gradients are not is recomputed at `LossScale.lowered()` scales,
    up to `k` times, inside the same compiled step, until its gradients are
    finite; the batch is then applied, unless the spike rule
    (`spike_sigmas`) finds it an outlier. A recomputed batch is applied at the
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
      >>> def loss_fn(p):  # a float16 forward pass, the loss in float32
      ...   return jnp.sum(p["w"].astype(jnp.float16).astype(jnp.float32) ** 2)
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

    def finish(value: Any, g: Any, found: _retry.Attempt, operand: Any) -> Any:
      params, state = operand
      extra = {"value": loss_of(value)}
      return self._step(call, g, state, params, extra, True, found)

    def check(ls: LossScale, value: Any, g: Any) -> Verdict:
      overwritten = self._overwritten(call, g)
      return read(call, ls, g, loss_of(value), self.axis_name, overwritten)

    value, (params, state) = _retry.retry(
      call,
      lambda ls, operand: value_and_grad(ls, operand[0], *args, **kwargs),
      check,
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
    state: State,
    params: Any,
    extra_args: dict[str, Any],
    fused: bool,
    attempt: _retry.Attempt | None = None,
  ) -> tuple[Any, State]:
    """Read, decide, one conditional around `inner`, and the new state.

    `attempt` is one of `minimize`'s retry attempts; None outside the retry
    loop, where the gradients are read here. An attempt that another
    follows (`held`) writes nothing: it takes the conditional's skip branch,
    which keeps the parameters and `inner`'s state (a second conditional
    would make XLA copy what the retry loop carries), and a select keeps
    the rest of the state.
    """
    step = self._prepare(call, grads, state, params, extra_args, fused, attempt)
    attempt = step.attempt
    # The verdict at the attempt's scale (outside the retry loop, the
    # state's); `_new_state` moves the state's scale.
    should_apply = decide(
      attempt.loss_scale, attempt.verdict, self.skip_nonfinite
    )[1]
    spike, spikes = self._spike(step, should_apply & ~attempt.held)
    applied = should_apply & ~spike.found
    blocked = attempt.held | spike.found  # no step, whatever the window kept
    window = self._window(state, applied & ~attempt.held, blocked)
    try:  # `inner` reads its state here
      out, written = _cond.switch(
        window.branch,
        self._branches(step, should_apply, spike),
        params,
        state.inner_state,
        state.accumulator,
        state.last_nonfinite_write,
        sharded_like=grads,
      )
    except Exception as error:
      self._foreign(call, step, error)
      raise
    return out, self._new_state(step, applied, window, spike, spikes, written)

  def _prepare(
    self,
    call: str,
    grads: Any,
    state: State,
    params: Any,
    extra_args: dict[str, Any],
    fused: bool,
    attempt: _retry.Attempt | None,
  ) -> _Step:
    """Checks a step's inputs; reads the gradients outside the retry loop."""
    _inputs.check_loss_name(call, extra_args)
    _inputs.check_inputs(call, grads, state, params, self._dtypes)
    self._check_shaped(call, state)
    overwritten = self._overwritten(call, grads)
    if params is None and any(jax.tree.leaves(overwritten)):
      raise ValueError(f"`{call}(params=None)`: overwritten leaves need them.")
    if attempt is None:  # outside the retry loop: the first attempt, alone
      value, axis = extra_args.get("value"), self.axis_name
      verdict = read(call, state.loss_scale, grads, value, axis, overwritten)
      zero, false = jnp.zeros((), jnp.int32), jnp.array(False)
      attempt = _retry.Attempt(state.loss_scale, verdict, zero, false)
    return _Step(
      state=state,
      params=params,
      grads=grads,
      extra_args=extra_args,
      fused=fused,
      overwritten=overwritten,
      attempt=attempt,
    )

  def _new_state(
    self,
    step: _Step,
    should_apply: jax.Array,
    window: _Window,
    spike: _spikes.Spike,
    spikes: Any,
    written: _Written,
  ) -> State:
    """The state after a step: `should_apply` whether it applied, `window`
    where it fell, `spike` the rule's verdict and `spikes` its window after
    it, `written` what the conditional returned.

    The scale moves as for the batch's first attempt: a retried batch as
    one overflowed step would. A kept micro-batch of an open window holds
    it. A held attempt writes nothing: its conditional kept `inner`'s state
    and the accumulator, and a select keeps the rest.
    """
    state, attempt = step.state, step.attempt
    verdict, first = attempt.verdict, attempt.retries == 0
    as_first = verdict._replace(grads_finite=verdict.grads_finite & first)
    moved = decide(state.loss_scale, as_first, self.skip_nonfinite)[0]
    hold = should_apply & ~window.closes & first
    loss_scale = tree_where(hold, _held(state.loss_scale), moved)
    record = self._skip_record(step, loss_scale, spike, written.leaf_norms)
    loss_finite, skipped = verdict.loss_finite, ~should_apply
    loss_failed = False if loss_finite is None else ~loss_finite
    norm = written.norm.astype(jnp.float32)
    new = state._replace(
      loss_scale=loss_scale,
      should_apply=should_apply,
      skipped_steps=_count(state.skipped_steps, skipped),
      consecutive_skipped_steps=jnp.where(
        skipped, record.consecutive_skipped_steps, 0
      ),
      nonfinite_loss_steps=_count(state.nonfinite_loss_steps, loss_failed),
      retries=state.retries + attempt.retries,
      last_skip=tree_where(skipped, record, state.last_skip),
      steps=optax.safe_increment(state.steps),
      last_nonfinite_write=written.last_nonfinite_write,
      grad_norm=jnp.where(spike.found, spike.stats[0, 0], norm),
      accumulated=window.accumulated,
      stepped=window.stepped,
      micro_step=window.micro_step,
      skipped_optimizer_steps=_count(
        state.skipped_optimizer_steps, window.closes & ~window.stepped
      ),
      spikes=spikes,
    )
    new = tree_where(
      attempt.held,
      state._replace(inner_state=None, accumulator=None),
      new._replace(inner_state=None, accumulator=None),
    )
    return new._replace(  # type: ignore[no-any-return]
      inner_state=written.inner_state, accumulator=written.accumulator
    )

  def _skip_record(
    self,
    step: _Step,
    next_scale: LossScale,
    spike: _spikes.Spike,
    leaf_norms: jax.Array,
  ) -> SkipRecord:
    """The step's record, kept if it is skipped: its scale (the state's) and
    the next, why, and on a spike each leaf's norm. The attempt's scale
    says whether the scale reached its floor."""
    state, attempt = step.state, step.attempt
    verdict, lowered = attempt.verdict, attempt.loss_scale.lowered()
    loss_finite = verdict.loss_finite
    slots = state.last_skip.nonfinite.shape[-1]  # none after `init(None)`
    at_floor = True if lowered is None else lowered() >= attempt.loss_scale()
    return dataclasses.replace(
      state.last_skip,
      step=state.steps,
      loss_scale=state.loss_scale(),
      next_loss_scale=next_scale(),
      consecutive_skipped_steps=optax.safe_increment(
        state.consecutive_skipped_steps
      ),
      loss_given=jnp.array(loss_finite is not None),
      loss_finite=jnp.array(True) if loss_finite is None else loss_finite,
      at_floor=jnp.asarray(at_floor),
      nonfinite=~verdict.flags[:slots],
      spiked=spike.spiked,
      spike_stats=jnp.where(spike.found, spike.stats, 0),
      leaf_norms=leaf_norms,
      optimizer_step=state.steps // self.gradient_accumulation_steps,
    )

  def _foreign(self, call: str, step: _Step, error: Exception) -> None:
    """Raises a `TypeError` naming `inner_state` if the step's is not of the
    structure `init` gives: a step that failed (`error`) on another
    optimizer's state says so. Otherwise the step's own error stands."""
    given = step.grads if step.params is None else step.params
    try:  # `inner.init` may need values, which a failed step cannot give
      with warnings.catch_warnings():  # `init`'s own, given at `init`
        warnings.simplefilter("ignore")
        like = jax.eval_shape(self.init, given).inner_state
    except Exception:
      return
    if jax.tree.structure(like) != jax.tree.structure(step.state.inner_state):  # type: ignore[operator]
      raise TypeError(
        f"`{call}`: the state's `inner_state` is not of the structure `init`"
        " gives: another optimizer's, or the parameters' containers changed."
      ) from error

  def _check_shaped(self, call: str, state: State) -> None:
    """Raises a `TypeError` if the state's accumulator or spike window is
    not of this optimizer's settings (they shape those fields), or the
    window was cast."""
    k, sigmas, like = (
      self.gradient_accumulation_steps,
      self.spike_sigmas,
      self._dtypes.spikes,
    )
    empty = isinstance(state.accumulator, tuple) and not state.accumulator
    shaped = lambda w: (jax.tree.structure(w), jax.tree.map(jnp.shape, w))  # noqa: E731
    if empty == (k > 1):
      field, setting = "accumulator", f"gradient_accumulation_steps={k}"
    elif shaped(state.spikes) != shaped(like):
      field, setting = "spikes", "the spike rule off"
      if sigmas is not None:
        setting = f"spike_sigmas={sigmas}, spike_window={self.spike_window}"
    else:  # its dtypes, as `check_like` checks the other fields'
      paths = jax.tree_util.tree_leaves_with_path(state.spikes)
      for (path, leaf), want in zip(paths, jax.tree.leaves(like), strict=True):
        where = f"`{call}`: the state's `.spikes{jax.tree_util.keystr(path)}`"
        _validation.array_dtype(where, leaf, want.dtype)
      return
    raise TypeError(
      f"`{call}`: the state's `{field}` is of an optimizer of other settings"
      f" than this one's ({setting}): take the state from this optimizer's"
      " `init` (docs/guides/bad_batches.md: turning the rule on in a resumed"
      " run)."
    )

  def _open(self, state: State) -> tuple[jax.Array, jax.Array]:
    """How many micro-batches the open window kept, and whether this call
    closes it. Without accumulation every call closes its own, whatever a
    state restored from an accumulating run holds."""
    k = self.gradient_accumulation_steps
    if k == 1:
      return jnp.zeros((), jnp.int32), jnp.array(True)
    return state.accumulated, state.micro_step + 1 >= k

  def _window(
    self, state: State, keeps: jax.Array, blocked: jax.Array
  ) -> _Window:
    """The branch this call takes, and the window's counters after it.

    `keeps` is whether this call's gradients are kept (the spike rule's
    verdict given); a `blocked` call does not step (a spike, or a held
    attempt: the retry that follows it may close the window). Without
    accumulation, every window is one call long.
    """
    accumulated, closes = self._open(state)
    count = accumulated + keeps.astype(jnp.int32)
    stepped = closes & (count > 0) & ~blocked
    steps = 2 if self.gradient_accumulation_steps > 1 else 1
    return _Window(
      branch=jnp.where(stepped, steps, keeps.astype(jnp.int32)),
      closes=closes,
      stepped=stepped,
      micro_step=jnp.where(closes, 0, state.micro_step + 1),
      accumulated=jnp.where(closes, 0, count),
    )

  def _branches(
    self,
    step: _Step,
    should_apply: jax.Array,
    spike: _spikes.Spike,
  ) -> list[Callable[..., Any]]:
    """The branches: skip, (accumulate,) step. Each takes the parameters,
    `inner`'s state, the accumulator and the write record, and returns the
    output and a `_Written`. The skip
    stays branch 0, which XLA passes donated buffers through uncopied
    (jax#39449; tests/test_accelerator_ready.py)."""
    accumulating = self.gradient_accumulation_steps > 1
    verdict, state = step.attempt.verdict, step.state
    # Without accumulation the clip multiplies the unscaling: one scalar,
    # computed outside the conditional, since XLA copies a scalar computed
    # inside it into every leaf's kernel.
    clip = (
      jnp.float32(1)
      if accumulating
      else self._clip(verdict.norm, verdict.grads_finite)
    )
    base, twos = reciprocal(step.attempt.loss_scale())
    factor = clip * base.astype(clip.dtype)  # float64 with a float64 norm
    unscaled = lambda: _unscaled(step, factor, twos)  # noqa: E731
    given = state.accumulator if accumulating else unscaled()
    output, update = self._inner_update(step, given)
    norm = verdict.norm.astype(jnp.float32)  # the micro-batch's
    none = jnp.zeros_like(state.last_skip.leaf_norms)

    def skip(params: Any, inner: Any, acc: Any, wrote: Any) -> Any:
      new = _write_record(state, params, self.axis_name)
      norms = self._spike_norms(step, acc, should_apply, spike, base, twos)
      return output(params, None, False), _Written(inner, acc, new, norm, norms)

    def accumulate(params: Any, inner: Any, acc: Any, wrote: Any) -> Any:
      acc = self._mean(state, acc, unscaled(), should_apply)
      out = output(params, None, should_apply)
      return out, _Written(inner, acc, wrote, norm, none)

    def apply(params: Any, inner: Any, acc: Any, wrote: Any) -> Any:
      g, stepped_norm = unscaled(), norm
      if accumulating:  # the window's mean, clipped, and its norm
        g, stepped_norm = self._clipped_mean(state, acc, g, should_apply)
        acc = optax.tree.zeros_like(acc)
      trained = without_overwritten(step.overwritten, params)
      updates, inner = update(g, inner, trained)
      out = output(params, updates, should_apply)
      stepped_norm = stepped_norm.astype(jnp.float32)
      return out, _Written(inner, acc, wrote, stepped_norm, none)

    return [skip, accumulate, apply] if accumulating else [skip, apply]

  def _spike_norms(
    self,
    step: _Step,
    acc: Any,
    kept: jax.Array,
    spike: _spikes.Spike,
    factor: jax.Array,
    twos: Any,
  ) -> jax.Array:
    """On a spike, each leaf's norm of the unscaled gradients (under
    accumulation, of the window's mean with them if `kept`); zeros
    otherwise, and without the rule. Read in the skip branch only."""
    none = jnp.zeros_like(step.state.last_skip.leaf_norms)
    if self.spike_sigmas is None:
      return none
    g = _unscaled(step, factor, twos)
    if self.gradient_accumulation_steps > 1:
      g = self._mean(step.state, acc, g, kept)
    norms = self._leaf_norms(g)[: none.shape[-1]]
    return jnp.where(spike.found, norms, none)

  def _clipped_mean(
    self, state: State, acc: Any, g: Any, kept: jax.Array
  ) -> tuple[Any, jax.Array]:
    """The window's mean with `g` if `kept`, clipped by its global norm, and
    that norm."""
    mean = self._mean(state, acc, g, kept)
    norm = self._norm(leaves(mean))
    flags = _numerics.finite_flags(leaves(mean))
    finite = jnp.all(_numerics.agree(flags, self.axis_name))
    return multiply_floats(mean, self._clip(norm, finite)), norm

  def _leaf_norms(self, tree: Any) -> jax.Array:
    """Each leaf's norm, float32: 0 for a None or an overwritten leaf (an
    `optax.MaskedNode`, a leaf here to keep the leaves' positions)."""
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    flat = jax.tree.leaves(tree, is_leaf=lambda x: x is None or masked(x))
    norms = [self._norm([None if masked(x) else x]) for x in flat]
    return jnp.array(norms, jnp.float32).reshape(-1)

  def _norm(self, flat: list[Any]) -> jax.Array:
    """The global norm of the leaves `flat` (None ones left out), summed
    across `axis_name` where they vary."""
    pieces = _numerics.pieces(flat)
    return _numerics.root(_numerics.squares(pieces, self.axis_name)[0])

  def _spike(self, step: _Step, kept: jax.Array) -> tuple[_spikes.Spike, Any]:
    """The spike rule's verdict on this call, and its window after it.

    A step is judged by its norm and loss; under accumulation, a window at
    its end, by its mean gradient's norm and its micro-batches' mean loss.
    `kept` is whether this call's gradients are kept, the rule aside. Off,
    no spike, and the window stays `()`.
    """
    state = step.state
    if self.spike_sigmas is None:
      off = jnp.zeros((2,), jnp.bool_)
      stats = jnp.zeros((2, 4), jnp.float32)
      return _spikes.Spike(found=jnp.array(False), spiked=off, stats=stats), ()
    window, norm = state.spikes, step.attempt.verdict.norm
    given = step.extra_args.get("value")
    loss = jnp.zeros(()) if given is None else jnp.mean(given)
    accumulated, closes = self._open(state)
    count = accumulated + kept.astype(jnp.int32)
    # A window that kept nothing has no losses (whatever a resumed state holds).
    loss_sum = jnp.where(accumulated > 0, window.loss_sum, 0)
    total = loss_sum + jnp.where(kept, loss.astype(jnp.float32), 0)
    loss = total / jnp.maximum(count, 1).astype(jnp.float32)
    if self.gradient_accumulation_steps > 1:  # the window's mean: a read
      g = _unscaled(step, *reciprocal(step.attempt.loss_scale()))
      norm = self._norm(leaves(self._mean(state, state.accumulator, g, kept)))
    value = jnp.stack([norm.astype(jnp.float32), loss])
    # Only finite values: `skip_nonfinite=False` applies the others.
    judged = closes & (count > 0) & jnp.all(jnp.isfinite(value))
    sigmas, loss_given = self.spike_sigmas, given is not None
    spike = _spikes.judge(window, value, judged, sigmas, loss_given)
    window = _spikes.entered(window, value, judged, loss_given)
    return spike, window._replace(loss_sum=jnp.where(closes, 0, total))

  def _clip(self, norm: jax.Array, finite: jax.Array) -> jax.Array:
    """What clips gradients of global `norm` to `max_norm` (1 without it).
    Gradients that are not `finite` (applied with `skip_nonfinite=False`; a
    window's mean that is not) are left as they are: 0 * inf is a NaN."""
    if self.max_norm is None:
      return jnp.ones((), jnp.float32)
    keep = (norm < self.max_norm) | ~finite
    return jnp.where(keep, jnp.ones((), norm.dtype), self.max_norm / norm)

  def _mean(self, state: State, acc: Any, g: Any, kept: jax.Array) -> Any:
    """The window's mean with `g` if it is `kept`: `optax.MultiSteps`'
    running mean, in the accumulator's dtypes."""
    n = (state.accumulated + 1).astype
    first = state.accumulated == 0  # the accumulator may hold a past window

    def add(u: jax.Array | None, a: jax.Array) -> jax.Array:
      if u is None:  # no gradient: nothing to add
        return a
      u = u.astype(a.dtype)
      return jnp.where(kept, jnp.where(first, u, a + (u - a) / n(a.dtype)), a)

    return jax.tree.map(add, g, acc, is_leaf=lambda x: x is None)

  def _inner_update(
    self, step: _Step, given: Any
  ) -> tuple[Callable[[Any, Any, Any], Any], Callable[..., Any]]:
    """A branch's output from `inner`'s updates (None: no update), and
    `inner.update`, traced once.

    The fused step returns the parameters, `update` the updates: zeros
    when skipped, of the shapes `inner` returns. Those shapes need a trace
    of `inner.update`: it is traced once, here, on what it is `given`, and
    replayed in the branch that steps, so that a step traces the user's
    optimizer once. Each overwritten leaf is assigned its gradient where
    `assign` holds.
    """
    overwritten, fused = step.overwritten, step.fused
    update = lambda g, s, p: self.inner.update(g, s, p, **step.extra_args)  # noqa: E731
    trained = without_overwritten(overwritten, step.params)
    operands = (given, step.state.inner_state, trained)
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
        base = optax.apply_updates(
          without_overwritten(overwritten, params), updates
        )
      else:
        base = params

      def pick(o: bool, b: Any, g: Any, p: Any) -> Any:
        new = g.astype(p.dtype) if fused else g.astype(p.dtype) - p
        keep = p if fused else jnp.zeros_like(p)
        return jnp.where(assign, new, keep) if o else b

      if not any(jax.tree.leaves(overwritten)):
        return base
      return jax.tree.map(pick, overwritten, base, step.grads, params)

    return output, update
