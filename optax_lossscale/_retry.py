"""Recomputing an overflowed batch at lower loss scales, in one step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_lossscale import _cond
from optax_lossscale._loss_scale import LossScale


class Attempt(NamedTuple):
  """One attempt of the retry loop, as the step that applies it reads it.

  `loss_scale` is the scale it ran at, `verdict` what the read found;
  `retries` counts the attempts before it (int32); `held` is whether
  another attempt follows, so that this one must write nothing (bool). A
  step outside the retry loop is a first attempt that nothing follows.
  """

  loss_scale: LossScale
  verdict: Any
  retries: jax.Array
  held: jax.Array


def retry(
  call: str,
  attempt: Callable[[LossScale, Any], tuple[Any, Any]],
  check: Callable[[LossScale, Any, Any], Any],
  finish: Callable[[Any, Any, Attempt, Any], Any],
  loss_scale: LossScale,
  max_retries: int,
  operand: Any,
) -> tuple[Any, Any]:
  """Runs `attempt` until its gradients are finite, lowering the scale.

  `attempt(loss_scale, operand)` returns `(value, grads)`. Another attempt
  follows when the gradients are not finite, the loss is, fewer than
  `max_retries` retries were made and `loss_scale.lowered()` is lower; the
  replicas agree on it (`check` agrees), so collectives in `attempt` cannot
  deadlock. `finish(value, grads, attempt, operand)` runs in every iteration
  and returns
  the new operand (the parameters and state), unchanged when `held`: the
  update runs in the last iteration, and the gradients are never carried.
  Under `vmap` the step's `cond` is a select, so the update then runs, and
  is discarded, in every attempt of every member.

  Returns:
    `(value, new_operand)`: the last attempt's value and `finish`'s result.

  Raises:
    ValueError: if `loss_scale` cannot be lowered, naming `call`.
  """
  if loss_scale.lowered() is None:
    raise ValueError(
      f"`{call}(max_retries=...)` must be 0 with a {type(loss_scale).__name__}"
      f" (it cannot be lowered), got {max_retries}."
    )
  # One trace of the user's function, which the loop replays; it gives the
  # value's shapes for the loop's carry.
  replay, consts, (value_like, _) = _cond.hoist(attempt, (loss_scale, operand))

  def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
    retries, _, ls, _, operand = carry
    value, grads = replay(consts, ls, operand)
    verdict = check(ls, value, grads)
    lowered = ls.lowered()
    overflowed = verdict.loss_finite & ~verdict.grads_finite
    again = overflowed & (retries < max_retries) & (lowered() < ls())
    attempt = Attempt(ls, verdict, retries, again)
    operand = finish(value, grads, attempt, operand)
    ls = optax.tree.where(again, lowered, ls)
    return retries + 1, again, ls, value, operand

  placeholder = optax.tree.zeros_like(value_like)
  start = (jnp.int32(0), jnp.array(True), loss_scale, placeholder, operand)
  *_, value, operand = lax.while_loop(lambda carry: carry[1], body, start)
  return value, operand
