"""Finiteness checks over pytrees of gradients."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

AxisName = Hashable | Sequence[Hashable] | None


def _is_float0(x: Any) -> bool:
  return getattr(x, "dtype", None) == jax.dtypes.float0


def _array_leaves(tree: Any) -> list[jax.Array]:
  """The leaves that carry numbers: `None` and `float0` leaves are dropped."""
  return [x for x in jax.tree.leaves(tree) if not _is_float0(x)]


def _nonfinite_probe(x: jax.Array) -> jax.Array:
  """A scalar that is NaN iff some element of `x` is NaN or infinite.

  `x * 0` is 0 for finite elements and NaN for NaN and ±inf, and IEEE addition
  propagates NaN, so one fused sum reads `x` once and decides. (A `max`-based
  check is not safe: XLA's CPU backend hands large `max` reductions to a
  library that drops NaN.)
  """
  return jnp.sum(x * jnp.zeros((), x.dtype))


# Leaves up to this size are concatenated (per dtype) and checked by one
# reduction: on XLA's CPU backend every reduction is a separately compiled
# kernel, so hundreds of small leaves would multiply the compile time, while
# copying small leaves costs next to nothing. Larger leaves are checked in
# place, so each is read exactly once.
_SMALL_LEAF = 2**16


def _probes(leaves: list[jax.Array]) -> list[jax.Array]:
  """`_nonfinite_probe` over `leaves`, small ones concatenated per dtype."""
  small: dict[Any, list[jax.Array]] = {}
  probes = []
  for x in leaves:
    if x.size <= _SMALL_LEAF:
      small.setdefault(x.dtype, []).append(x.ravel())
    else:
      probes.append(_nonfinite_probe(x))
  for group in small.values():
    probes.append(_nonfinite_probe(jnp.concatenate(group)))
  return probes


def _verdict(probes: list[jax.Array], axis_name: AxisName) -> jax.Array:
  """True iff every probe (0 or NaN, see `_nonfinite_probe`) is finite.

  The probes are summed as one float32 vector, so the per-leaf scalar work is
  a single small kernel, whatever the number of leaves.
  """
  as_real = [
    (jnp.real(p) + jnp.imag(p)) if jnp.iscomplexobj(p) else p for p in probes
  ]
  total = jnp.sum(
    jnp.stack(
      [p.astype(jnp.float32) for p in as_real] or [jnp.zeros((), jnp.float32)]
    )
  )
  ok = jnp.isfinite(total)
  if axis_name is not None:
    # One scalar collective: every replica ends with the same verdict.
    ok = lax.pmin(ok.astype(jnp.int32), axis_name).astype(jnp.bool_)
  return ok


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
  leaves = [jnp.asarray(x) for x in _array_leaves(tree)]
  floats = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
  return _verdict(_probes(floats), axis_name)
