"""Recomputing an overflowed batch at a lower loss scale, in one step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_lossscale._loss_scale import LossScale

__all__: list[str] = []


class Found(NamedTuple):
  """The attempt a retry loop ended on."""

  value: Any
  grads: Any
  loss_scale: LossScale
  grads_finite: jax.Array
  loss_finite: jax.Array
  retries: jax.Array


def _where(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _can_lower(loss_scale: LossScale) -> jax.Array:
  lowered = loss_scale.lowered()
  assert lowered is not None
  return lowered() < loss_scale()


def retry(
  attempt: Callable[[LossScale], tuple[Any, Any]],
  loss_scale: LossScale,
  max_retries: int,
  verdicts: Callable[[LossScale, Any, Any], tuple[jax.Array, jax.Array]],
) -> Found:
  """Runs `attempt` until its gradients are finite, lowering the scale.

  `attempt(loss_scale)` returns `(value, grads)`; `verdicts(loss_scale,
  value, grads)` returns `(grads_finite, loss_finite)`, agreed across
  replicas, so that every replica runs the same number of attempts and
  collectives inside `attempt` cannot deadlock. A retry happens when the
  gradients are not finite, the loss is, fewer than `max_retries` retries
  were made and `loss_scale.lowered()` is lower. `attempt` is traced once
  and runs inside a `lax.while_loop`: one pass when nothing overflows.
  """
  # One trace of the user's function, replayed as the loop's body.
  converted, consts = jax.closure_convert(attempt, loss_scale)

  def run(ls: LossScale) -> tuple[Any, Any]:
    result: tuple[Any, Any] = converted(ls, *consts)
    return result

  shapes = jax.eval_shape(run, loss_scale)
  placeholders = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
    attempts, ls = carry[:2]
    ls = _where(attempts > 0, ls.lowered(), ls)
    value, grads = run(ls)
    grads_finite, loss_finite = verdicts(ls, value, grads)
    return attempts + 1, ls, value, grads, grads_finite, loss_finite

  def cond(carry: tuple[Any, ...]) -> jax.Array:
    attempts, ls, _, _, grads_finite, loss_finite = carry
    again = (attempts <= max_retries) & loss_finite & ~grads_finite
    go: jax.Array = (attempts == 0) | (again & _can_lower(ls))
    return go

  init = (
    jnp.zeros((), jnp.int32),
    loss_scale,
    *placeholders,
    jnp.array(False),
    jnp.array(True),
  )
  attempts, ls, value, grads, grads_finite, loss_finite = lax.while_loop(
    cond, body, init
  )
  return Found(value, grads, ls, grads_finite, loss_finite, attempts - 1)
