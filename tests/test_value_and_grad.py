"""`scaled_value_and_grad`: the scaled backward pass, and what caps it."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols


def _float16_loss(w):
  return jnp.sum(w.astype(jnp.float16) ** 2)  # a float16 loss


def test_a_float16_loss_that_caps_the_scale_is_named_when_traced():
  # The loss's cotangent is the scale, in float16: 65536 is inf there, so
  # every growth past 2**15 overflows every gradient.
  ls = ols.DynamicLossScale(2.0**16)
  with pytest.warns(UserWarning, match="the loss is float16.*2\\*\\*15"):
    _, grads = jax.jit(ols.scaled_value_and_grad(_float16_loss))(
      ls, jnp.ones(2)
    )
  assert not bool(ols.all_finite(grads))  # what the warning is about
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = jnp.ones(2)
  with pytest.warns(UserWarning, match="the loss is float16"):
    jax.jit(tx.minimize, static_argnums=0)(
      _float16_loss, params, tx.init(params)
    )


@pytest.mark.parametrize(
  "loss_scale",
  [
    ols.NoOpLossScale(),
    ols.FixedLossScale(2.0**15),
    ols.DynamicLossScale(2.0**10, max_loss_scale=2.0**15),
  ],
  ids=["noop", "fixed", "capped"],
)
def test_no_warning_where_the_scale_cannot_pass_float16(loss_scale):
  float32_loss = lambda w: _float16_loss(w).astype(jnp.float32)  # noqa: E731
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.jit(ols.scaled_value_and_grad(_float16_loss))(loss_scale, jnp.ones(2))
    jax.jit(ols.scaled_value_and_grad(float32_loss))(
      ols.DynamicLossScale(), jnp.ones(2)
    )
