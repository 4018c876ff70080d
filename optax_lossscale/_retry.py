"""Recomputing an overflowed batch at lower loss scales, in one step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_lossscale._loss_scale import LossScale


class Attempt(NamedTuple):
  """The attempt a step applies.

  `checks` is what the check found (`grads_finite`, `loss_finite`, agreed
  across replicas); `retries` how many attempts came before it.
  """

  value: Any
  grads: Any
  loss_scale: LossScale
  checks: Any
  retries: jax.Array | int


def retry(
  call: str,
  attempt: Callable[[LossScale], tuple[Any, Any]],
  check: Callable[[LossScale, Any, Any], Any],
  loss_scale: LossScale,
  max_retries: int,
) -> Attempt:
  """Runs `attempt` until its gradients are finite, lowering the scale.

  `attempt(loss_scale)` returns `(value, grads)`. Another attempt follows
  when the gradients are not finite, the loss is, fewer than `max_retries`
  retries were made and `loss_scale.lowered()` is lower; the replicas agree
  on it (`check` agrees), so collectives in `attempt` cannot deadlock.

  Returns:
    The last attempt, for the step to apply.

  Raises:
    ValueError: if `loss_scale` cannot be lowered, naming `call`.
  """
  if loss_scale.lowered() is None:
    raise ValueError(
      f"`{call}(max_retries=...)` must be 0 with a"
      f" {type(loss_scale).__name__}, which cannot be lowered, got"
      f" {max_retries}."
    )
  # One trace of the user's function: the loop replays it, and the carry's
  # shapes come from the replay, not a second trace.
  converted, consts = jax.closure_convert(attempt, loss_scale)

  def run(ls: LossScale, retries: Any) -> Attempt:
    value, grads = converted(ls, *consts)
    return Attempt(value, grads, ls, check(ls, value, grads), retries)

  def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
    _, ls, last = carry
    found = run(ls, last.retries + 1)
    lowered, checks = ls.lowered(), found.checks
    again = (
      checks.loss_finite
      & ~checks.grads_finite
      & (found.retries < max_retries)
      & (lowered() < ls())
    )
    return again, optax.tree.where(again, lowered, ls), found

  start = jax.eval_shape(run, loss_scale, jnp.int32(-1))
  start = optax.tree.zeros_like(start)._replace(retries=jnp.int32(-1))
  carry = (jnp.array(True), loss_scale, start)
  return lax.while_loop(lambda carry: carry[0], body, carry)[2]  # type: ignore[no-any-return]
