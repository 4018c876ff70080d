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


def _max_abs(x: jax.Array) -> jax.Array:
  """One reduction whose result is non-finite iff some element of `x` is.

  `max` propagates NaN in XLA, and `abs` maps -inf to inf, so a single read of
  `x` decides finiteness. Complex numbers are checked part by part, so that a
  finite value with a large magnitude is not mistaken for an overflow.
  """
  if jnp.iscomplexobj(x):
    return jnp.maximum(_max_abs(jnp.real(x)), _max_abs(jnp.imag(x)))
  if x.size == 0:
    return jnp.zeros((), x.dtype)
  return jnp.max(jnp.abs(x))


def _combine(flags: list[jax.Array], axis_name: AxisName) -> jax.Array:
  ok = jnp.array(True) if not flags else jnp.all(jnp.stack(flags))
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
  flags = []
  for x in _array_leaves(tree):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      flags.append(jnp.isfinite(_max_abs(x)))
  return _combine(flags, axis_name)
