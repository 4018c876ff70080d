"""LossScaleOptimizer: one class, one step, a safe extension point."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

pytestmark = [
  pytest.mark.usefixtures("standard_promotion"),
  pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}


def _grads(scale, bad=False):
  g = {"w": jnp.full((2, 3), 0.5) * scale, "b": jnp.ones(3) * scale}
  if bad:
    g["w"] = g["w"].at[1, 2].set(jnp.nan)
  return g


# --- the class and its three entry points -------------------------------------


def test_apply_gradients_matches_update_then_apply_updates():
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(8.0, 2))
  p_fused = p_plain = _params()
  s_fused = s_plain = tx.init(p_fused)
  fused = jax.jit(tx.apply_gradients)
  update = jax.jit(tx.update)
  for i in range(6):
    grads = _grads(ols.get_loss_scale(s_plain)(), bad=i == 3)
    p_fused, s_fused = fused(grads, s_fused, p_fused)
    updates, s_plain = update(grads, s_plain, p_plain)
    p_plain = optax.apply_updates(p_plain, updates)
  assert int(s_fused.skipped_steps) == 1
  chex.assert_trees_all_close((p_fused, s_fused), (p_plain, s_plain), rtol=1e-6)


def test_gradient_transformation_and_factory_take_the_fused_path():
  opt = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
  params = _params()
  state = opt.init(params)
  grads = _grads(8.0)

  def jaxpr(tx, state=state):
    return str(
      jax.make_jaxpr(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(
        grads, state, params
      )
    )

  fused = jaxpr(opt)
  assert jaxpr(opt.gradient_transformation()) == fused
  factory = ols.loss_scale_optimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
  assert jaxpr(factory) == fused
  # A plain chain is update then apply_updates: the update leaves the cond.
  chain = optax.chain(opt.gradient_transformation())
  assert "cond" in jaxpr(chain, (state,))
  assert jaxpr(chain, (state,)) != fused
  assert isinstance(opt.gradient_transformation(), optax.GradientTransformation)


def test_an_instance_is_a_duck_typed_optax_transformation():
  opt = ols.LossScaleOptimizer(optax.sgd(1.0), ols.FixedLossScale(4))
  chained = optax.chain(opt, optax.scale(0.5))
  params = {"w": jnp.ones(2)}
  updates, _ = chained.update({"w": jnp.full(2, 4.0)}, chained.init(params))
  np.testing.assert_array_equal(updates["w"], [-0.5, -0.5])


def test_inner_type_error_reaches_the_user_once_and_inner_is_traced_once():
  calls = []

  def update(updates, state, params=None):
    calls.append(1)
    raise TypeError("my inner's own message")

  inner = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  tx = ols.LossScaleOptimizer(inner, ols.FixedLossScale(2))
  params = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match="my inner's own message"):
    jax.jit(tx.update)({"w": jnp.ones(2)}, tx.init(params), params)
  assert len(calls) == 1


@pytest.mark.parametrize("entry", ["update", "apply_gradients"])
def test_inner_is_traced_once_per_trace_of_the_step(entry):
  calls = []
  adam = optax.adam(0.1)

  def update(updates, state, params=None):
    calls.append(1)
    return adam.update(updates, state, params)

  tx = ols.LossScaleOptimizer(
    optax.GradientTransformation(adam.init, update), ols.DynamicLossScale(4.0)
  )
  params = _params()
  state = tx.init(params)
  step = jax.jit(getattr(tx, entry))
  for _ in range(3):
    out, state = step(_grads(4.0), state, params)
  assert len(calls) == 1


def test_inner_whose_updates_differ_in_dtype_and_structure():
  def update(updates, state, params=None):
    # Updates of another structure and dtype than the gradients.
    total = sum(jnp.sum(x) for x in jax.tree.leaves(updates))
    return {"total": total.astype(jnp.bfloat16)}, state

  inner = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  tx = ols.LossScaleOptimizer(inner, ols.DynamicLossScale(2.0))
  state = tx.init(None)
  step = jax.jit(tx.update)
  updates, state = step({"a": jnp.full(3, 2.0)}, state)
  assert updates["total"].dtype == jnp.bfloat16 and float(updates["total"]) == 3
  updates, state = step({"a": jnp.array([jnp.inf, 1.0, 1.0])}, state)
  assert float(updates["total"]) == 0 and int(state.skipped_steps) == 1


def test_constructor_refuses_bad_arguments_naming_them():
  adam, ls = optax.adam(1e-3), ols.DynamicLossScale()
  with pytest.raises(TypeError, match="inner"):
    ols.LossScaleOptimizer(object(), ls)
  with pytest.raises(TypeError, match="loss_scale"):
    ols.LossScaleOptimizer(adam, 2.0)
  with pytest.raises(TypeError, match="skip_nonfinite"):
    ols.LossScaleOptimizer(adam, ls, skip_nonfinite=1)
  with pytest.raises(TypeError, match="on_skip"):  # see SkipMonitor
    ols.LossScaleOptimizer(adam, ls, on_skip=print)
  with pytest.raises(TypeError, match="frobnicate"):
    ols.loss_scale_optimizer(adam, ls, frobnicate=True)
  tx = ols.LossScaleOptimizer(adam, ls)
  with pytest.raises(TypeError, match="LossScaleOptimizerState"):
    tx.update({"w": jnp.ones(2)}, adam.init({"w": jnp.ones(2)}))
  with pytest.raises(TypeError, match="value"):
    p = {"w": jnp.ones(2)}
    tx.update(p, tx.init(p), p, value=(jnp.ones(()), None))


@pytest.mark.parametrize("entry", ["update", "apply_gradients", "unscale"])
def test_a_gradient_of_the_wrong_shape_is_named_before_tracing(entry):
  params = _params()
  grads = dict(_grads(8.0), b=jnp.ones(4))  # `b` is a vector of 3
  if entry == "unscale":
    tx = ols.unscale_gradients(ols.DynamicLossScale(8.0))
    step = tx.update
  else:
    tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
    step = getattr(tx, entry)
  with pytest.raises(ValueError, match=r"\['b'\] has shape \(4,\).* \(3,\)"):
    jax.jit(step)(grads, tx.init(params), params)


@pytest.mark.parametrize("entry", ["update", "apply_gradients"])
def test_gradients_that_vary_across_devices_name_the_missing_pmean(entry):
  mesh = jax.make_mesh((1,), ("x",))
  tx = ols.LossScaleOptimizer(
    optax.adam(0.1), ols.DynamicLossScale(8.0), axis_name="x"
  )
  params = _params()
  state = tx.init(params)

  def step(params, state, data):
    grads = jax.tree.map(lambda p: p * data[0], params)  # no pmean: varying
    if entry == "update":
      return tx.update(grads, state)
    return tx.apply_gradients(grads, state, params)

  sharded = jax.shard_map(
    step, mesh=mesh, in_specs=(P(), P(), P("x")), out_specs=(P(), P())
  )
  with pytest.raises(ValueError, match=r"vary across devices.*pmean\(grads"):
    data = jax.device_put(jnp.ones(1), jax.NamedSharding(mesh, P("x")))
    jax.jit(sharded)(params, state, data)


# --- the extension point: a user's own loss scale ---------------------------


@ols.register_loss_scale
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class HalvingLossScale(ols.LossScale):
  """Documented methods only: `__call__`, `adjust`, `get_config`."""

  factor: float = dataclasses.field(default=0.5, metadata=dict(static=True))

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.factor, jnp.float32)

  def adjust(self, grads_finite: Any) -> tuple[Any, jax.Array]:
    return self, jnp.asarray(grads_finite, jnp.bool_)

  def get_config(self) -> dict[str, Any]:
    return {"factor": self.factor}


def test_user_loss_scale_below_one_skips_a_float16_step_that_overflows():
  ls = HalvingLossScale()
  # 40000 is finite in float16; unscaled by 0.5 it is 80000: inf.
  grads = {"w": jnp.array([40000.0, 1.0], jnp.float16)}
  assert not bool(ls.grads_finite(grads))
  params = {"w": jnp.zeros(2, jnp.float16)}
  tx = ols.LossScaleOptimizer(optax.sgd(1e-3), ls)
  state = tx.init(params)
  new_params, state = jax.jit(tx.apply_gradients)(grads, state, params)
  assert not bool(state.should_apply) and int(state.skipped_steps) == 1
  np.testing.assert_array_equal(new_params["w"], params["w"])
  updates, state2 = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], 0)
  # apply_gradients, the factory and unscale_gradients see it too.
  _, s3 = ols.apply_gradients(
    ols.loss_scale_optimizer(optax.sgd(1e-3), ls), grads, state, params
  )
  assert int(s3.skipped_steps) == 2
  chain = ols.unscale_gradients(ls)
  _, u = chain.update(grads, chain.init(params))
  assert not bool(u.should_apply)
  # A gradient that stays finite once unscaled is applied.
  ok = {"w": jnp.array([1000.0, 1.0], jnp.float16)}
  new_params, state = tx.apply_gradients(ok, tx.init(params), params)
  assert bool(state.should_apply)
  np.testing.assert_allclose(new_params["w"], [-2.0, -0.002], rtol=1e-3)


def test_user_loss_scale_serializes_and_is_found_in_the_state():
  ls = HalvingLossScale(0.25)
  config = ols.serialize(ls)
  assert config == {
    "class_name": "HalvingLossScale",
    "config": {"factor": 0.25},
  }
  assert ols.deserialize(config).factor == 0.25
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ls)
  found = ols.get_loss_scale(tx.init({"w": jnp.ones(1)}))
  assert isinstance(found, HalvingLossScale) and float(found()) == 0.25
  assert ls.lowered() is None  # cannot be lowered: no retries


def test_builtins_check_the_scaled_gradients_directly():
  # The fast path: the check reads the incoming gradients (`g - g`), not the
  # unscaled ones, so the unscaling fuses into the inner update.
  grads = {"w": jnp.ones((64, 64))}
  for ls in [
    ols.DynamicLossScale(),
    ols.FixedLossScale(8),
    ols.NoOpLossScale(),
  ]:
    jaxpr = jax.make_jaxpr(ls.grads_finite)(grads).jaxpr
    assert not any(e.primitive is jax.lax.mul_p for e in jaxpr.eqns), ls
  below_one = ols.DynamicLossScale(1.0, min_loss_scale=0.25)
  jaxpr = jax.make_jaxpr(below_one.grads_finite)(grads).jaxpr
  assert any(e.primitive is jax.lax.mul_p for e in jaxpr.eqns)
  f16 = {"w": jnp.array([40000.0], jnp.float16)}
  below = ols.DynamicLossScale(
    1.0, min_loss_scale=0.25, current_loss_scale=np.float32(0.5)
  )
  assert not bool(below.grads_finite(f16))


def test_no_module_reads_another_modules_underscore_names():
  package = pathlib.Path(ols.__file__).parent
  modules = {p.stem for p in package.glob("_*.py")}
  offenders = []
  for path in package.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
        base = node.value
        if isinstance(base, ast.Name) and base.id in modules:
          offenders.append(f"{path.name}: {base.id}.{node.attr}")
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "optax_lossscale._"
      ):
        for alias in node.names:
          if alias.name.startswith("_") and not alias.name.startswith("__"):
            offenders.append(f"{path.name}: {node.module}.{alias.name}")
  assert not offenders, offenders


# --- validated state ----------------------------------------------------------


def test_dynamic_loss_scale_validates_hyperparameters_with_state_fields():
  with pytest.raises(ValueError, match="multiplier"):
    ols.DynamicLossScale(
      multiplier=0.5,
      current_loss_scale=jnp.float32(4),
      num_good_steps=jnp.int32(0),
    )
  with pytest.raises(ValueError, match="hysteresis_budget"):
    ols.DynamicLossScale(4.0, hysteresis_budget=np.int32(3))
  # Unflattening with host zeros (a tree map) is left alone.
  zeros = jax.tree.map(np.zeros_like, ols.DynamicLossScale(4.0, hysteresis=2))
  assert zeros.hysteresis == 2 and float(zeros.current_loss_scale) == 0
  # Unflattening with arbitrary leaves (tracers, shardings) still works.
  ls = ols.DynamicLossScale(4.0, hysteresis=3)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ls)
  assert isinstance(shapes, ols.DynamicLossScale)
  assert jax.jit(lambda x: x)(ls).hysteresis == 3


def test_device_state_is_not_read_on_construction():
  ls = ols.DynamicLossScale(4.0, hysteresis=2)
  leaves, treedef = jax.tree.flatten(ls)
  with jax.transfer_guard("disallow"):
    jax.tree.unflatten(treedef, leaves)


# --- Flax, through the class directly ---------------------------------------


def test_flax_linen_train_state_with_the_class():
  tx = ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale(2.0**10))
  state = train_state.TrainState.create(apply_fn=None, params=_params(), tx=tx)

  @jax.jit
  def step(state, bad):
    grads = _grads(ols.get_loss_scale(state.opt_state)())
    grads = jax.tree.map(lambda g: jnp.where(bad, jnp.nan, g), grads)
    return state.apply_gradients(grads=grads)

  for i in range(4):
    state = step(state, jnp.array(i == 1))
  assert int(state.opt_state.skipped_steps) == 1
  assert int(state.opt_state.inner_state[0].count) == 3


def test_flax_nnx_optimizer_with_the_class():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
      return self.linear(x)

  model = Model(nnx.Rngs(0))
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**8))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jnp.ones((4, 3))

  @nnx.jit
  def step(model, optimizer, y):
    loss_scale = ols.get_loss_scale(optimizer.opt_state)

    def loss_fn(model):
      return loss_scale.scale(jnp.mean((model(x) - y) ** 2))

    grads = nnx.grad(loss_fn)(model)
    optimizer.update(model, grads)

  before = model.linear.kernel.value
  step(model, optimizer, jnp.full((4, 1), jnp.nan))
  np.testing.assert_array_equal(model.linear.kernel.value, before)
  step(model, optimizer, jnp.ones((4, 1)))
  assert not np.array_equal(model.linear.kernel.value, before)
  assert int(optimizer.opt_state.skipped_steps[...]) == 1
