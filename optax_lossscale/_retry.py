"""Recomputing an overflowed batch at a lower loss scale, in one step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_lossscale import _numerics
from optax_lossscale._loss_scale import LossScale

__all__: list[str] = []


class Found(NamedTuple):
  """One attempt of a retry loop; `retries`: the retries made before it.

  `checks`: what `verdicts` found, with `grads_finite` and `loss_finite`.
  """

  value: Any
  grads: Any
  loss_scale: LossScale
  checks: Any
  retries: jax.Array


def _can_lower(loss_scale: LossScale) -> jax.Array:
  lowered = loss_scale.lowered()
  assert lowered is not None
  return lowered() < loss_scale()


def retry(
  attempt: Callable[[LossScale, Any], tuple[Any, Any]],
  verdicts: Callable[[LossScale, Any, Any], Any],
  finish: Callable[[Found, jax.Array, Any], Any],
  loss_scale: LossScale,
  max_retries: int,
  operand: Any,
) -> tuple[Any, Any]:
  """Runs `attempt` until its gradients are finite, lowering the scale.

  `attempt(loss_scale, operand)` returns `(value, grads)`;
  `verdicts(loss_scale, value, grads)` returns what the check found (its
  `grads_finite` and `loss_finite`, bool scalars), agreed across replicas,
  so that every replica runs the same number of attempts and collectives
  inside `attempt` cannot deadlock. A retry happens
  when the gradients are not finite, the loss is, fewer than `max_retries`
  retries were made and `loss_scale.lowered()` is lower.

  `finish(found, again, operand)` runs in every iteration and returns the new
  operand (the update of parameters and state); it must return `operand`
  unchanged when `again` (a retry follows). The update thus runs inside the
  loop's last iteration: the gradients stay temporaries of one iteration and
  are never carried. `finish` folds `again` into its own `lax.cond`: a
  conditional around it, nested in the loop, would make XLA copy the
  operand.

  `attempt` is traced once and runs inside a `lax.while_loop`: one pass when
  nothing overflows.

  Returns:
    `(value, new_operand)`: the last attempt's value and `finish`'s result.
  """
  # One trace of the user's function, replayed as the loop's body.
  converted, consts = jax.closure_convert(attempt, loss_scale, operand)

  def run(ls: LossScale, operand: Any) -> tuple[Any, Any]:
    result: tuple[Any, Any] = converted(ls, operand, *consts)
    return result

  value_shapes = jax.eval_shape(run, loss_scale, operand)[0]
  placeholder = _numerics.zeros_of(value_shapes)

  def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
    attempts, _, ls, _, operand = carry
    value, grads = run(ls, operand)
    checks = verdicts(ls, value, grads)
    again = (
      checks.loss_finite
      & ~checks.grads_finite
      & (attempts < max_retries)
      & _can_lower(ls)
    )
    found = Found(value, grads, ls, checks, attempts)
    operand = finish(found, again, operand)
    lowered = optax.tree.where(again, ls.lowered(), ls)
    return attempts + 1, again, lowered, value, operand

  init = (
    jnp.zeros((), jnp.int32),
    jnp.array(True),
    loss_scale,
    placeholder,
    operand,
  )
  *_, value, operand = lax.while_loop(lambda carry: carry[1], body, init)
  return value, operand
