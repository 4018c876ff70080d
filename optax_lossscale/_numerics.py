"""Finiteness checks over pytrees of gradients."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
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


def array_leaves(tree: Any) -> list[jax.Array]:
  """The leaves that carry numbers: `None` and `float0` leaves are dropped."""
  return [x for x in jax.tree.leaves(tree) if not is_float0(x)]


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
  flat = lax.optimization_barrier(x.ravel())
  if flat.dtype == jnp.bfloat16:
    flat = flat.astype(jnp.float32)
  zero = flat - flat
  if zero.dtype != jnp.float16:
    return jnp.isfinite(jnp.sum(zero))
  body = zero.size // _ROW * _ROW
  rows = lax.reduce(
    zero[:body].reshape(-1, _ROW), np.zeros((), zero.dtype), lax.add, (1,)
  )
  tail = zero[body:].astype(jnp.float32)
  return jnp.isfinite(jnp.sum(rows.astype(jnp.float32)) + jnp.sum(tail))


# Leaves up to this size are concatenated (per dtype, up to _CONCAT of them at
# a time) and each concatenation is checked by one reduction: a kernel per
# small leaf costs more to launch than to copy the leaf, on every backend,
# and on XLA's CPU backend each kernel is also compiled on its own
# (`benchmarks/finite_sweep.py`, 400 x (1000,) on a 2-core CPU: 0.4x to 0.9x
# the one-liner read together, 1.3x to 1.8x a kernel each). Larger leaves
# are checked in place (512 leaves of 32,768 elements: 1.9x the plain Adam
# step when copied, 1.1x in place), and so is a leaf that may be split
# across devices: a concatenation would gather it (Auto axes) or be refused
# (Explicit axes). One concatenation of thousands of operands compiles
# slowly: 2000 leaves in groups of 64 compile in about a third of the time.
_SMALL_LEAF = 2**14
_CONCAT = 64


def _partition(leaves: list[jax.Array]) -> list[list[int]]:
  """The indices of the leaves read together, group by group.

  A large or sharded leaf is a group of its own; small ones are grouped per
  dtype, up to _CONCAT at a time.
  """
  small: dict[Any, list[int]] = {}
  groups = []
  for i, x in enumerate(leaves):
    if x.size <= _SMALL_LEAF and _is_whole(x):
      small.setdefault(x.dtype, []).append(i)
    else:
      groups.append([i])
  for same_dtype in small.values():
    for start in range(0, len(same_dtype), _CONCAT):
      groups.append(same_dtype[start : start + _CONCAT])
  return groups


def _in_place(members: list[jax.Array]) -> bool:
  """Whether a group is one large or sharded leaf, read where it is."""
  x = members[0]
  return len(members) == 1 and (x.size > _SMALL_LEAF or not _is_whole(x))


def _read_together(members: list[jax.Array]) -> jax.Array:
  """A large leaf as it is; small ones as one concatenation."""
  if _in_place(members):
    return members[0]
  return jnp.concatenate([x.ravel() for x in members])


def verdict(leaves: list[jax.Array], axis_name: AxisName) -> jax.Array:
  """True iff every element of every leaf is finite; one read of each leaf."""
  return agree(_sharded_verdict(leaves), axis_name)


def _local_verdict(*leaves: jax.Array) -> jax.Array:
  checks = []
  for group in _partition(list(leaves)):
    members = [leaves[i] for i in group]
    if _in_place(members) and _is_whole(members[0]):
      checks.append(_finite(members[0]))
    else:  # small leaves concatenated, or a leaf split across devices
      checks.append(jnp.all(jnp.isfinite(_read_together(members))))
  return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


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


def _sharded_verdict(leaves: list[jax.Array]) -> jax.Array:
  """The verdict of leaves that Explicit mesh axes may split.

  Each device checks its own blocks, which are whole there, so that small
  leaves are concatenated and checked by a few kernels rather than one
  each, and one scalar collective combines the devices' verdicts. Leaves
  that no Explicit axis splits are checked as they are (XLA reduces a leaf
  that Auto axes split where it lives, and all-reduces the scalar).
  """
  mesh, axes = explicit_axes(leaves)
  if not axes:
    return _local_verdict(*leaves)

  def local(*blocks: jax.Array) -> jax.Array:
    ok = _local_verdict(*blocks).astype(jnp.int32)
    agreed: jax.Array = lax.pmin(ok, tuple(sorted(axes, key=str)))
    return agreed.astype(jnp.bool_)

  specs = tuple(jax.typeof(x).sharding.spec for x in leaves)
  checked: jax.Array = jax.shard_map(
    local, mesh=mesh, in_specs=specs, out_specs=P(), axis_names=set(axes)
  )(*leaves)
  return checked


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
  not a few each. No array constant enters the computation (a `vmap`ped
  `cond` over a sharded member axis refuses them).
  """
  pieces: list[tuple[list[int], jax.Array]] = []
  whole: dict[Any, list[int]] = {}
  for group in _partition(leaves):
    members = [leaves[i] for i in group]
    if not _in_place(members):
      pieces.append((group, _counts_together(members, unscale)))
    elif _is_whole(members[0]):
      # Counted below, with the whole leaves of the same size.
      whole.setdefault((members[0].dtype, members[0].size), []).extend(group)
    else:  # a sharded leaf, counted where it lives (each device its block)
      flags = ~jnp.isfinite(unscale(members[0]))
      pieces.append((group, jnp.sum(flags, dtype=jnp.int32).reshape(1)))
  for same in whole.values():
    for start in range(0, len(same), _CONCAT):
      group = same[start : start + _CONCAT]
      pieces.append(
        (group, _count_in_chunks([leaves[i] for i in group], unscale))
      )
  return _in_leaf_order(pieces, len(leaves))


def _in_leaf_order(
  pieces: list[tuple[list[int], jax.Array]], n: int
) -> jax.Array:
  """The counts of `pieces` (leaf indices, their counts) in leaf order."""
  if not pieces:
    return jnp.zeros((0,), jnp.int32)
  order = [i for indices, _ in pieces for i in indices]
  if order == list(range(n)):  # the usual case: one concatenation
    return jnp.concatenate([counts for _, counts in pieces])
  by_leaf = {
    i: counts[k] for indices, counts in pieces for k, i in enumerate(indices)
  }
  return jnp.stack([by_leaf[i] for i in range(n)])


# Large leaves that are whole on each device are counted in chunks of this
# many elements, all leaves of one size in one loop: XLA's CPU backend writes
# out the flags of a counted array (it fuses no compare into a reduction), so
# counting whole leaves would need buffers of the gradients' size.
_COUNT_CHUNK = 2**11


def _count_in_chunks(
  members: list[jax.Array], unscale: Callable[[jax.Array], jax.Array]
) -> jax.Array:
  """The non-finite counts of whole leaves of one size, chunk by chunk."""
  flats = [x.ravel() for x in members]
  size = flats[0].size
  chunks, tail = divmod(size, _COUNT_CHUNK)

  def count(start: Any, length: int) -> jax.Array:
    pieces = [lax.dynamic_slice_in_dim(f, start, length) for f in flats]
    flags = ~jnp.isfinite(unscale(jnp.stack(pieces)))
    counted: jax.Array = jnp.sum(flags, axis=1, dtype=jnp.int32)
    return counted

  totals = jnp.zeros(len(members), jnp.int32)
  if chunks:
    totals = lax.fori_loop(
      0,
      chunks,
      lambda i, n: n + count(i * _COUNT_CHUNK, _COUNT_CHUNK),
      totals,
    )
  if tail:
    totals += count(chunks * _COUNT_CHUNK, tail)
  return totals


def _counts_together(
  members: list[jax.Array], unscale: Callable[[jax.Array], jax.Array]
) -> jax.Array:
  """The non-finite counts of small whole leaves of one dtype, one reduction.

  The leaves are padded with zeros (finite) to the longest and stacked: one
  kernel counts them all, with a buffer of at most _CONCAT x _SMALL_LEAF
  elements.
  """
  longest = max(x.size for x in members)
  rows = jnp.stack([jnp.pad(x.ravel(), (0, longest - x.size)) for x in members])
  counts: jax.Array = jnp.sum(~jnp.isfinite(unscale(rows)), 1, jnp.int32)
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
