"""Skip reports: what a skipped step tells the host, and the stop rule."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["SkipReport", "log_skip"]

_LOGGER = logging.getLogger("optax_lossscale")


class SkipReport(NamedTuple):
  """What `LossScaleOptimizer(on_skip=...)` is told about a skipped step.

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

  Pass it as `LossScaleOptimizer(..., on_skip=ols.log_skip)`.

  Args:
    report: a `SkipReport`.
  """
  _LOGGER.warning("%s", format_skip(report))


class ConsecutiveSkipsError(RuntimeError):
  """Raised on the host when `max_consecutive_skips` is reached."""


def stop_message(report: SkipReport, limit: int, at_floor: bool) -> str:
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
    f"LossScaleOptimizer: {report.consecutive_skipped_steps} consecutive"
    f" steps skipped (max_consecutive_skips={limit}); training has stopped"
    f" making progress. The loss scale is {report.loss_scale:g}, {floor}."
    f" {loss} Leaves with non-finite gradients: {_leaves(report)}. Likely"
    " fix: check the inputs and the learning rate (a diverging run overflows"
    " at any scale); or lower min_loss_scale; or compute the layers named"
    " above in float32."
  )


class SkipHandler:
  """The host side of a skipped step: calls `on_skip`, applies the stop rule.

  Called through `jax.debug.callback` with NumPy values.
  """

  def __init__(
    self,
    on_skip: Callable[[SkipReport], Any] | None,
    max_consecutive_skips: int | None,
    leaf_names: Sequence[str],
    loss_given: bool,
  ) -> None:
    self.on_skip = on_skip
    self.max_consecutive_skips = max_consecutive_skips
    self.leaf_names = list(leaf_names)
    self.loss_given = loss_given

  def __call__(
    self,
    loss_scale: Any,
    next_loss_scale: Any,
    skipped_steps: Any,
    consecutive_skipped_steps: Any,
    loss_finite: Any,
    at_floor: Any,
    counts: Any,
  ) -> None:
    counts = np.asarray(counts).reshape(-1)[: len(self.leaf_names)]
    report = SkipReport(
      loss_scale=float(loss_scale),
      next_loss_scale=float(next_loss_scale),
      skipped_steps=int(skipped_steps),
      consecutive_skipped_steps=int(consecutive_skipped_steps),
      loss_finite=bool(loss_finite) if self.loss_given else None,
      nonfinite={
        name: int(n)
        for name, n in zip(self.leaf_names, counts, strict=True)
        if n > 0
      },
    )
    if self.on_skip is not None:
      self.on_skip(report)
    limit = self.max_consecutive_skips
    if limit is not None and report.consecutive_skipped_steps >= limit:
      raise ConsecutiveSkipsError(stop_message(report, limit, bool(at_floor)))
