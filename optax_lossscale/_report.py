"""Skip reports and the stop rule, read on the host from the state."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from optax_lossscale import _states, _validation

__all__ = ["ConsecutiveSkipsError", "SkipMonitor", "SkipReport", "skip_reports"]

_LOSS = {None: "no loss given", True: "loss finite", False: "loss NON-FINITE"}


class SkipReport(NamedTuple):
  """A skipped step, as `skip_reports` and `SkipMonitor` read it on the host.

  `str(report)` is the line `SkipMonitor` logs.

  Attributes:
    step: the skipped step's number: how many steps came before it, so the
      first step is 0, as in a Python loop (the numbering of
      `state.steps`).
    loss_scale: the scale of the skipped step.
    next_loss_scale: the scale for the next step.
    skipped_steps: how many steps were skipped in all.
    consecutive_skipped_steps: how many in a row, this one included.
    loss_finite: whether the loss (`value=`) was finite; None if not given.
    nonfinite: the names of the gradient leaves with non-finite values (all
      of them; the text names the first three and counts the others).
    member: the member's index in a state stacked over `vmap` members or
      `pmap` replicas (row-major over several axes); None if unbatched.
    reason: why it was skipped, the first that holds of `"non-finite
      loss"`, `"overflow"` (non-finite gradients), `"spike"` (the spike
      rule; under accumulation a window that spiked may also end on an
      overflowed micro-batch: the text then gives both), or `"kept by the
      loss scale"` (no check failed: a custom loss scale's answer).
    spike: on a spike, per spiking quantity (`"grad_norm"`, `"loss"`), the
      step's value, the window's mean and standard deviation, and the
      threshold; empty otherwise.
    largest: on a spike, the names of the leaves with the largest gradient
      norms, largest first (at most three); empty otherwise.
    optimizer_step: the skipped step's number in optimizer steps (under
      accumulation, its window's, which may still have stepped on the
      micro-batches it kept: `skipped_optimizer_steps` counts those that
      did not); None where a report is built by hand.
    skipped_optimizer_steps: how many optimizer steps did not happen in
      all (Megatron-LM's skipped iterations); None likewise.

  Examples:
    >>> import optax_lossscale as ols
    >>> print(ols.SkipReport(7, 1024.0, 512.0, 3, 1, True, ("['w']",)))
    skipped step 7 (1 in a row, 3 in all): loss scale 1024 -> 512; loss finite; non-finite gradients: ['w']
  """

  step: int
  loss_scale: float
  next_loss_scale: float
  skipped_steps: int
  consecutive_skipped_steps: int
  loss_finite: bool | None
  nonfinite: tuple[str, ...]
  member: int | None = None
  reason: str = "overflow"
  spike: tuple[tuple[str, float, float, float, float], ...] = ()
  largest: tuple[str, ...] = ()
  optimizer_step: int | None = None
  skipped_optimizer_steps: int | None = None

  def __str__(self) -> str:
    member = "" if self.member is None else f"member {self.member}: "
    of = f" (of optimizer step {self.optimizer_step})"
    optimizer = "" if self.optimizer_step in (None, self.step) else of
    cause = f"non-finite gradients: {_listed(self.nonfinite)}"
    if self.spike:  # under accumulation, beside an overflowed last one
      spikes = "; ".join(
        f"{name} {x:.4g} > {bound:.4g} (window mean {mean:.4g}, std {std:.4g})"
        for name, x, mean, std, bound in self.spike
      )
      spiked = f"spike: {spikes}; largest gradients: {_listed(self.largest)}"
      cause = spiked if self.reason == "spike" else f"{cause}; {spiked}"
    return (
      f"{member}skipped step {self.step}{optimizer}"
      f" ({self.consecutive_skipped_steps} in a row, {self.skipped_steps} in"
      f" all): loss scale {self.loss_scale:g} -> {self.next_loss_scale:g};"
      f" {_LOSS[self.loss_finite]}; {cause}"
    )


def _listed(names: Sequence[str], first: int = 3) -> str:
  """`names` joined, or the first few and how many more."""
  if len(names) <= first + 1:
    return ", ".join(names) or "none"
  shown = ", ".join(names[:first])
  return f"{len(names)} leaves: {shown}, ... and {len(names) - first} more"


class ConsecutiveSkipsError(RuntimeError):
  """Raised by `SkipMonitor` when `max_consecutive_skips` is reached.

  Its message says what happened and the likely fix.

  Attributes:
    report: the `SkipReport` of the member with the longest streak, or None
      if the state holds no record of its skips.
  """

  def __init__(self, message: str, report: SkipReport | None = None) -> None:
    super().__init__(message)
    self.report = report


ConsecutiveSkipsError.__module__ = "optax_lossscale"


def _on_host(call: str, opt_state: Any) -> tuple[Any, bool]:
  """The one `LossScaleOptimizerState` in `opt_state`, read on the host: its
  leaves one row per member, its loss scale the scale, no inner state or
  accumulator; and whether it is stacked over members."""
  types = (_states.LossScaleOptimizerState,)
  state = _states.find_one(f"`{call}(opt_state)`", opt_state, types)
  own = state._replace(inner_state=None, accumulator=())
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(own)):
    raise TypeError(
      f"`{call}(opt_state)` reads the state on the host, between steps: call"
      " it outside `jit`, `vmap` and `scan`, on the state a step returned."
    )
  # The leaves end at a MultiSteps state: one inside it is not among them.
  stop = lambda x: isinstance(x, (optax.MultiStepsState, *types))  # noqa: E731
  outer = jax.tree.leaves(opt_state, is_leaf=stop)
  if not any(isinstance(x, types) for x in outer):
    raise ValueError(
      f"`{call}(opt_state)`: the LossScaleOptimizer is inside an"
      " `optax.MultiSteps`, whose reset multiplies an overflowed micro-batch's"
      " inf by zero: every later step skips on the NaN. Accumulate with"
      " `LossScaleOptimizer(..., gradient_accumulation_steps=k)`."
    )
  skipped = np.asarray(_states.first_copy(state.skipped_steps))

  def rows(x: Any) -> np.ndarray:
    x = np.asarray(_states.first_copy(x))  # a fixed scale is shared: repeated
    return np.resize(x, (skipped.size, *x.shape[skipped.ndim :]))

  host = own._replace(loss_scale=state.loss_scale())
  # An NNX optimizer's state wraps each array in a variable: read it whole.
  array = lambda x: hasattr(x, "__array__")  # noqa: E731
  return jax.tree.map(rows, host, is_leaf=array), bool(skipped.ndim)


def _flagged(items: Sequence[Any], flags: np.ndarray) -> tuple[Any, ...]:
  """The items whose flag is set."""
  return tuple(x for x, on in zip(items, flags, strict=True) if on)


def _reason(record: Any, m: int) -> str:
  """Why member `m`'s recorded step was skipped."""
  if record.loss_given[m] and not record.loss_finite[m]:
    return "non-finite loss"
  if record.nonfinite[m].any():
    return "overflow"
  return "spike" if record.spiked[m].any() else "kept by the loss scale"


def _report(state: Any, m: int, batched: bool) -> SkipReport | None:
  """Member `m`'s last skip, or None if its record holds none."""
  record = state.last_skip
  if record.consecutive_skipped_steps[m] == 0:
    return None
  names, norms = record.names(), record.leaf_norms[m]
  order = np.argsort(-norms, kind="stable")[:3]
  stats = record.spike_stats[m].tolist()  # value, mean, std, threshold
  spikes = [("grad_norm", *stats[0]), ("loss", *stats[1])]
  return SkipReport(
    step=int(record.step[m]),
    loss_scale=float(record.loss_scale[m]),
    next_loss_scale=float(record.next_loss_scale[m]),
    skipped_steps=int(state.skipped_steps[m]),
    consecutive_skipped_steps=int(record.consecutive_skipped_steps[m]),
    loss_finite=bool(record.loss_finite[m]) if record.loss_given[m] else None,
    nonfinite=_flagged(names, record.nonfinite[m]),
    member=m if batched else None,
    reason=_reason(record, m),
    spike=_flagged(spikes, record.spiked[m]),
    largest=tuple(names[i] for i in order if norms[i] > 0),
    optimizer_step=int(record.optimizer_step[m]),
    skipped_optimizer_steps=int(state.skipped_optimizer_steps[m]),
  )


# The likely fix, by the reason for the last skip or else by where the scale
# was: at its floor, or falling above it.
_FIXES = {
  "non-finite loss": "the loss itself was not finite, which no loss scale"
  " fixes: check the batch for NaN or inf, the learning rate (a diverging"
  " run), and float16 softmax, LayerNorm statistics or loss (use float32).",
  "spike": "a lasting shift becomes the window's mean within spike_window"
  " steps, so a longer run of spikes is a run that diverges or data that"
  " changed: check the learning rate and the batches, or raise spike_sigmas.",
  "falling": "the scale was still falling: if it is settling, start"
  " from a lower initial_loss_scale or allow more skips; if steps overflow at"
  " every scale, check the inputs and the learning rate, or compute the"
  " layers named above in float32.",
  "floor": "check the inputs and the learning rate (a"
  " diverging run overflows at any scale); or lower min_loss_scale; or"
  " compute the layers named above in float32.",
}


def _write_message(state: Any, ms: list[int], batched: bool) -> str:
  """Which parameters of members `ms` an update made non-finite, and the fix."""
  write = state.last_nonfinite_write
  step = write.step[ms[0]]
  member = f" (members {ms})" if batched else ""
  bad = _flagged(state.last_skip.names(), write.nonfinite[ms[0]])
  return (
    f"LossScaleOptimizer{member}: a skipped step was given non-finite"
    f" parameters: {_listed(bad)}. Step {step} (0-based), the last one"
    " applied, wrote them from finite gradients (or an earlier step, if they"
    " did not reach the loss): float16 parameters or optimizer state (Adam's"
    " `eps`, 1e-8, is 0 in float16), or a learning rate too large. Keep both"
    f" in float32, cast in the forward pass; restart from before step {step}."
  )


def _stop(
  state: Any, m: int, limit: int, batched: bool
) -> tuple[str, SkipReport | None]:
  """The stop rule's message for member `m` (what happened, and the likely
  fix), and its report."""
  report = _report(state, m, batched)
  member = f" (member {m})" if batched else ""
  head = (
    f"LossScaleOptimizer{member}: {state.consecutive_skipped_steps[m]}"
    f" consecutive steps skipped (max_consecutive_skips={limit}); training has"
    f" stopped making progress. The loss scale is now {state.loss_scale[m]:g}."
  )
  if report is None:
    return f"{head} The state holds no record of the skipped steps.", None
  at_floor = state.last_skip.at_floor[m]
  where = "at its floor (min_loss_scale)" if at_floor else "above its floor"
  what = (
    f"ran at loss scale {report.loss_scale:g}, {where}. Leaves with non-finite"
    f" gradients: {_listed(report.nonfinite)}."
  )
  if report.reason == "spike":
    what = f"was a spike: {report}."
  fix = _FIXES.get(report.reason, _FIXES["floor" if at_floor else "falling"])
  return f"{head} The last skipped step {what} Likely fix: {fix}", report


def skip_reports(opt_state: Any) -> list[SkipReport]:
  """Returns the last skipped step of each member of an optimizer state.

  Reads, on the host, the record `LossScaleOptimizer` keeps in its state,
  wherever the state is nested (`optax.chain`, a linen `TrainState`, an
  `nnx.Optimizer`'s `opt_state`). It waits for the step that made the state:
  call it at your logging cadence. An unbatched state gives at most one
  report; a state stacked over `vmap` members (or `pmap` replicas) one per
  member that has skipped, in member order.

  Args:
    opt_state: an optimizer state holding one `LossScaleOptimizerState`.

  Returns:
    A list of `SkipReport`; empty before any skip.

  Raises:
    ValueError: if the state holds no `LossScaleOptimizerState`, or several.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> ols.skip_reports(state)
    []
    >>> _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    >>> print(*ols.skip_reports(state))
    skipped step 0 (1 in a row, 1 in all): loss scale 32768 -> 16384; no loss given; non-finite gradients: ['w']

    A `vmap` ensemble of three members:

    >>> params = {"w": jnp.zeros((3, 2))}
    >>> grads = {"w": jnp.array([[1.0, 1.0], [jnp.nan, 1.0], [1.0, 1.0]])}
    >>> _, state = jax.vmap(tx.update)(grads, jax.vmap(tx.init)(params), params)
    >>> print(*ols.skip_reports(state))
    member 1: skipped step 0 (1 in a row, 1 in all): loss scale 32768 -> 16384; no loss given; non-finite gradients: ['w']
  """
  state, batched = _on_host("skip_reports", opt_state)
  reports = (_report(state, m, batched) for m in range(len(state.steps)))
  return [report for report in reports if report is not None]


def _log_warning(report: SkipReport) -> None:
  """A warning of the `optax_lossscale` logger: `SkipMonitor`'s default."""
  logging.getLogger("optax_lossscale").warning("%s", report)


class SkipMonitor:
  """Logs skipped steps and applies the stop rule, at the host's cadence.

  Call it with the optimizer state wherever you log. It reads the state on
  the host, which waits for the step that made it; nothing runs inside the
  compiled step. Every process of a multi-process run reads the same
  replicated counters, so all log and raise alike. A state stacked over
  `vmap` members (or `pmap` replicas) is watched member by member.

  The stop rule fires at the first call after the limit is reached. The
  steps skipped meanwhile changed no parameter and no optimizer moment.

  It runs on the host, between steps, never inside `jit`. A skip is news
  when its step or its count differs from the last one seen, so a
  checkpoint restored in the same process is watched as a new run is.

  Args:
    max_consecutive_skips: raise `ConsecutiveSkipsError` once the state's
      `consecutive_skipped_steps` reaches this (in any member); None never
      raises.
    log: called with the last `SkipReport` of each member that skipped since
      the previous call; by default a warning of the `optax_lossscale`
      logger; None logs nothing.

  Raises:
    TypeError: if `log` is not callable or None, or `max_consecutive_skips`
      not an int or None.
    ValueError: if `max_consecutive_skips < 1`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> monitor = ols.SkipMonitor(max_consecutive_skips=2, log=None)
    >>> _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    >>> monitor(state).consecutive_skipped_steps
    1
    >>> print(monitor(state))  # nothing new since the last call
    None
    >>> _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    >>> monitor(state)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    optax_lossscale.ConsecutiveSkipsError: LossScaleOptimizer: 2 consecutive steps skipped (max_consecutive_skips=2); ...
  """

  def __init__(
    self,
    *,
    max_consecutive_skips: int | None = None,
    log: Callable[[SkipReport], Any] | None = _log_warning,
  ) -> None:
    if max_consecutive_skips is not None:
      _validation.integer(
        "SkipMonitor", "max_consecutive_skips", max_consecutive_skips, minimum=1
      )
    if log is not None and not callable(log):
      where = "`SkipMonitor(log=...)`"
      raise _validation.must(TypeError, where, "a callable or None", log)
    self.max_consecutive_skips = max_consecutive_skips
    self.log = log
    self._seen = np.zeros(0)  # no member yet

  def __call__(self, opt_state: Any) -> SkipReport | None:
    """Reads the state; logs and returns the new skips, or raises.

    Args:
      opt_state: an optimizer state holding one `LossScaleOptimizerState`.

    Returns:
      The last `SkipReport` if steps were skipped since the previous call
      (of the member with the longest streak), else None.

    Raises:
      FloatingPointError: for a new `last_nonfinite_write`, and at every
        call while every step since its writer has skipped: a skipped step
        was given non-finite parameters, which an applied update wrote (see
        `docs/guides/failure_modes.md`); it names the members, the leaves,
        the step and the fix. A state restored with such a record raises in
        a new monitor, and a run restored in the same process that writes
        it again raises again.
      ConsecutiveSkipsError: if `consecutive_skipped_steps` has reached
        `max_consecutive_skips`; its message names the count, the scales,
        whether the loss was finite, the leaves and the likely fix.
      ValueError: if the state holds no `LossScaleOptimizerState`, or
        several.
    """
    state, batched = _on_host("SkipMonitor", opt_state)
    write, streak = state.last_nonfinite_write, state.consecutive_skipped_steps
    # Per member, the last skip's step and count, and the last write's step,
    # against those last seen (-1 at first, or for another number of
    # members): one that differs is news (a count that went back, in a
    # restored checkpoint, too).
    now = np.stack([state.last_skip.step, state.skipped_steps, write.step], -1)
    changed = now != (self._seen if self._seen.shape == now.shape else -1)
    self._seen = now
    new = np.flatnonzero(changed[:, :2].any(-1)).tolist()
    reports = [r for m in new if (r := _report(state, m, batched)) is not None]
    if self.log is not None:
      for report in reports:
        self.log(report)
    # A write is news, or still the cause: every step since it skipped (a
    # run restored in this process that wrote it again included).
    current = (streak > 0) & (write.step == state.steps - streak - 1)
    wrote = np.flatnonzero((changed[:, 2] | current) & write.nonfinite.any(-1))
    if wrote.size:
      raise FloatingPointError(_write_message(state, wrote.tolist(), batched))
    limit = self.max_consecutive_skips
    worst = int(np.argmax(streak))
    if limit is not None and streak[worst] >= limit:
      raise ConsecutiveSkipsError(*_stop(state, worst, limit, batched))
    return max(reports, key=lambda r: streak[r.member or 0], default=None)
