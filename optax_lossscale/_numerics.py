"""Reductions of pytrees (finiteness, sums of squares), and exact division.

No operation here turns an inf into a NaN (`isfinite`, `all`, sums of
squares), so `jax_debug_nans` and `checkify` stop at the user's NaN.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AxisName = Hashable | Sequence[Hashable] | None

# Leaves of up to _SMALL elements that are whole on each device are read a
# stack at a time, one row per leaf: a reduction per small leaf costs more
# to launch, and on XLA:CPU to compile, than copying the leaf (the first
# compile of 400 leaves, benchmarks/COMPILE.md). A stack holds at most
# _STACK leaves of one dtype and
# `shard_map` type, each at most _PADDING times the size of the smallest,
# which bounds the zero padding. Larger or sharded leaves are read in place.
_SMALL = 2**12
_STACK = 64
_PADDING = 4
# A variadic finiteness reduction takes at most _GROUP leaves: XLA:CPU's
# compile grows faster than linearly in its operands (benchmarks/LLM_STACK.md
# at 400 leaves of one shape).
_GROUP = 8


def is_float(x: Any) -> bool:
  """Whether a leaf is checked: floating point or complex (`float0` is not)."""
  return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def _whole(x: jax.Array) -> bool:
  """Whether `x` is whole on each device: stacking it moves no data.

  Auto axes do not show in a type, so any of them may split `x`; inside
  `shard_map` (Manual axes) every block is whole.
  """
  mesh: Any = getattr(jax.typeof(x).sharding, "mesh", None)
  auto = () if mesh is None else mesh.auto_axes
  return all(mesh.shape[n] == 1 for n in auto) and not explicit_axes([x])


def _stacks(indices: list[int], sizes: list[int]) -> list[list[int]]:
  """Small leaves of one dtype, in order of size, cut into stacks."""
  stacks: list[list[int]] = []
  for i in sorted(indices, key=sizes.__getitem__):
    # A leaf over the limit (the first: no stack yet) or a full stack start one.
    limit = _PADDING * max(sizes[stacks[-1][0]], 1) if stacks else -1
    if sizes[i] > limit or len(stacks[-1]) == _STACK:
      stacks.append([])
    stacks[-1].append(i)
  return stacks


class Piece(NamedTuple):
  """What one reduction reads: a leaf, or a stack of small leaves' rows.

  `overwritten`: its leaves are overwritten (FP8) leaves, read as they are
  and not in the norm.
  """

  array: jax.Array
  leaves: list[int]
  rows: bool
  overwritten: bool


def _rows(vectors: list[jax.Array]) -> jax.Array:
  """The vectors as the rows of a matrix, padded with zeros."""
  longest = max(x.size for x in vectors)
  # `jnp.pad` only where needed: it is a jitted call, one more per leaf.
  pad = lambda x: jnp.pad(x, (0, longest - x.size))  # noqa: E731
  return jnp.stack([pad(x) if x.size < longest else x for x in vectors])


def pieces(
  leaves: Sequence[Any], overwritten: Sequence[bool] = ()
) -> list[Piece]:
  """The float leaves as they are read: in place, or stacked when small.

  None and non-float leaves are in no piece. `overwritten` marks, per leaf,
  the overwritten (FP8) ones, which are stacked apart.
  """
  arrays = [None if x is None else jnp.asarray(x) for x in leaves]
  overwritten = list(overwritten) or [False] * len(arrays)
  out, small = [], {}  # type: list[Piece], dict[Any, list[int]]
  for i, x in enumerate(arrays):
    if x is None or not is_float(x):
      continue
    if x.size <= _SMALL and _whole(x):
      key = (x.dtype, varying_axes(x), overwritten[i])
      small.setdefault(key, []).append(i)
    else:
      out.append(Piece(x, [i], False, overwritten[i]))
  sizes = [0 if x is None else x.size for x in arrays]
  for (*_, marked), same in small.items():
    for stack in _stacks(same, sizes):
      rows = _rows([arrays[i].ravel() for i in stack])  # type: ignore[union-attr]
      out.append(Piece(rows, stack, True, marked))
  return out


def wide(x: jax.Array) -> jax.Array:
  """`x` in at least float32 (half precision is widened exactly)."""
  return x.astype(jnp.float32) if x.dtype.itemsize < 4 else x


def squares(
  read: Sequence[Piece], axis_name: AxisName, unscale: Any = None
) -> tuple[jax.Array, jax.Array]:
  """The sums of the squares of the pieces' elements: of the trained ones,
  and of the overwritten ones.

  One reduction per piece, in at least float32 (float64 for float64 leaves);
  with `unscale`, each trained element is read through it, in that width. A sum is not finite if an element is not, or if it overflows; it
  never makes a NaN of an inf. Inside `shard_map`, the sums of the leaves
  that vary along axes of `axis_name` (their blocks differ) are summed
  across those axes: only scalars cross devices, and replicas count once.
  """
  names = axis_name if isinstance(axis_name, (tuple, list)) else [axis_name]
  bits = [jnp.finfo(p.array.dtype).bits for p in read]
  dtype = jnp.float64 if 64 in bits else jnp.float32
  by_axes: dict[Any, list[jax.Array]] = {}
  for piece in read:
    x = piece.array
    parts = (jnp.real(x), jnp.imag(x)) if jnp.iscomplexobj(x) else (x,)
    sums = []
    for part in map(wide, parts):
      if unscale is not None and not piece.overwritten:
        part = unscale(part)
      sums.append(jnp.sum(jnp.square(part)).astype(dtype))
    key = (varying_axes(x) & frozenset(names), piece.overwritten)
    by_axes.setdefault(key, []).append(sum(sums[1:], sums[0]))
  out = [jnp.zeros((), dtype), jnp.zeros((), dtype)]
  for (axes, overwritten), sums in by_axes.items():
    total = sum(sums[1:], sums[0])
    out[overwritten] += lax.psum(total, tuple(axes)) if axes else total
  return out[0], out[1]


def root(sum_of_squares: jax.Array) -> jax.Array:
  """The norm from a sum of squares: inf, not NaN, when the sum is NaN, so
  that a skipped step's outputs stay free of NaN, which `jax_debug_nans`
  checks under `jit`."""
  return jnp.where(jnp.isnan(sum_of_squares), jnp.inf, jnp.sqrt(sum_of_squares))


def _both(a: Sequence[Any], b: Sequence[Any]) -> tuple[Any, ...]:
  """The AND of two tuples of flags (one function: JAX caches by it)."""
  return tuple(x & y for x, y in zip(a, b, strict=True))


def flags(read: Sequence[Piece], n: int, unscale: Any = None) -> jax.Array:
  """Per leaf of `n`, True iff all it holds is finite: a bool vector, local.

  With `unscale`, trained pieces are read through it. Leaves in no piece
  (None, integers, `float0`) are finite. No collective combines replicas.
  One variadic reduction per group of at most _GROUP pieces of one type: it
  compiles to one kernel, where a reduction per piece compiled to one each
  (the write record and the exact check are in branches that rarely run,
  but every branch is compiled).
  """
  arrays = [p.array for p in read]
  trained = [i for i, p in enumerate(read) if not p.overwritten]
  if unscale is not None and trained:  # one call: its scalars made once
    for i, x in zip(
      trained, unscale([arrays[i] for i in trained]), strict=True
    ):
      arrays[i] = x
  groups: dict[Any, list[int]] = {}
  for i, p in enumerate(read):
    x = p.array
    sharding = getattr(jax.typeof(x), "sharding", None)
    key = (x.shape, x.dtype, p.rows, sharding, varying_axes(x))
    groups.setdefault(key, []).append(i)
  found: list[jax.Array] = []
  order: list[int] = []
  for (shape, _, rows, *_), same in groups.items():
    for at in range(0, len(same), _GROUP):
      group = same[at : at + _GROUP]
      finite = [jnp.isfinite(arrays[i]) for i in group]
      axes = tuple(range(1 if rows else 0, len(shape)))
      reduced = lax.reduce(finite, [True] * len(finite), _both, axes)
      found.extend(r.reshape(-1) for r in jax.tree.leaves(reduced))
      order.extend(leaf for i in group for leaf in read[i].leaves)
  others = sorted(set(range(n)) - set(order))
  if others:
    found.append(jnp.ones((len(others),), jnp.bool_))
    order.extend(others)
  if not found:
    return jnp.ones((0,), jnp.bool_)
  # Concatenated, not stacked: under `vmap` over a member axis that an
  # Explicit mesh axis shards, `jnp.stack` refuses batched flags beside an
  # unbatched constant. Put back in order by static slices, not a gather:
  # its index, a constant, fails `vmap` of a `cond` branch on such a mesh.
  joined = jnp.concatenate(found)
  position = np.argsort(order)
  runs = np.split(position, np.flatnonzero(np.diff(position) != 1) + 1)
  return jnp.concatenate([joined[r[0] : r[0] + len(r)] for r in runs])


def finite_flags(leaves: Sequence[Any]) -> jax.Array:
  """Per leaf, True iff all its elements are finite (see `flags`)."""
  return flags(pieces(leaves), len(leaves))


def agree(flags: jax.Array, axis_name: AxisName) -> jax.Array:
  """`flags` ANDed across the replicas of `axis_name`: one collective."""
  if axis_name is None:
    return flags
  return jnp.asarray(lax.pmin(flags.astype(jnp.int32), axis_name), jnp.bool_)


def all_finite(tree: Any, *, axis_name: AxisName = None) -> jax.Array:
  """Returns True when every element of every array leaf of `tree` is finite.

  `None` and `float0` leaves are ignored, integer leaves are finite, and an
  empty tree is finite. Each leaf is read once, and nothing synchronises
  with the host. No NaN is made on the way: with `jax_debug_nans` on, an
  inf in `tree` gives False, not an error.

  Args:
    tree: a pytree of arrays, typically gradients.
    axis_name: a mapped axis (`pmap`, `shard_map`, `vmap`), or several.
      When given, the replicas agree through one scalar collective.

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
  return agree(jnp.all(finite_flags(jax.tree.leaves(tree))), axis_name)


def exact_div(x: Any, divisor: Any) -> jax.Array:
  """`x / divisor`, correctly rounded with and without `jit` and `vmap`.

  XLA turns a division by a constant or by a broadcast scalar into a
  multiplication by the reciprocal, one ulp off for divisors such as 1.5, 3
  or 10 (TensorFlow's traces use them). So the divisor is made an array of
  `x`'s shape (through `where`, so that `vmap` batches it with `x`) and both
  pass an optimization barrier, behind which XLA sees no constant.
  """
  x = jnp.asarray(x)
  divisor = jnp.where(jnp.isnan(x), divisor, divisor)
  x, divisor = lax.optimization_barrier((x, divisor))
  return jnp.divide(x, divisor)


def varying_axes(x: Any) -> frozenset[Any]:
  """The `shard_map` axes along which `x` varies (none outside one)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10 and later
  vma = getattr(aval, "vma", None) if manual is None else manual.varying
  return frozenset(vma or ())


def explicit_axes(leaves: Sequence[Any]) -> frozenset[Any]:
  """The Explicit mesh axes that split the leaves, in their types."""
  axes: set[Any] = set()
  for x in leaves:
    sharding: Any = getattr(jax.typeof(x), "sharding", None)
    if getattr(sharding, "mesh", None) is not None:
      split = jax.tree.leaves(tuple(sharding.spec))  # None is no leaf
      axes.update(set(split) & set(sharding.mesh.explicit_axes))
  return frozenset(axes)
