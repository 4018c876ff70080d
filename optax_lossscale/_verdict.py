"""The one read of a step's gradients, and the decision it gives."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lossscale import _cond, _numerics, _validation
from optax_lossscale._loss_scale import LossScale, multiply_floats, reciprocal


class Verdict(NamedTuple):
  """What a step's read of the gradients found, agreed across replicas.

  `grads_finite`: every gradient is finite once unscaled (exactly).
  `loss_finite`: None when no loss was given.
  `flags`: per gradient leaf (None leaves included), whether it is finite
    once unscaled.
  `norm`: the global L2 norm of the unscaled gradients, at least float32:
    inf when one is not finite, or when the norm passes the dtype's range.
  """

  grads_finite: jax.Array
  loss_finite: jax.Array | None
  flags: jax.Array
  norm: jax.Array


def without_overwritten(overwritten: Any, tree: Any) -> Any:
  """`tree` with an `optax.MaskedNode` at each overwritten (FP8) leaf
  (`tree` as it is when none is: `optax.lookahead`'s parameters differ from
  `overwritten`)."""
  if not any(jax.tree.leaves(overwritten)):
    return tree
  drop = lambda o, x: optax.MaskedNode() if o else x  # noqa: E731
  return jax.tree.map(drop, overwritten, tree)


def leaves(tree: Any) -> list[Any]:
  """`tree`'s leaves, None included: a gradient of None is a leaf that
  reports name."""
  return jax.tree.leaves(tree, is_leaf=lambda x: x is None)


def read(
  call: str,
  loss_scale: LossScale,
  grads: Any,
  value: Any,
  axis_name: _numerics.AxisName,
  overwritten: Any = None,
) -> Verdict:
  """Reads the gradients once: the sum of the squares, as given.

  A finite sum at a scale of at least 1 means every gradient is finite,
  and gives the norm. Otherwise (an overflow, squares beyond the dtype's
  range, or a scale below 1, where scaled squares may underflow) a small
  conditional checks each leaf exactly and sums the squares of the
  unscaled gradients: the norm `optax.global_norm` gives them.
  Overwritten leaves (`overwritten`, bools per leaf) are checked as they
  are and are not in the norm.
  """
  if value is not None:
    _check_loss(call, value)
  flat = leaves(grads)
  marks = () if overwritten is None else leaves(overwritten)
  pieces = _numerics.pieces(flat, marks)
  # The squares of the gradients as given, the norm unscaled as a scalar: a
  # multiply per element in the reduction made XLA:CPU's reduce slower on
  # some shapes (`benchmarks/finite_sweep.py`).
  trained, others = _numerics.squares(pieces, axis_name)
  scale = loss_scale()
  local = [jnp.isfinite(trained + others) & (scale >= 1)]
  if value is not None:
    local.append(jnp.all(jnp.isfinite(value)))
  agreed = _numerics.agree(jnp.stack(local), axis_name)

  def exact(inverse: Any, *arrays: jax.Array) -> tuple[jax.Array, jax.Array]:
    # The pieces are its operands: a conditional's operands are buffers.
    again = [p._replace(array=a) for p, a in zip(pieces, arrays, strict=True)]
    return _exact(loss_scale, again, len(flat), axis_name, inverse)

  def fast(*_: Any) -> tuple[jax.Array, jax.Array]:
    norm = _numerics.root(trained) / scale.astype(trained.dtype)
    return jnp.ones((len(flat),), jnp.bool_), norm

  operands = [p.array for p in pieces]
  index = agreed[0].astype(jnp.int32)
  flags, norm = _cond.switch(
    index, [exact, fast], reciprocal(scale), *operands, sharded_like=grads
  )
  loss_finite = None if value is None else agreed[1]
  return Verdict(
    grads_finite=jnp.all(flags), loss_finite=loss_finite, flags=flags, norm=norm
  )


def _check_loss(call: str, value: Any) -> None:
  """Raises unless `value` is a loss: a floating-point scalar, as Optax's
  `value` is."""
  if not _numerics.is_float(value):
    raise TypeError(
      f"`{call}(..., value=...)` must be the loss, a floating-point array,"
      f" got {_validation.describe(value)}."
    )
  if jnp.ndim(value) != 0:
    raise ValueError(
      f"`{call}(..., value=...)` must be the loss, a scalar, got shape"
      f" {jnp.shape(value)}: pass the mean (a loss per example is not one)."
    )


def _exact(
  loss_scale: LossScale,
  pieces: list[_numerics.Piece],
  n: int,
  axis_name: _numerics.AxisName,
  inverse: Any,
) -> tuple[jax.Array, jax.Array]:
  """The exact check's branch: per leaf of `n`, whether it is finite once
  unscaled, and the unscaled gradients' norm.

  Each reduction unscales what it reads: pieces unscaled once, for both,
  are held in memory (tests/test_accelerator_ready.py). The sums unscale
  by the reciprocal computed outside the conditional (`inverse`): XLA
  copies scalar work done inside one into each of its kernels. The flags
  compute their own, once for all pieces: unscaled by `inverse` too,
  XLA:CPU wrote each leaf's unscaled copy for them.
  """
  flags = _numerics.flags(pieces, n, loss_scale.unscale)
  unscale = lambda x: multiply_floats(x, *inverse)  # noqa: E731
  unscaled = _numerics.squares(pieces, axis_name, unscale)[0]
  return _numerics.agree(flags, axis_name), _numerics.root(unscaled)


def decide(
  loss_scale: LossScale, verdict: Verdict, skip_nonfinite: bool
) -> tuple[LossScale, jax.Array]:
  """The next loss scale and whether the step applies.

  A non-finite loss skips the step and keeps the loss scale: no scale fixes
  a forward pass that failed.
  """
  new, should_apply = loss_scale.adjust(verdict.grads_finite)
  if skip_nonfinite:
    should_apply &= verdict.grads_finite
  if verdict.loss_finite is not None:
    should_apply &= verdict.loss_finite
    new = optax.tree.where(verdict.loss_finite, new, loss_scale)
  return new, should_apply
