"""A short demonstration: float16 gradients underflow, loss scaling saves them.

Run with `python -m optax_lossscale.demo`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import optax_lossscale as ols


def main() -> None:
  w = jnp.array([1e-3, 2e-3, 3e-3], jnp.float32)

  def loss_fn(w: jax.Array) -> jax.Array:
    # A float16 forward pass whose gradients (~1e-8) are below float16's
    # smallest subnormal (~6e-8).
    w16 = w.astype(jnp.float16)
    return jnp.sum(w16 * w16) * jnp.float16(1e-5)

  true = jax.grad(lambda w: jnp.sum(w * w) * 1e-5)(w)
  plain = jax.grad(loss_fn)(w)
  loss_scale = ols.DynamicLossScale()
  _, scaled = ols.scaled_value_and_grad(loss_fn)(loss_scale, w)
  unscaled = loss_scale.unscale(scaled)
  new_loss_scale, should_apply = loss_scale.update(unscaled)
  print("float32 gradients:             ", true)
  print("float16 gradients, no scaling: ", plain)
  print(f"float16 gradients, scaled by {float(loss_scale()):g}:", unscaled)
  print("finite:", bool(should_apply), "next loss scale:", float(new_loss_scale()))


if __name__ == "__main__":
  main()
