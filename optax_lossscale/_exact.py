"""An exact division, with and without `jit`, under `vmap` too."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__: list[str] = []


def exact_div(x: Any, divisor: Any) -> jax.Array:
  """`x / divisor`, correctly rounded with and without `jit` and `vmap`.

  XLA rewrites a division by a compile-time constant, or an array's division
  by a broadcast scalar, into a multiplication by the reciprocal, which
  differs from IEEE division in the last bit for divisors such as 3, 1.5 or
  10. Here both operands have the quotient's shape and pass through an
  optimization barrier together, so XLA sees neither a constant nor a
  broadcast; under `vmap` the batching rule broadcasts them before the
  barrier. The operands promote as they do for `/` (a Python number stays
  weakly typed), and the quotient is differentiable.

  Args:
    x: the dividend.
    divisor: the divisor.

  Returns:
    The correctly rounded quotient.
  """
  x, divisor = jnp.asarray(x), jnp.asarray(divisor)
  shape = jnp.broadcast_shapes(x.shape, divisor.shape)
  return _divide(jnp.broadcast_to(x, shape), jnp.broadcast_to(divisor, shape))


@jax.custom_batching.custom_vmap
def _barrier_divide(x: jax.Array, divisor: jax.Array) -> jax.Array:
  x, divisor = lax.optimization_barrier((x, divisor))
  quotient: jax.Array = jnp.divide(x, divisor)
  return quotient


@_barrier_divide.def_vmap
def _barrier_divide_batched(
  axis_size: int, in_batched: list[bool], x: jax.Array, divisor: jax.Array
) -> tuple[jax.Array, bool]:
  def batched(a: jax.Array, is_batched: bool) -> jax.Array:
    return a if is_batched else jnp.broadcast_to(a, (axis_size, *a.shape))

  x, divisor = batched(x, in_batched[0]), batched(divisor, in_batched[1])
  return _barrier_divide(x, divisor), True


@jax.custom_jvp
def _divide(x: jax.Array, divisor: jax.Array) -> jax.Array:
  quotient: jax.Array = _barrier_divide(x, divisor)
  return quotient


@_divide.defjvp
def _divide_jvp(primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
  # A custom_vmap function has no reverse-mode rule: differentiate `x / d`.
  (x, divisor), (dx, ddivisor) = primals, tangents
  quotient = _barrier_divide(x, divisor)
  return quotient, (dx - quotient * ddivisor) / divisor
