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
