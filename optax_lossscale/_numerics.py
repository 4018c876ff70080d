"""Finiteness checks over pytrees of gradients."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

AxisName = Hashable | Sequence[Hashable] | None


def is_float0(x: Any) -> bool:
  return getattr(x, "dtype", None) == jax.dtypes.float0


def zeros_of(shapes: Any) -> Any:
  """Zeros like `shapes` (from `jax.eval_shape`), shardings included."""
  return optax.tree.zeros_like(shapes)


def _is_float(x: Any) -> bool:
  """Whether a leaf is checked: floating point (and complex), not `float0`."""
  return not is_float0(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _is_whole(x: jax.Array) -> bool:
  """Whether `x` is whole on each device and unsharded in its type.

  Such leaves can be reshaped and concatenated freely: nothing moves. Inside
  `shard_map` (Manual axes) every block is whole.
  """
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty:
    return True
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  if any(t == AxisType.Auto and mesh.shape[n] > 1 for n, t in types.items()):
    return False
  return not any(
    n is not None and types[n] == AxisType.Explicit
    for entry in sharding.spec
    for n in (entry if isinstance(entry, tuple) else (entry,))
  )


# float16 is summed in rows of this many elements first.
_ROW = 16


def _zeros_of(x: jax.Array) -> jax.Array:
  """`x - x`: 0 per finite element, NaN otherwise; bfloat16 as float32."""
  if x.dtype == jnp.bfloat16:
    x = x.astype(jnp.float32)
  return x - x


def _float16_rows(zero: jax.Array) -> jax.Array:
  """`zero`'s last axis summed by `_ROW` in float16 (exact), as float32."""
  rows = zero.reshape(*zero.shape[:-1], -1, _ROW)
  sums: jax.Array = lax.reduce(
    rows, np.zeros((), zero.dtype), lax.add, (zero.ndim,)
  )
  return sums.astype(jnp.float32)


def _finite(x: jax.Array) -> jax.Array:
  """True iff every element of a large whole leaf `x` is finite.

  `x` is read as a vector (a free reshape, kept by a barrier from being
  folded back: XLA's CPU backend reduces an array with a trailing axis of 1
  several times slower than the same elements as a vector) and `x - x` is
  summed: exactly 0 per finite element and NaN otherwise (inf - inf,
  NaN - NaN), and IEEE addition propagates NaN, so the sum is exact in any
  order. XLA fuses `x - x` into the sum, where its CPU backend writes out
  the flags of `isfinite` first (a `max`-based check is not safe there:
  large `max` reductions go to a library that drops NaN). bfloat16 widens to
  float32 exactly, in the same fusion; float16's widening is written out in
  full on XLA's CPU backend, so float16 is summed in rows of `_ROW` in its
  own dtype first (exact: every term is 0 or NaN), which leaves 1/16 of it.
  """
  zero = _zeros_of(lax.optimization_barrier(x.ravel()))
  if zero.dtype != jnp.float16:
    return jnp.isfinite(jnp.sum(zero))
  body = zero.size // _ROW * _ROW
  tail = zero[body:].astype(jnp.float32)
  return jnp.isfinite(jnp.sum(_float16_rows(zero[:body])) + jnp.sum(tail))


# Leaves up to this size are stacked (per dtype and similar size, up to
# _CONCAT of them at a time) and each stack is checked by one reduction, a
# row per leaf: a kernel per small leaf costs more to launch than to copy the
# leaf, on every backend, and on XLA's CPU backend each kernel is also
# compiled on its own (`benchmarks/finite_sweep.py`, 400 x (1000,) on a
# 2-core CPU: 0.4x to 0.9x the one-liner read together, 1.3x to 1.8x a kernel
# each). Larger leaves are checked in place: copying them costs more than a
# kernel of their own (400 leaves of 1 to 16,384 elements: 1.4x to 1.9x the
# one-liner with all of them stacked, 0.7x to 1.0x with those over 4,096 in
# place), and so is a leaf that may be split across devices: stacking would
# gather it (Auto axes) or be refused (Explicit axes). One stack of
# thousands of operands compiles slowly: 2000 leaves in groups of 64
# compile in about a third of the time.
_SMALL_LEAF = 2**12
_CONCAT = 64
# A stack's rows are padded to its longest leaf: a leaf joins a stack only if
# it is at most this many times the size of the stack's first (smallest).
_PADDING = 4


def _partition(leaves: list[jax.Array]) -> list[list[int]]:
  """The indices of the leaves read together, group by group.

  A large or sharded leaf is a group of its own; small ones are grouped per
  dtype, in order of size, up to _CONCAT at a time and within a factor of
  _PADDING in size.
  """
  small: dict[Any, list[int]] = {}
  groups = []
  for i, x in enumerate(leaves):
    if x.size <= _SMALL_LEAF and _is_whole(x):
      small.setdefault(x.dtype, []).append(i)
    else:
      groups.append([i])
  for same_dtype in small.values():
    group: list[int] = []
    for i in sorted(same_dtype, key=lambda i: leaves[i].size):
      first = leaves[group[0]].size if group else 0
      if group and (
        len(group) == _CONCAT or leaves[i].size > _PADDING * max(first, 1)
      ):
        groups.append(group)
        group = []
      group.append(i)
    if group:
      groups.append(group)
  return groups


def _in_place(members: list[jax.Array]) -> bool:
  """Whether a group is one large or sharded leaf, read where it is."""
  x = members[0]
  return len(members) == 1 and (x.size > _SMALL_LEAF or not _is_whole(x))


def _rows_finite(members: list[jax.Array]) -> jax.Array:
  """Per small whole leaf of one dtype, whether it is finite: one reduction.

  The leaves, the shorter ones padded with zeros (finite), are concatenated
  into rows of one length, one row each, and each row's `x - x` is summed
  as in `_finite` (float16 in its own dtype by `_ROW` elements first, so
  rows are padded to a multiple of `_ROW`).
  """
  longest = max(x.size for x in members)
  if members[0].dtype == jnp.float16:
    longest = -(-longest // _ROW) * _ROW
  rows = jnp.concatenate(
    [
      jnp.pad(x.ravel(), (0, longest - x.size))
      if x.size < longest
      else x.ravel()
      for x in members
    ]
  ).reshape(len(members), longest)
  zero = _zeros_of(rows)
  if zero.dtype == jnp.float16:
    zero = _float16_rows(zero)
  return jnp.isfinite(jnp.sum(zero, axis=1))


def _local_flags(*leaves: jax.Array) -> jax.Array:
  """Per float leaf, whether it is finite, in leaf order; no collective."""
  pieces: list[tuple[list[int], jax.Array]] = []
  for group in _partition(list(leaves)):
    members = [leaves[i] for i in group]
    if not _in_place(members):
      pieces.append((group, _rows_finite(members)))
    elif _is_whole(members[0]):
      pieces.append((group, _finite(members[0]).reshape(1)))
    else:  # split across devices: XLA reduces it where it lives
      pieces.append((group, jnp.all(jnp.isfinite(members[0])).reshape(1)))
  if not pieces:
    return jnp.ones((0,), jnp.bool_)
  flags = jnp.concatenate([f for _, f in pieces])
  order = [i for group, _ in pieces for i in group]
  if order == sorted(order):
    return flags
  return flags[np.argsort(order)]


def varying_axes(x: Any) -> frozenset[Any]:
  """The `shard_map` axes along which `x` varies (none outside `shard_map`)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10 and later
  vma = getattr(aval, "vma", None) if manual is None else manual.varying
  return frozenset(vma or ())


def explicit_axes(leaves: list[Any]) -> tuple[Any, frozenset[Any]]:
  """The mesh of the leaves' types and the Explicit axes that split them."""
  mesh, axes = None, set()
  for x in leaves:
    sharding = getattr(jax.typeof(x), "sharding", None)
    leaf_mesh = getattr(sharding, "mesh", None)
    if sharding is None or leaf_mesh is None or leaf_mesh.empty:
      continue
    types = dict(zip(leaf_mesh.axis_names, leaf_mesh.axis_types, strict=True))
    for entry in sharding.spec:
      for name in entry if isinstance(entry, tuple) else (entry,):
        if name is not None and types[name] == AxisType.Explicit:
          mesh = leaf_mesh
          axes.add(name)
  return mesh, frozenset(axes)


def _float_flags(leaves: list[jax.Array]) -> jax.Array:
  """Per float leaf, whether it is finite, for leaves Explicit axes may split.

  Each device checks its own blocks, which are whole there, so that small
  leaves are stacked and checked by a few kernels rather than one each, and
  one collective of the flags combines the devices'. Leaves that no Explicit
  axis splits are checked as they are (XLA reduces a leaf that Auto axes
  split where it lives, and all-reduces the flag).
  """
  mesh, axes = explicit_axes(leaves)
  if not axes:
    return _local_flags(*leaves)

  def local(*blocks: jax.Array) -> jax.Array:
    return agree(_local_flags(*blocks), tuple(sorted(axes, key=str)))

  specs = tuple(jax.typeof(x).sharding.spec for x in leaves)
  checked: jax.Array = jax.shard_map(
    local, mesh=mesh, in_specs=specs, out_specs=P(), axis_names=set(axes)
  )(*leaves)
  return checked


def finite_flags(leaves: list[Any]) -> jax.Array:
  """Per leaf, True iff every element is finite: a bool vector, local.

  Each leaf is read once, where it lives; small leaves are read a stack at a
  time. Leaves that are not floating point (integers, `float0`) are finite.
  No collective combines replicas (see `agree`).
  """
  floats = [i for i, x in enumerate(leaves) if _is_float(x)]
  flags = _float_flags([jnp.asarray(leaves[i]) for i in floats])
  if len(floats) == len(leaves):
    return flags
  # Each other leaf takes a True appended to the flags. Concatenated, not
  # stacked: under `vmap` over a member axis that an Explicit mesh axis
  # shards, `jnp.stack` refuses a batched flag beside an unbatched constant.
  index = np.full(len(leaves), len(floats))
  index[floats] = np.arange(len(floats))
  return jnp.concatenate([flags, jnp.ones((1,), jnp.bool_)])[index]


def agree(flags: jax.Array, axis_name: AxisName) -> jax.Array:
  """`flags` (bools) ANDed across the replicas of `axis_name`.

  One collective, whatever the number of flags: every replica ends with the
  same verdicts.
  """
  if axis_name is None:
    return flags
  agreed: jax.Array = lax.pmin(flags.astype(jnp.int32), axis_name)
  return agreed.astype(jnp.bool_)


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
  floats = [jnp.asarray(x) for x in jax.tree.leaves(tree) if _is_float(x)]
  return agree(jnp.all(_float_flags(floats)), axis_name)
