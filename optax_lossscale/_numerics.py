"""Finiteness checks over pytrees of gradients, and an exact division."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AxisName = Hashable | Sequence[Hashable] | None


def exact_div(x: Any, divisor: Any) -> jax.Array:
  """`x / divisor`, correctly rounded with and without `jit`.

  XLA rewrites a division by a compile-time constant into a multiplication by
  its reciprocal, which differs from IEEE division in the last bit for divisors
  such as 3 or 10. The barrier hides the constant, so the division stays one.
  The operands promote as they do for `/` (the barrier keeps a Python number
  weakly typed).
  """
  hidden = lax.optimization_barrier(jnp.asarray(divisor))
  quotient: jax.Array = jnp.divide(x, hidden)
  return quotient


def is_float0(x: Any) -> bool:
  return getattr(x, "dtype", None) == jax.dtypes.float0


def zeros_of(shapes: Any) -> Any:
  """Zeros shaped like `shapes` (from `jax.eval_shape`); `None` stays."""
  return jax.tree.map(
    lambda s: None if s is None else jnp.zeros(s.shape, s.dtype),
    shapes,
    is_leaf=lambda x: x is None,
  )


def array_leaves(tree: Any) -> list[jax.Array]:
  """The leaves that carry numbers: `None` and `float0` leaves are dropped."""
  return [x for x in jax.tree.leaves(tree) if not is_float0(x)]


def _nonfinite_probe(x: jax.Array) -> jax.Array:
  """A scalar that is NaN iff some element of `x` is NaN or infinite.

  Each element contributes `x - x`: exactly 0 when finite, NaN otherwise
  (inf - inf and NaN - NaN), and IEEE addition propagates NaN, so the sum is
  exact whatever the order. XLA keeps `x - x` as it is for floating point (its
  algebraic simplifier folds `A - A => 0` for integers only) and, on its CPU
  backend, fuses it into the reduction without a temporary buffer
  (`x * 0` is as exact, but is written out first). A `max`-based check is not
  safe: XLA's CPU backend hands large `max` reductions to a library that drops
  NaN.
  """
  zero = x - x
  if zero.dtype in (jnp.float16, jnp.bfloat16):
    return _half_sum(zero)
  # float32 and wider, in their own dtype.
  probe: jax.Array = jnp.sum(zero)
  return probe


# float16 and bfloat16 are summed in rows of this many elements first.
_ROW = 16


def _half_sum(zero: jax.Array) -> jax.Array:
  """The float32 sum of a float16 or bfloat16 array of zeros and NaNs.

  On XLA's CPU backend a half-precision reduction (or a conversion to float32
  feeding one) is written out in full before it is reduced; for bfloat16 the
  conversion is also shared with the unscaling, which is then written out too.
  Summing rows of 16 in the leaf's dtype first (exact here: every term is 0 or
  NaN) fuses with `x - x` and leaves a buffer of 1/16 of the size. Only the
  last axis is split, so a sharded leaf keeps its sharding.
  """
  if zero.ndim and zero.shape[-1] % _ROW == 0:
    return _sum_rows(zero.reshape(*zero.shape[:-1], -1, _ROW))
  if zero.ndim == 1:
    # A vector (or the concatenated small leaves): whole rows, then the tail.
    body = zero.size // _ROW * _ROW
    total = jnp.sum(zero[body:].astype(jnp.float32))
    if body:
      total += _sum_rows(zero[:body].reshape(-1, _ROW))
    return total
  total_: jax.Array = jnp.sum(zero.astype(jnp.float32))
  return total_


def _sum_rows(rows: jax.Array) -> jax.Array:
  """The float32 sum of `rows`, summed along the last axis in their dtype."""
  sums = lax.reduce(rows, np.zeros((), rows.dtype), lax.add, (rows.ndim - 1,))
  total: jax.Array = jnp.sum(sums.astype(jnp.float32))
  return total


# Leaves up to this size are concatenated (per dtype, up to _CONCAT of them at
# a time) and each concatenation is checked by one reduction: on XLA's CPU
# backend every reduction is a separately compiled and launched kernel, so
# hundreds of small leaves would multiply the compile time, and a kernel per
# leaf of a few thousand elements costs more per step than copying it. Larger
# leaves are checked in place: copying them costs more than a kernel of their
# own (512 leaves of 32,768 elements: 1.9x the plain Adam step when copied,
# 1.1x in place). One concatenation of thousands of operands also compiles
# slowly: 2000 leaves in groups of 64 compile in about a third of the time.
_SMALL_LEAF = 2**14
_CONCAT = 64


def _partition(leaves: list[jax.Array]) -> list[list[int]]:
  """The indices of the leaves read together, group by group.

  A large leaf is a group of its own; small ones are grouped per dtype, up to
  _CONCAT at a time.
  """
  small: dict[Any, list[int]] = {}
  groups = []
  for i, x in enumerate(leaves):
    if x.size <= _SMALL_LEAF:
      small.setdefault(x.dtype, []).append(i)
    else:
      groups.append([i])
  for same_dtype in small.values():
    for start in range(0, len(same_dtype), _CONCAT):
      groups.append(same_dtype[start : start + _CONCAT])
  return groups


def _in_place(members: list[jax.Array]) -> bool:
  """Whether a group is one large leaf, read where it is."""
  return len(members) == 1 and members[0].size > _SMALL_LEAF


def _read_together(members: list[jax.Array]) -> jax.Array:
  """A large leaf as it is; small ones as one concatenation."""
  if _in_place(members):
    return members[0]
  return jnp.concatenate([x.ravel() for x in members])


def _group(leaves: list[jax.Array]) -> list[jax.Array]:
  """Large leaves as they are; small ones concatenated per dtype."""
  return [
    _read_together([leaves[i] for i in group]) for group in _partition(leaves)
  ]


def _total(probes: list[jax.Array]) -> jax.Array:
  """The float32 sum of scalar probes: one small kernel for all leaves."""
  real = [
    (jnp.real(p) + jnp.imag(p)) if jnp.iscomplexobj(p) else p for p in probes
  ]
  total: jax.Array = jnp.sum(
    jnp.stack(
      [p.astype(jnp.float32) for p in real] or [jnp.zeros((), jnp.float32)]
    )
  )
  return total


def verdict(leaves: list[jax.Array], axis_name: AxisName) -> jax.Array:
  """True iff every element of every leaf is finite; one read of each leaf."""
  ok = jnp.isfinite(_total([_nonfinite_probe(x) for x in _group(leaves)]))
  return agree(ok, axis_name)


def agree(flags: jax.Array, axis_name: AxisName) -> jax.Array:
  """`flags` (bools) ANDed across the replicas of `axis_name`.

  One collective, whatever the number of flags: every replica ends with the
  same verdicts.
  """
  if axis_name is None:
    return flags
  agreed: jax.Array = lax.pmin(flags.astype(jnp.int32), axis_name)
  return agreed.astype(jnp.bool_)


def nonfinite_counts(
  leaves: list[jax.Array], unscale: Callable[[jax.Array], jax.Array]
) -> jax.Array:
  """How many non-finite elements each leaf has once unscaled: int32s.

  The leaves are read in the groups the check reads them in, and `unscale`
  (an elementwise division, as `LossScale.unscale` is) is applied to each
  group as one array, so that hundreds of small leaves cost a few kernels,
  not a few each.
  """
  per_group, order = [], []
  for group in _partition(leaves):
    members = [leaves[i] for i in group]
    if _in_place(members):
      flags = ~jnp.isfinite(unscale(members[0]))
      per_group.append(jnp.sum(flags, dtype=jnp.int32).reshape(1))
    else:
      per_group.append(_counts_in_rows(members, unscale))
    order += group
  if not per_group:
    return jnp.zeros((0,), jnp.int32)
  return jnp.concatenate(per_group)[np.argsort(order)]


# Small leaves are counted in rows of this many elements.
_COUNT_ROW = 128


def _counts_in_rows(
  members: list[jax.Array], unscale: Callable[[jax.Array], jax.Array]
) -> jax.Array:
  """The non-finite counts of small leaves of one dtype, in a few kernels.

  Each leaf is laid out in whole rows (padded with zeros, which are finite),
  the rows are counted by one reduction, and each leaf's rows are summed by
  a second, masked one over (leaf, row): exact, and with buffers of about
  the size of the leaves.
  """
  rows_of = [-(-x.size // _COUNT_ROW) for x in members]
  parts = []
  for x, n_rows in zip(members, rows_of, strict=True):
    parts.append(x.ravel())
    if n_rows * _COUNT_ROW > x.size:
      parts.append(jnp.zeros(n_rows * _COUNT_ROW - x.size, x.dtype))
  rows = unscale(jnp.concatenate(parts)).reshape(-1, _COUNT_ROW)
  row_counts = jnp.sum(~jnp.isfinite(rows), axis=1, dtype=jnp.int32)
  ends = np.cumsum(rows_of)
  starts = ends - np.asarray(rows_of)
  row = lax.broadcasted_iota(jnp.int32, (len(members), rows.shape[0]), 1)
  mine = (row >= starts[:, None]) & (row < ends[:, None])
  counts: jax.Array = jnp.sum(
    jnp.where(mine, row_counts[None, :], 0), axis=1, dtype=jnp.int32
  )
  return counts


def all_finite(tree: Any, *, axis_name: AxisName = None) -> jax.Array:
  """Returns True when every element of every array leaf of `tree` is finite.

  `None` leaves and `float0` leaves (the gradients `jax.grad(...,
  allow_int=True)` gives integer inputs) are ignored; integer leaves are always
  finite; an empty tree counts as finite. Each leaf is read once, by one
  reduction, and nothing is synchronised with the host.

  Args:
    tree: a pytree of arrays, typically gradients.
    axis_name: the name (or names) of a mapped axis (`pmap`, `shard_map`,
      `vmap`). When given, the verdict is combined across it with one scalar
      collective, so every replica gets the same answer.

  Returns:
    A bool scalar `jax.Array`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> ols.all_finite({"a": jnp.ones(3), "b": None})
    Array(True, dtype=bool)
    >>> ols.all_finite([jnp.array([1.0, jnp.inf])])
    Array(False, dtype=bool)
  """
  leaves = [jnp.asarray(x) for x in array_leaves(tree)]
  floats = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
  return verdict(floats, axis_name)
