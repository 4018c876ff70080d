"""Skip reports and the stop rule, read on the host from the state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from optax_lossscale import _validation
from optax_lossscale._states import (
  LossScaleOptimizerState,
  SkipRecord,
  find_states,
  first_copy,
)

__all__ = [
  "ConsecutiveSkipsError",
  "SkipMonitor",
  "SkipReport",
  "format_skip",
  "log_skip",
  "skip_report",
]

_LOGGER = logging.getLogger("optax_lossscale")


class SkipReport(NamedTuple):
  """A skipped step, as `skip_report` and `SkipMonitor` read it on the host.

  Attributes:
    loss_scale: the scale of the skipped step.
    next_loss_scale: the scale for the next step.
    skipped_steps: how many steps were skipped in all, this one included.
    consecutive_skipped_steps: how many in a row, this one included.
    loss_finite: whether the loss (`value=`) was finite; None when no loss
      was given.
    nonfinite: for each gradient leaf with non-finite unscaled values, its
      `jax.tree_util.keystr` path and how many such values it has. Empty when
      only the loss was non-finite.

  Examples:
    >>> import optax_lossscale as ols
    >>> report = ols.SkipReport(1024.0, 512.0, 3, 1, True, {"['w']": 2})
    >>> print(ols.format_skip(report))
    skipped step (1 in a row, 3 in all): loss scale 1024 -> 512; loss finite; non-finite gradients: ['w'] (2)
  """

  loss_scale: float
  next_loss_scale: float
  skipped_steps: int
  consecutive_skipped_steps: int
  loss_finite: bool | None
  nonfinite: dict[str, int]


def format_skip(report: SkipReport) -> str:
  """Returns a one-line description of a skipped step.

  Args:
    report: a `SkipReport`.

  Returns:
    A string, as `log_skip` logs it.
  """
  loss = {None: "no loss given", True: "loss finite", False: "loss NON-FINITE"}
  return (
    f"skipped step ({report.consecutive_skipped_steps} in a row,"
    f" {report.skipped_steps} in all): loss scale {report.loss_scale:g} ->"
    f" {report.next_loss_scale:g}; {loss[report.loss_finite]};"
    f" non-finite gradients: {_leaves(report)}"
  )


def _leaves(report: SkipReport) -> str:
  """The non-finite leaves and their counts, or 'none'."""
  listed = ", ".join(f"{k} ({v})" for k, v in report.nonfinite.items())
  return listed or "none"


def log_skip(report: SkipReport) -> None:
  """Logs a skipped step as a warning of the `optax_lossscale` logger.

  `SkipMonitor`'s default `log`.

  Args:
    report: a `SkipReport`.
  """
  _LOGGER.warning("%s", format_skip(report))


class ConsecutiveSkipsError(RuntimeError):
  """Raised by `SkipMonitor` when `max_consecutive_skips` is reached."""


ConsecutiveSkipsError.__module__ = "optax_lossscale"


def stop_message(
  report: SkipReport, limit: int, at_floor: bool, member: str = ""
) -> str:
  """The stop rule's message: what happened and the likely fix."""
  floor = (
    "at its floor (min_loss_scale): it cannot go lower"
    if at_floor
    else "above its floor (min_loss_scale)"
  )
  loss = {
    None: "The loss was not given (pass value=loss to tell).",
    True: "The loss was finite: the gradients overflowed.",
    False: "The loss itself was NOT finite: the forward pass failed, and no"
    " loss scale can fix that.",
  }[report.loss_finite]
  return (
    f"LossScaleOptimizer{member}: {report.consecutive_skipped_steps}"
    f" consecutive steps skipped (max_consecutive_skips={limit}); training"
    f" has stopped making progress. The loss scale is {report.loss_scale:g},"
    f" {floor}."
    f" {loss} Leaves with non-finite gradients: {_leaves(report)}. Likely"
    " fix: check the inputs and the learning rate (a diverging run overflows"
    " at any scale); or lower min_loss_scale; or compute the layers named"
    " above in float32."
  )


def _members(x: Any) -> np.ndarray:
  """A stacked scalar field on the host, one element per replica or member.

  A replicated array of a multi-process run is read from this process's
  copy; one that is not stacked has one member.
  """
  return np.asarray(first_copy(x)).reshape(-1)


def _optimizer_state(call: str, opt_state: Any) -> LossScaleOptimizerState:
  found = find_states(opt_state, (LossScaleOptimizerState,))
  if len(found) != 1:
    raise ValueError(
      f"`{call}(opt_state)` expects exactly one LossScaleOptimizerState in"
      f" the state, found {len(found)}."
    )
  state: LossScaleOptimizerState = found[0]
  return state


def _report_of(record: SkipRecord, member: int) -> SkipReport | None:
  """The record of one replica or `vmap` member, or None before a skip."""
  skipped = int(_members(record.skipped_steps)[member])
  if skipped == 0:
    return None
  names = record.names()
  members = _members(record.skipped_steps).size
  counts = np.asarray(first_copy(record.nonfinite)).reshape(members, -1)
  loss_given = bool(_members(record.loss_given)[member])
  return SkipReport(
    loss_scale=float(_members(record.loss_scale)[member]),
    next_loss_scale=float(_members(record.next_loss_scale)[member]),
    skipped_steps=skipped,
    consecutive_skipped_steps=int(
      _members(record.consecutive_skipped_steps)[member]
    ),
    loss_finite=(
      bool(_members(record.loss_finite)[member]) if loss_given else None
    ),
    nonfinite={
      name: int(n)
      for name, n in zip(names, counts[member], strict=True)
      if n > 0
    },
  )


def _agreeing(state: LossScaleOptimizerState) -> bool:
  """Whether the replicas (or members) of a stacked state agree."""
  fields = [state.skipped_steps, state.consecutive_skipped_steps]
  if state.last_skip is not None:
    fields += [state.last_skip.nonfinite, state.last_skip.loss_scale]
  for field in fields:
    values = np.asarray(first_copy(field))
    flat = values.reshape(_members(state.skipped_steps).size, -1)
    if not (flat == flat[:1]).all():
      return False
  return True


def skip_report(opt_state: Any) -> SkipReport | None:
  """Returns the last skipped step recorded in an optimizer state, or None.

  Reads, on the host, the `SkipRecord` that `LossScaleOptimizer` keeps in
  its state, wherever the state is nested (`optax.chain`, a linen
  `TrainState`, an `nnx.Optimizer`'s `opt_state`). It waits for the step
  that produced the state: call it at your logging cadence, not every step.
  A `pmap`-stacked state is read from replica 0 (replicas agree); the
  members of a `vmap` ensemble differ, so pass one member
  (`jax.tree.map(lambda x: x[i], state)`), or use a `SkipMonitor`, which
  watches them all.

  Args:
    opt_state: an optimizer state holding one `LossScaleOptimizerState`.

  Returns:
    A `SkipReport`, or None before the first skip (and for a state restored
    from a checkpoint written before records existed).

  Raises:
    ValueError: if the state holds no `LossScaleOptimizerState`, or several,
      or is stacked over members whose records differ.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> print(ols.skip_report(state))
    None
    >>> _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    >>> print(ols.format_skip(ols.skip_report(state)))
    skipped step (1 in a row, 1 in all): loss scale 32768 -> 16384; no loss given; non-finite gradients: ['w'] (1)
  """
  state = _optimizer_state("skip_report", opt_state)
  if not _agreeing(state):
    raise ValueError(
      "`skip_report(opt_state)`: the state is stacked over"
      f" {_members(state.skipped_steps).size} members whose records differ"
      " (a `vmap` ensemble); pass one member, `jax.tree.map(lambda x: x[i],"
      " opt_state)`, or watch them all with a SkipMonitor."
    )
  record = state.last_skip
  return None if record is None else _report_of(record, 0)


class SkipMonitor:
  """Logs skipped steps and applies the stop rule, at the host's cadence.

  Call it with the optimizer state wherever you log (Megatron-LM logs its
  skipped iterations once per log interval the same way). It reads the
  state's counters on the host, which waits for the step that produced
  them; nothing runs inside the compiled step, so the step keeps JAX's
  fast dispatch, and every process of a multi-process run, holding the
  same replicated counters, logs and raises alike.

  The trade: the stop rule fires at the first call after the limit is
  reached, not inside the step. Skipped steps write nothing, so the steps
  run meanwhile change no parameter and no optimizer moment; they only
  lower the loss scale further (down to `min_loss_scale`).

  Args:
    max_consecutive_skips: raise `ConsecutiveSkipsError` when the state's
      `consecutive_skipped_steps` has reached this; None never raises.
    log: called with the last `SkipReport` when steps were skipped since the
      previous call (once per report); None logs nothing.

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
  """

  def __init__(
    self,
    *,
    max_consecutive_skips: int | None = None,
    log: Callable[[SkipReport], Any] | None = log_skip,
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
    """Reads the state; logs and returns a new skip, or raises.

    Args:
      opt_state: an optimizer state holding one `LossScaleOptimizerState`.
        A state stacked over `pmap` replicas (which agree) is read once; one
        stacked over the members of a `vmap` ensemble is watched member by
        member, and each member's new skip is logged.

    Returns:
      The last `SkipReport` if steps were skipped since the previous call
      (or, on the first call, ever), else None. For an ensemble, that of the
      member with the most consecutive skips among those that skipped.

    Raises:
      ConsecutiveSkipsError: if the state's `consecutive_skipped_steps` has
        reached `max_consecutive_skips` (in any member). Its message names
        the count, the scale and whether it sits at its floor, whether the
        loss was finite, the leaves with non-finite gradients and the likely
        fix.
    """
    state = _optimizer_state("SkipMonitor", opt_state)
    skipped = _members(state.skipped_steps)
    consecutive = _members(state.consecutive_skipped_steps)
    if _agreeing(state):
      skipped, consecutive = skipped[:1], consecutive[:1]
    seen = self._seen
    if seen is None or seen.shape != skipped.shape:
      seen = np.zeros_like(skipped)
    # A count that went down (a restored checkpoint) is news too.
    new = np.flatnonzero(skipped != seen)
    self._seen = skipped.copy()
    reports = {
      int(m): _report_of(state.last_skip, int(m))
      if state.last_skip is not None
      else _counters_only(state, int(m))
      for m in range(skipped.size)
      if m in new or consecutive[m] > 0
    }
    if self.log is not None:
      for m in new:
        report = reports[int(m)]
        if report is not None:
          self.log(report)
    limit = self.max_consecutive_skips
    worst = int(np.argmax(consecutive))
    if limit is not None and consecutive[worst] >= limit:
      report = reports[worst]
      assert report is not None  # it skipped, so its record is written
      at_floor = False
      if state.last_skip is not None:
        at_floor = bool(_members(state.last_skip.at_floor)[worst])
      member = f" (member {worst})" if skipped.size > 1 else ""
      raise ConsecutiveSkipsError(stop_message(report, limit, at_floor, member))
    if not new.size:
      return None
    latest = max(new, key=lambda m: consecutive[m])
    return reports[int(latest)]


def _counters_only(state: LossScaleOptimizerState, member: int) -> SkipReport:
  """What a state without a record (restored from 0.1.0) can tell."""
  scale = float(_members(state.loss_scale())[member])
  return SkipReport(
    loss_scale=scale,
    next_loss_scale=scale,
    skipped_steps=int(_members(state.skipped_steps)[member]),
    consecutive_skipped_steps=int(
      _members(state.consecutive_skipped_steps)[member]
    ),
    loss_finite=None,
    nonfinite={},
  )
