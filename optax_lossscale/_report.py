"""Skip reports and the stop rule, read on the host from the state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from optax_lossscale import _validation
from optax_lossscale._states import (
  SKIP_RECORD_SCALARS,
  LossScaleOptimizerState,
  find_states,
  first_copy,
)

__all__ = [
  "ConsecutiveSkipsError",
  "SkipMonitor",
  "SkipReport",
  "skip_reports",
]

_LOGGER = logging.getLogger("optax_lossscale")


class SkipReport(NamedTuple):
  """A skipped step, as `skip_reports` and `SkipMonitor` read it on the host.

  `str(report)` is its one-line description, as `SkipMonitor` logs it; it
  begins with `member i: ` when the report is of a member of a stacked
  state.

  Attributes:
    loss_scale: the scale of the skipped step.
    next_loss_scale: the scale for the next step.
    skipped_steps: how many steps were skipped in all, this one included.
    consecutive_skipped_steps: how many in a row, this one included.
    loss_finite: whether the loss (`value=`) was finite; None when no loss
      was given.
    nonfinite: the gradient leaves with non-finite unscaled values, by their
      `jax.tree_util.keystr` paths, in the parameters' leaf order. Empty when
      only the loss was non-finite.
    member: in a state stacked over `vmap` members (or `pmap` replicas), the
      index of the member that skipped (over several stacked axes, its
      row-major index: `i * n + j` for element `[i, j]` of an `(m, n)`
      stack); None for an unbatched state.

  Examples:
    >>> import optax_lossscale as ols
    >>> report = ols.SkipReport(1024.0, 512.0, 3, 1, True, ("['w']",))
    >>> print(report)
    skipped step (1 in a row, 3 in all): loss scale 1024 -> 512; loss finite; non-finite gradients: ['w']
    >>> print(report._replace(member=2))
    member 2: skipped step (1 in a row, 3 in all): loss scale 1024 -> 512; loss finite; non-finite gradients: ['w']
  """

  loss_scale: float
  next_loss_scale: float
  skipped_steps: int
  consecutive_skipped_steps: int
  loss_finite: bool | None
  nonfinite: tuple[str, ...]
  member: int | None = None

  def __str__(self) -> str:
    loss = {
      None: "no loss given",
      True: "loss finite",
      False: "loss NON-FINITE",
    }
    member = "" if self.member is None else f"member {self.member}: "
    return (
      f"{member}skipped step ({self.consecutive_skipped_steps} in a row,"
      f" {self.skipped_steps} in all): loss scale {self.loss_scale:g} ->"
      f" {self.next_loss_scale:g}; {loss[self.loss_finite]};"
      f" non-finite gradients: {_leaves(self)}"
    )


def _leaves(report: SkipReport) -> str:
  """The non-finite leaves, or 'none'."""
  return ", ".join(report.nonfinite) or "none"


def _log_skip(report: SkipReport) -> None:
  """`SkipMonitor`'s default `log`: a warning of the `optax_lossscale` logger."""
  _LOGGER.warning("%s", report)


class ConsecutiveSkipsError(RuntimeError):
  """Raised by `SkipMonitor` when `max_consecutive_skips` is reached.

  Its message says what happened and the likely fix.

  Attributes:
    report: the `SkipReport` of the last skipped step of the member with the
      longest streak (None when the state holds no record of it).
  """

  def __init__(self, message: str, report: SkipReport | None = None) -> None:
    super().__init__(message)
    self.report = report


ConsecutiveSkipsError.__module__ = "optax_lossscale"


class _Members(NamedTuple):
  """A state's skip counters and record on the host, one entry per member.

  An unbatched state has one member (`shape` is `()`); a state stacked over
  `vmap` members or `pmap` replicas, over one axis or several, has one per
  element of the stack, in row-major order.
  """

  shape: tuple[int, ...]
  skipped: np.ndarray
  consecutive: np.ndarray
  loss_scale: np.ndarray
  record: dict[str, np.ndarray] | None
  names: tuple[str, ...]


def _flat(x: Any, size: int) -> np.ndarray:
  """A scalar field on the host, one element per member.

  A replicated array of a multi-process run is read from this process's
  copy; a field that is not stacked (a `FixedLossScale`'s static value)
  holds for every member.
  """
  return np.broadcast_to(np.asarray(first_copy(x)).reshape(-1), (size,))


def _read(call: str, opt_state: Any) -> _Members:
  """Reads the one `LossScaleOptimizerState` in `opt_state` on the host."""
  found = find_states(opt_state, (LossScaleOptimizerState,))
  if len(found) != 1:
    raise ValueError(
      f"`{call}(opt_state)` expects exactly one LossScaleOptimizerState in"
      f" the state, found {len(found)}."
    )
  state: LossScaleOptimizerState = found[0]
  skipped = np.asarray(first_copy(state.skipped_steps))
  size = skipped.size
  record: dict[str, np.ndarray] | None = None
  names: tuple[str, ...] = ()
  if state.last_skip is not None:
    record = {
      k: _flat(getattr(state.last_skip, k), size) for k in SKIP_RECORD_SCALARS
    }
    nonfinite = np.asarray(first_copy(state.last_skip.nonfinite))
    record["nonfinite"] = nonfinite.reshape(size, -1)
    names = state.last_skip.names()
  return _Members(
    shape=skipped.shape,
    skipped=skipped.reshape(-1),
    consecutive=_flat(state.consecutive_skipped_steps, size),
    loss_scale=_flat(state.loss_scale(), size),
    record=record,
    names=names,
  )


def _recorded(members: _Members, m: int) -> SkipReport | None:
  """Member `m`'s last skip as its record holds it.

  None before its first skip, and when the record is not of its last skip
  (a state restored from 0.1.0 with a fresh record, or counters reset by
  hand): then the record's count differs from the state's.
  """
  record = members.record
  if record is None:
    return None
  skipped = int(record["skipped_steps"][m])
  if skipped == 0 or skipped != members.skipped[m]:
    return None
  loss_given = bool(record["loss_given"][m])
  flags = record["nonfinite"][m]
  return SkipReport(
    loss_scale=float(record["loss_scale"][m]),
    next_loss_scale=float(record["next_loss_scale"][m]),
    skipped_steps=skipped,
    consecutive_skipped_steps=int(record["consecutive_skipped_steps"][m]),
    loss_finite=bool(record["loss_finite"][m]) if loss_given else None,
    nonfinite=tuple(
      name for name, bad in zip(members.names, flags, strict=True) if bad
    ),
    member=m if members.shape else None,
  )


def _latest(members: _Members, m: int) -> SkipReport | None:
  """Member `m`'s last skip; from the counters alone without its record."""
  report = _recorded(members, m)
  if report is not None or members.skipped[m] == 0:
    return report
  scale = float(members.loss_scale[m])
  return SkipReport(
    loss_scale=scale,
    next_loss_scale=scale,
    skipped_steps=int(members.skipped[m]),
    consecutive_skipped_steps=int(members.consecutive[m]),
    loss_finite=None,
    nonfinite=(),
    member=m if members.shape else None,
  )


_CAUSE = {
  None: "The loss was not given (pass value=loss to tell).",
  True: "The loss was finite: the gradients overflowed.",
  False: "The loss itself was NOT finite: the forward pass failed, and no"
  " loss scale can fix that.",
}


def _stop_message(members: _Members, m: int, limit: int) -> str:
  """The stop rule's message for member `m`: what happened, the likely fix."""
  report = _recorded(members, m)
  now = f"the loss scale is now {members.loss_scale[m]:g}"
  if report is None or members.record is None:
    what = f"The state holds no record of the skipped steps; {now}."
  else:
    floor = (
      "at its floor (min_loss_scale), so it could not go lower"
      if members.record["at_floor"][m]
      else "above its floor (min_loss_scale)"
    )
    what = (
      f"The last skipped step ran at loss scale {report.loss_scale:g},"
      f" {floor}; {now}. {_CAUSE[report.loss_finite]} Leaves with"
      f" non-finite gradients: {_leaves(report)}."
    )
  member = f" (member {m})" if members.shape else ""
  return (
    f"LossScaleOptimizer{member}: {members.consecutive[m]} consecutive steps"
    f" skipped (max_consecutive_skips={limit}); training has stopped making"
    f" progress. {what} Likely fix: {_likely_fix(report, members, m)}"
  )


def _likely_fix(report: SkipReport | None, members: _Members, m: int) -> str:
  """The advice for the last skipped step: a failed forward pass, a scale
  at its floor, or one still falling."""
  if report is not None and report.loss_finite is False:
    return (
      "the forward pass produced a non-finite loss, which no loss scale"
      " fixes: check the inputs (NaN or inf in the batch), the learning"
      " rate (a diverging run), and operations computed in float16 that"
      " overflow (softmax, LayerNorm statistics, the loss: compute them in"
      " float32)."
    )
  record = members.record
  if report is not None and record is not None and not record["at_floor"][m]:
    return (
      "the scale was still falling: if the streak is the scale settling,"
      " start from a lower initial_loss_scale or allow more skips; if steps"
      " overflow at every scale, check the inputs and the learning rate (a"
      " diverging run), or compute the layers named above in float32."
    )
  return (
    "check the inputs and the learning rate (a diverging run overflows at"
    " any scale); or lower min_loss_scale; or compute the layers named above"
    " in float32."
  )


def skip_reports(opt_state: Any) -> list[SkipReport]:
  """Returns the last skipped step of each member of an optimizer state.

  Reads, on the host, the `SkipRecord` that `LossScaleOptimizer` keeps in
  its state, wherever the state is nested (`optax.chain`, a linen
  `TrainState`, an `nnx.Optimizer`'s `opt_state`). It waits for the step
  that produced the state: call it at your logging cadence, not every step
  (a `SkipMonitor` does, and remembers what it has logged). An unbatched
  state gives at most one report, its `member` None. A state stacked over
  the members of a `vmap` ensemble (or over `pmap` replicas, which agree:
  each is a member), over one axis or several, gives one report per member
  that has skipped, in member order, each naming its `member`.

  Args:
    opt_state: an optimizer state holding one `LossScaleOptimizerState`,
      stacked or not.

  Returns:
    A list of `SkipReport`, one per member that has skipped; empty before
    any member skipped (and for a state restored from a checkpoint written
    before records existed).

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
    skipped step (1 in a row, 1 in all): loss scale 32768 -> 16384; no loss given; non-finite gradients: ['w']

    A `vmap` ensemble:

    >>> params = {"w": jnp.zeros((3, 2))}  # three members
    >>> state = jax.vmap(tx.init)(params)
    >>> ols.skip_reports(state)
    []
    >>> grads = {"w": jnp.array([[1.0, 1.0], [jnp.nan, 1.0], [1.0, jnp.inf]])}
    >>> _, state = jax.vmap(tx.update)(grads, state, params)
    >>> for report in ols.skip_reports(state):
    ...   print(report)
    member 1: skipped step (1 in a row, 1 in all): loss scale 32768 -> 16384; no loss given; non-finite gradients: ['w']
    member 2: skipped step (1 in a row, 1 in all): loss scale 32768 -> 16384; no loss given; non-finite gradients: ['w']
  """
  members = _read("skip_reports", opt_state)
  reports = (_recorded(members, m) for m in range(members.skipped.size))
  return [report for report in reports if report is not None]


class SkipMonitor:
  """Logs skipped steps and applies the stop rule, at the host's cadence.

  Call it with the optimizer state wherever you log (Megatron-LM logs its
  skipped iterations once per log interval the same way). It reads the
  state's counters on the host, which waits for the step that produced
  them; nothing runs inside the compiled step, so the step keeps JAX's
  fast dispatch, and every process of a multi-process run, holding the
  same replicated counters, logs and raises alike.

  A state stacked over the members of a `vmap` ensemble is watched member by
  member: each member's new skip is logged once, naming the member, however
  the members skip together or apart. A `pmap`-stacked state is watched the
  same way, each replica a member; pass one replica
  (`jax.tree.map(lambda x: x[0], opt_state)`) to log replicas that agree
  once.

  The trade: the stop rule fires at the first call after the limit is
  reached, not inside the step. Skipped steps write nothing, so the steps
  run meanwhile change no parameter and no optimizer moment; they only
  lower the loss scale further (down to `min_loss_scale`).

  Args:
    max_consecutive_skips: raise `ConsecutiveSkipsError` when the state's
      `consecutive_skipped_steps` has reached this (in any member); None
      never raises.
    log: called with the last `SkipReport` of each member that skipped
      since the previous call (once per report); by default, a warning of
      the `optax_lossscale` logger with `str(report)`; None logs nothing.

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
    >>> print(monitor(state))  # nothing skipped since the last call
    None
    >>> _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    >>> monitor(state)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    optax_lossscale.ConsecutiveSkipsError: LossScaleOptimizer: 2 consecutive steps skipped (max_consecutive_skips=2); ...

    An ensemble, logged member by member:

    >>> import jax
    >>> monitor = ols.SkipMonitor(log=print)
    >>> params = {"w": jnp.zeros((2, 2))}  # two members
    >>> state = jax.vmap(tx.init)(params)
    >>> grads = {"w": jnp.array([[jnp.nan, 1.0], [jnp.inf, 1.0]])}
    >>> _, state = jax.vmap(tx.update)(grads, state, params)
    >>> monitor(state).member  # the member with the longest streak
    member 0: skipped step (1 in a row, 1 in all): loss scale 32768 -> 16384; no loss given; non-finite gradients: ['w']
    member 1: skipped step (1 in a row, 1 in all): loss scale 32768 -> 16384; no loss given; non-finite gradients: ['w']
    0
  """

  def __init__(
    self,
    *,
    max_consecutive_skips: int | None = None,
    log: Callable[[SkipReport], Any] | None = _log_skip,
  ) -> None:
    call = "SkipMonitor"
    if max_consecutive_skips is not None:
      _validation.integer(
        call, "max_consecutive_skips", max_consecutive_skips, minimum=1
      )
    if log is not None and not callable(log):
      raise TypeError(
        f"`{call}(log=...)` must be a callable or None, got"
        f" {type(log).__name__} {log!r:.80}."
      )
    self.max_consecutive_skips = max_consecutive_skips
    self.log = log
    self._seen: np.ndarray | None = None

  def __repr__(self) -> str:
    return (
      f"SkipMonitor(max_consecutive_skips={self.max_consecutive_skips!r},"
      f" log={self.log!r})"
    )

  def __call__(self, opt_state: Any) -> SkipReport | None:
    """Reads the state; logs and returns the new skips, or raises.

    Args:
      opt_state: an optimizer state holding one `LossScaleOptimizerState`,
        unbatched or stacked over members (`vmap`, `pmap`).

    Returns:
      The last `SkipReport` if steps were skipped since the previous call
      (or, on the first call, ever), else None. For a stacked state, that of
      the member with the longest current streak among those that skipped
      (the lowest index among equals); `log` gets each of them.

    Raises:
      ConsecutiveSkipsError: if the state's `consecutive_skipped_steps` has
        reached `max_consecutive_skips` (in any member; the message names
        the one with the longest streak). Its message names the count, the
        scale of the last skipped step and whether it sat at its floor, the
        scale now, whether the loss was finite, the leaves with non-finite
        gradients and the likely fix.
      ValueError: if the state holds no `LossScaleOptimizerState`, or
        several.
    """
    members = _read("SkipMonitor", opt_state)
    skipped = members.skipped.reshape(members.shape)
    seen = self._seen
    if seen is None or seen.shape != skipped.shape:
      seen = np.zeros_like(skipped)
    # Each member apart; a count that went down (a restored checkpoint) is
    # news too.
    new = np.flatnonzero(skipped != seen)
    self._seen = skipped.copy()
    latest = [(int(m), _latest(members, int(m))) for m in new]
    reports = [(m, report) for m, report in latest if report is not None]
    if self.log is not None:
      for _, report in reports:
        self.log(report)
    limit = self.max_consecutive_skips
    worst = int(np.argmax(members.consecutive))
    if limit is not None and members.consecutive[worst] >= limit:
      raise ConsecutiveSkipsError(
        _stop_message(members, worst, limit), _latest(members, worst)
      )
    if not reports:
      return None
    _, report = max(reports, key=lambda pair: members.consecutive[pair[0]])
    return report
