"""Each error a `Raises:` section documents, in modules whose own test files
other changes are editing: raised as documented, with the argument named."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols


def test_minimize_refuses_a_fun_that_is_not_callable():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match="fun"):
    tx.minimize(3, params, tx.init(params))  # type: ignore[arg-type]


def test_skip_reports_needs_exactly_one_optimizer_state():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  state = tx.init({"w": jnp.ones(2)})
  assert ols.skip_reports(state) == []
  with pytest.raises(ValueError, match=r"`skip_reports\(opt_state\)`.*found 0"):
    ols.skip_reports(optax.sgd(0.1).init({"w": jnp.ones(2)}))
  with pytest.raises(ValueError, match=r"`skip_reports\(opt_state\)`.*found 2"):
    ols.skip_reports((state, state))


def test_minimize_refuses_a_state_of_another_transformation():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match="LossScaleOptimizerState"):
    tx.minimize(lambda p: jnp.sum(p["w"]), params, optax.sgd(0.1).init(params))


def test_scaled_value_and_grad_refuses_what_it_cannot_use():
  with pytest.raises(TypeError, match="callable"):
    ols.scaled_value_and_grad(3)  # type: ignore[arg-type]
  grad_fn = ols.scaled_value_and_grad(lambda w: jnp.sum(w))
  with pytest.raises(ValueError, match="found 0"):
    grad_fn(optax.sgd(0.1).init(jnp.ones(2)), jnp.ones(2))


def test_apply_gradients_refuses_what_is_not_a_transformation():
  with pytest.raises(TypeError, match="tx"):
    ols.apply_gradients(3, {"w": jnp.ones(2)}, (), {"w": jnp.ones(2)})


def test_skip_monitor_needs_exactly_one_optimizer_state():
  with pytest.raises(ValueError, match="found 0"):
    ols.SkipMonitor()(optax.sgd(0.1).init({"w": jnp.ones(2)}))
