"""`exact_div` is IEEE division under `jit`, `vmap` and `grad`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_lossscale._exact import exact_div


@pytest.mark.parametrize("divisor", [1.5, 3.0, 10.0])
def test_exact_div_is_ieee_division_under_jit_and_vmap(divisor):
  # XLA rewrites an array's division by a broadcast scalar (what `vmap`
  # makes of a scalar division) into a multiplication by the reciprocal.
  x = np.float32(4.0) / np.float32(1.5) * np.arange(1, 65, dtype=np.float32)
  expected = (x / np.float32(divisor)).view(np.int32)
  d = jnp.float32(divisor)
  batched = jax.jit(jax.vmap(lambda s: exact_div(s, d)))(x)
  nested = jax.jit(jax.vmap(jax.vmap(lambda s: exact_div(s, d))))(
    x.reshape(8, 8)
  )
  whole = jax.jit(exact_div)(x, d)
  scalar = [jax.jit(exact_div)(s, d) for s in x[:4]]
  for got in (batched, nested.ravel(), whole):
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), expected)
  assert [np.asarray(s).view(np.int32) for s in scalar] == list(expected[:4])


def test_exact_div_promotes_as_division_and_differentiates():
  assert exact_div(jnp.float16(3), 2.0).dtype == jnp.float16
  assert exact_div(2.0, 4).weak_type  # Python numbers stay weakly typed
  grad = jax.grad(lambda s: exact_div(jnp.float32(1), s))(jnp.float32(4))
  assert float(grad) == -1 / 16
