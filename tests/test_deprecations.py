"""The public names, and 0.1.0's names that another route replaces.

Each deprecated name warns, naming its replacement, and still works through
0.3, with the replacement's results; none is in `__all__`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols

PUBLIC = {
  "ConsecutiveSkipsError",
  "DynamicLossScale",
  "FixedLossScale",
  "LossScale",
  "LossScaleOptimizer",
  "LossScaleOptimizerState",
  "NoOpLossScale",
  "SkipMonitor",
  "SkipReport",
  "UnscaleGradientsState",
  "all_finite",
  "check_state",
  "deserialize",
  "register_loss_scale",
  "scaled_value_and_grad",
  "serialize",
  "skip_reports",
  "unscale_gradients",
}
# Each deprecated name, and what its warning must name as the replacement.
DEPRECATED = {
  "apply_gradients": r"use `LossScaleOptimizer\.apply_gradients`",
  "loss_scale_optimizer": r"use `LossScaleOptimizer.*\.gradient_transformation\(\)`",
  "get_loss_scale": r"use `\w*state\.loss_scale`",
  "get": r"use the loss scale's class, or `deserialize`",
}


def _deprecated(name):
  """`ols.<name>`, checking its warning: it names the replacement."""
  with pytest.warns(DeprecationWarning, match=DEPRECATED[name]) as record:
    value = getattr(ols, name)
  (warning,) = record
  assert f"`optax_lossscale.{name}` is deprecated" in str(warning.message)
  assert warning.filename == __file__  # it points at the caller
  return value


# --- the public names -----------------------------------------------------------


def test_all_has_the_public_names_each_importable_without_a_warning():
  assert set(ols.__all__) == PUBLIC | {"__version__"}
  assert len(ols.__all__) <= 19  # 18 names and __version__
  for name in ols.__all__:
    assert getattr(ols, name) is not None  # no warning: errors here
  assert isinstance(ols.__version__, str)
  assert set(ols.__all__) <= set(dir(ols))
  assert not set(DEPRECATED) & set(ols.__all__)


@pytest.mark.parametrize(
  "name", ["nope", "SkipRecord", "grads_finite", "_exact"]
)
def test_an_unknown_or_removed_name_raises_attribute_error(name):
  with pytest.raises(
    AttributeError, match=f"module 'optax_lossscale' has no attribute '{name}'"
  ):
    getattr(ols, name)
  with pytest.raises(ImportError):
    exec(f"from optax_lossscale import {name}", {})


def test_removed_members_are_gone():
  # `SkipRecord` is the type of `state.last_skip`; `LossScale.grads_finite`
  # is internal now (a subclass no longer overrides it).
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  record = tx.init({"w": jnp.ones(2)}).last_skip
  assert type(record).__name__ == "SkipRecord"
  assert not hasattr(ols.LossScale, "grads_finite")


# --- each deprecated name ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DEPRECATED))
def test_each_deprecated_name_warns_and_is_not_in_all(name):
  assert callable(_deprecated(name))
  assert name not in ols.__all__


GRADS = [{"w": jnp.array([8.0, 4.0])}, {"w": jnp.array([jnp.inf, 4.0])}]


def test_apply_gradients_gives_the_method_s_results_on_every_route():
  apply_gradients = _deprecated("apply_gradients")
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.5, momentum=0.9), ols.DynamicLossScale(8.0)
  )
  sgd = optax.sgd(1.0)
  routes = {
    "method": tx.apply_gradients,
    "instance": lambda *a: apply_gradients(tx, *a),
    "gradient_transformation": lambda *a: apply_gradients(
      tx.gradient_transformation(), *a
    ),
  }

  @jax.jit
  def run(params):
    out = {}
    for name, step in routes.items():
      p, s = params, tx.init(params)
      for grads in GRADS:  # applied, then skipped
        p, s = step(grads, s, p)
      out[name] = (p, s)
    # Any other transformation: `update`, then `optax.apply_updates`.
    out["sgd"] = apply_gradients(sgd, GRADS[0], sgd.init(params), params)[0]
    return out

  out = run({"w": jnp.ones(2)})
  chex.assert_trees_all_equal(out["instance"], out["method"])
  chex.assert_trees_all_equal(out["gradient_transformation"], out["method"])
  assert int(out["method"][1].skipped_steps) == 1
  chex.assert_trees_all_equal(out["sgd"], {"w": jnp.array([-7.0, -3.0])})


def test_loss_scale_optimizer_is_the_class_s_gradient_transformation():
  loss_scale_optimizer = _deprecated("loss_scale_optimizer")
  ls = ols.FixedLossScale(4)
  tx = loss_scale_optimizer(optax.sgd(1.0), ls, skip_nonfinite=False)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  reference = ols.LossScaleOptimizer(
    optax.sgd(1.0), ls, skip_nonfinite=False
  ).gradient_transformation()
  params = {"w": jnp.ones(2)}

  @jax.jit
  def both(grads):
    return [t.update(grads, t.init(params), params) for t in (tx, reference)]

  for grads in GRADS:
    got, want = both(grads)
    chex.assert_trees_all_equal(got, want)  # the inf step applied, as asked
  assert not bool(jnp.isfinite(got[0]["w"][0]))
  with pytest.raises(TypeError, match="frobnicate"):
    loss_scale_optimizer(optax.sgd(1.0), ls, frobnicate=True)


def test_get_loss_scale_is_the_state_s_loss_scale_at_any_depth():
  get_loss_scale = _deprecated("get_loss_scale")
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(64.0))
  state = tx.init({"w": jnp.ones(2)})
  assert get_loss_scale(state) is state.loss_scale
  chained = optax.chain(optax.identity(), tx).init({"w": jnp.ones(2)})
  assert float(get_loss_scale(chained)()) == 64.0
  unscale = ols.unscale_gradients(ols.FixedLossScale(2))
  unscale_state = unscale.init(None)
  assert get_loss_scale(unscale_state) is unscale_state.loss_scale
  with pytest.raises(ValueError, match="found 0"):
    get_loss_scale(optax.sgd(0.1).init(jnp.ones(1)))
  with pytest.raises(ValueError, match="found 2"):
    get_loss_scale((state, state))


def test_get_gives_what_the_class_or_deserialize_gives():
  get = _deprecated("get")
  assert get(None) is None
  fixed = get(128)
  assert isinstance(fixed, ols.FixedLossScale) and fixed.loss_scale_value == 128
  dynamic = get("dynamic")
  assert isinstance(dynamic, ols.DynamicLossScale)
  assert dynamic.get_config() == ols.DynamicLossScale().get_config()
  config = ols.serialize(ols.DynamicLossScale(8.0, 10, hysteresis=2))
  assert get(config).get_config() == ols.deserialize(config).get_config()
  chex.assert_trees_all_equal(get(config), ols.deserialize(config))
  with pytest.raises((TypeError, ValueError)):
    get(object())


def test_a_deprecated_name_warns_each_time_it_is_read():
  _deprecated("get")
  _deprecated("get")
  assert jax.tree.leaves(_deprecated("get")(2.0)) == []
