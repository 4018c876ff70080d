"""The one read of a step's gradients: the verdict, the flags, the norm."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lossscale import _cond, _loss_scale, _numerics, _validation


class Checks(NamedTuple):
  """What a step's read of the gradients found, agreed across replicas.

  `grads_finite`: every gradient is finite once unscaled (exactly).
  `loss_finite`: None when no loss was given.
  `flags`: per gradient leaf, whether it is finite once unscaled.
  `norm`: the global L2 norm of the unscaled gradients (float32).
  """

  grads_finite: jax.Array
  loss_finite: jax.Array | None
  flags: jax.Array
  norm: jax.Array


def masked(mask: Any, tree: Any) -> Any:
  """`tree` with an `optax.MaskedNode` at each overwritten leaf (`tree` as it
  is when none is: `optax.lookahead`'s parameters differ from the mask)."""
  if not any(jax.tree.leaves(mask)):
    return tree
  return jax.tree.map(lambda m, x: optax.MaskedNode() if m else x, mask, tree)


def check(
  call: str,
  loss_scale: _loss_scale.LossScale,
  grads: Any,
  value: Any,
  axis_name: _numerics.AxisName,
  overwritten: Any = None,
) -> Checks:
  """Reads the gradients once: the sum of their squares, then the norm.

  A finite sum means every gradient is finite, and gives the norm. A sum
  that is not finite (an overflow, or squares beyond float32) sends the
  step to a small conditional that checks each leaf exactly. Overwritten
  leaves (`overwritten`, bools per leaf) are checked as they are and are
  not in the norm.
  """
  if value is not None and not _numerics.is_float(value):
    raise TypeError(
      f"`{call}(..., value=...)` must be the loss, a floating-point array,"
      f" got {_validation.describe(value)}."
    )
  leaves, as_is = jax.tree.leaves(grads), jax.tree.leaves(overwritten)
  read = _numerics.pieces(leaves, loss_scale.unscale, as_is)
  # The squares of the gradients as given, the norm unscaled as a scalar: a
  # multiply per element in the reduction made XLA:CPU's reduce 7x to 17x
  # slower on some shapes (`benchmarks/finite_sweep.py`). Finite scaled
  # gradients are finite unscaled only at a scale of at least 1: below it,
  # every step checks each leaf exactly.
  squares = _numerics.squares(read, axis_name)
  scale = loss_scale()
  norm = _numerics.root(squares[0])
  local = [jnp.isfinite(squares[0] + squares[1]) & (scale >= 1)]
  if value is not None:
    local.append(jnp.all(jnp.isfinite(value)))
  agreed = _numerics.agree(jnp.stack(local), axis_name)

  def exact(*arrays: jax.Array) -> jax.Array:
    # The pieces are its operands: large leaves as given, unscaled here (a
    # conditional's operands are buffers), small ones in their stacks.
    again = [p._replace(array=a) for p, a in zip(read, arrays, strict=True)]
    flags = _numerics.flags(again, len(leaves), loss_scale.unscale)
    return _numerics.agree(flags, axis_name)

  fast = lambda *_: jnp.ones((len(leaves),), jnp.bool_)  # noqa: E731

  index = agreed[0].astype(jnp.int32)
  operands = [p.array for p in read]
  flags = _cond.switch(index, [exact, fast], *operands, sharded_like=grads)
  loss_finite = None if value is None else agreed[1]
  return Checks(jnp.all(flags), loss_finite, flags, norm / scale)
