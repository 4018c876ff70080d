"""optax_lossscale in the stacks users have: Orbax, Flax NNX and linen,
Equinox, and configs written by TensorFlow and Keras.

`docs/guides/frameworks.md` shows each (Haiku and the functional NNX step
included) and runs in `test_docs_code.py`; here the same patterns train,
skip and resume as they should.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import optax_lossscale as ols
from tests.tf_reference import tf_dynamic_loss_scale

pytestmark = [
  pytest.mark.usefixtures("standard_promotion"),
  # Orbax and Flax warn about their own deprecations; not ours to fix.
  pytest.mark.filterwarnings("ignore::DeprecationWarning:orbax.*"),
  pytest.mark.filterwarnings("ignore::DeprecationWarning:flax.*"),
  pytest.mark.filterwarnings("ignore::UserWarning:orbax.*"),
]

X = jax.random.normal(jax.random.PRNGKey(0), (32, 4))
Y = jnp.sin(X @ jnp.array([[1.0], [-2.0], [0.5], [3.0]]))
STEPS = 60


def _mlp_params(key=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(key))
  return {
    "w1": jax.random.normal(k1, (4, 16)) * 0.5,
    "b1": jnp.zeros(16),
    "w2": jax.random.normal(k2, (16, 1)) * 0.5,
    "b2": jnp.zeros(1),
  }


def _loss(params, x, y):
  h = jnp.tanh(
    x.astype(jnp.float16) @ params["w1"].astype(jnp.float16)
    + params["b1"].astype(jnp.float16)[None, :]
  )
  pred = (
    h @ params["w2"].astype(jnp.float16)
    + params["b2"].astype(jnp.float16)[None, :]
  )
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def _train_step(tx):
  @jax.jit
  def step(params, opt_state):
    loss, grads = ols.scaled_value_and_grad(_loss)(opt_state, params, X, Y)
    return tx.apply_gradients(grads, opt_state, params, value=loss)

  return step


def _save(path, tree):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)


def _restore(path, target):
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, target)


# --- Orbax ----------------------------------------------------------------------


def test_orbax_checkpoint_mid_run_resumes_bit_for_bit(tmp_path):
  tx = ols.LossScaleOptimizer(
    optax.adam(1e-2), ols.DynamicLossScale(2.0**15, 4)
  )
  step = _train_step(tx)
  params = _mlp_params()
  state = tx.init(params)
  for _ in range(8):
    params, state = step(params, state)
  assert int(state.skipped_steps) > 0  # the run has real loss-scale history

  _save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  fresh = {"params": _mlp_params(key=1), "opt_state": tx.init(_mlp_params(1))}
  restored = ols.check_state(_restore(tmp_path / "ckpt", fresh))
  assert isinstance(restored["opt_state"], ols.LossScaleOptimizerState)
  assert isinstance(restored["opt_state"].loss_scale, ols.DynamicLossScale)
  chex.assert_trees_all_equal(restored["opt_state"], state)

  p1, s1 = params, state
  p2, s2 = restored["params"], restored["opt_state"]
  for _ in range(8):
    p1, s1 = step(p1, s1)
    p2, s2 = step(p2, s2)
  chex.assert_trees_all_equal((p1, s1), (p2, s2))

  # The same checkpoint restores into an optimizer configured otherwise:
  # the state's leaves do not depend on `hysteresis`.
  other = ols.LossScaleOptimizer(
    optax.adam(1e-2), ols.DynamicLossScale(2.0**15, 4, hysteresis=3)
  )
  target = {"params": params, "opt_state": other.init(params)}
  restored = _restore(tmp_path / "ckpt", target)["opt_state"]
  assert restored.loss_scale.hysteresis == 3
  chex.assert_trees_all_equal(jax.tree.leaves(restored), jax.tree.leaves(state))


class _StateV010(NamedTuple):  # 0.1.0's LossScaleOptimizerState
  loss_scale: Any
  inner_state: Any
  should_apply: Any
  skipped_steps: Any
  consecutive_skipped_steps: Any


def test_orbax_checkpoint_in_the_0_1_0_layout_restores(tmp_path):
  # 0.1.0's state had five fields and its DynamicLossScale two leaves: the
  # restore into that layout fills a fresh state, and training goes on.
  tx = ols.LossScaleOptimizer(
    optax.adam(1e-2), ols.DynamicLossScale(2.0**15, 4)
  )
  params = _mlp_params()
  fresh = tx.init(params)
  old = _StateV010(
    {"current_loss_scale": jnp.float32(1024), "num_good_steps": jnp.int32(3)},
    fresh.inner_state,
    jnp.array(True),
    jnp.int32(3),
    jnp.int32(0),
  )
  _save(tmp_path / "v010", {"params": params, "opt_state": old})
  layout = {name: getattr(fresh, name) for name in _StateV010._fields}
  layout["loss_scale"] = {
    "current_loss_scale": fresh.loss_scale.current_loss_scale,
    "num_good_steps": fresh.loss_scale.num_good_steps,
  }
  target = {"params": params, "opt_state": layout}
  v010 = _restore(tmp_path / "v010", target)["opt_state"]
  v010["loss_scale"] = dataclasses.replace(
    fresh.loss_scale, **v010["loss_scale"]
  )
  state = ols.check_state(fresh._replace(**v010))
  assert int(state.skipped_steps) == 3 and int(state.retries) == 0
  assert int(state.loss_scale.num_bad_steps) == 0
  # The fourth good step of increment_period=4 doubles the scale.
  _, state = _train_step(tx)(params, state)
  assert bool(state.should_apply) and float(state.loss_scale()) == 2048.0


# --- Flax NNX ---------------------------------------------------------------------


class _NNXModel(nnx.Module):
  def __init__(self, rngs):
    kw = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
    self.hidden = nnx.Linear(4, 16, **kw)
    self.out = nnx.Linear(16, 1, **kw)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


def test_nnx_optimizer_trains_and_skips_a_nan_batch():
  model = _NNXModel(nnx.Rngs(0))
  tx = ols.LossScaleOptimizer(
    optax.adam(1e-2), ols.DynamicLossScale(2.0**15, 5)
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss_scale = optimizer.opt_state.loss_scale

    def loss_fn(model):
      loss = jnp.mean((model(x).astype(jnp.float32) - y) ** 2)
      return loss_scale.scale(loss), loss

    (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads, value=loss)
    return loss

  losses = []
  for i in range(STEPS):
    x = X.at[0, 0].set(jnp.nan) if i == 5 else X  # a NaN batch: skipped
    before = nnx.state(model, nnx.Param)
    losses.append(float(train_step(model, optimizer, x, Y)))
    if i == 5:
      chex.assert_trees_all_equal(nnx.state(model, nnx.Param), before)
  assert np.isnan(losses[5]) and losses[-1] < 0.5 * losses[0]
  assert model.hidden.kernel[...].dtype == jnp.float32  # master weights
  state = optimizer.opt_state
  assert int(state.nonfinite_loss_steps) == 1
  assert int(state.skipped_steps) >= 1
  assert ols.check_state(optimizer) is optimizer


# --- Flax linen -------------------------------------------------------------------


class _LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, dtype=jnp.float16, param_dtype=jnp.float32)(x)
    return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(jnp.tanh(x))


def test_linen_train_state_trains_and_its_fused_step_agrees():
  # `TrainState.apply_gradients` (through `tx.update`) and the fused step
  # (`state.tx.apply_gradients` and `state.replace`) give the same states,
  # up to rounding (XLA may fuse the last multiply and the addition).
  model = _LinenModel()
  state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.PRNGKey(0), X)["params"],
    tx=ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale()),
  )

  def loss_and_grads(state, x, y):
    def loss_fn(params):
      pred = state.apply_fn({"params": params}, x).astype(jnp.float32)
      return jnp.mean((pred - y) ** 2)

    return ols.scaled_value_and_grad(loss_fn)(state.opt_state, state.params)

  @jax.jit
  def plain_step(state, x, y):
    loss, grads = loss_and_grads(state, x, y)
    return state.apply_gradients(grads=grads), loss

  @jax.jit
  def fused_step(state, x, y):
    loss, grads = loss_and_grads(state, x, y)
    params, opt_state = state.tx.apply_gradients(
      grads, state.opt_state, state.params
    )
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new, loss

  plain = fused = state
  losses = []
  for i in range(STEPS):
    y = Y.at[0].set(jnp.inf) if i == 5 else Y  # one skipped step
    plain, _ = plain_step(plain, X, y)
    fused, loss = fused_step(fused, X, y)
    losses.append(float(loss))
  chex.assert_trees_all_close(fused, plain, rtol=1e-5, atol=1e-6)
  assert losses[-1] < 0.5 * losses[0]
  assert int(fused.opt_state.skipped_steps) == 1
  assert int(fused.step) == STEPS  # TrainState counts every call
  assert fused.params["Dense_0"]["kernel"].dtype == jnp.float32


# --- Equinox ------------------------------------------------------------------------


def test_equinox_filter_value_and_grad_step():
  model = eqx.nn.MLP(
    4, 1, 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0)
  )
  tx = ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale())
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    def loss_fn(model):
      half = jax.tree.map(
        lambda a: a.astype(jnp.float16) if eqx.is_array(a) else a, model
      )
      pred = jax.vmap(half)(x.astype(jnp.float16)).astype(jnp.float32)
      loss = jnp.mean((pred - y) ** 2)
      return opt_state.loss_scale.scale(loss), loss

    (_, loss), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
    params = eqx.filter(model, eqx.is_array)
    params, opt_state = tx.apply_gradients(grads, opt_state, params, value=loss)
    return eqx.combine(params, model), opt_state, loss

  losses = []
  for _ in range(STEPS):
    model, opt_state, loss = train_step(model, opt_state, X, Y)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0]
  assert model.layers[0].weight.dtype == jnp.float32


# --- TensorFlow / Keras migration ---------------------------------------------------

# As `tf.keras.mixed_precision.experimental.LossScaleOptimizer.get_config()`
# (TF 2.3) and Keras 2's `LossScaleOptimizer.get_config()` wrote them.
TF_OPTIMIZER_CONFIG = {
  "class_name": "LossScaleOptimizer",
  "config": {
    "optimizer": {"class_name": "SGD", "config": {"learning_rate": 0.1}},
    "loss_scale": {
      "class_name": "DynamicLossScale",
      "config": {
        "initial_loss_scale": 2.0**15,
        "increment_period": 3,
        "multiplier": 2.0,
      },
    },
  },
}
KERAS_OPTIMIZER_CONFIG = {
  "class_name": "LossScaleOptimizer",
  "config": {
    "inner_optimizer": {"class_name": "SGD", "config": {}},
    "dynamic": True,
    "initial_scale": 2.0**15,
    "dynamic_growth_steps": 3,
  },
}


def test_train_with_configs_written_by_tensorflow_and_keras():
  tf, keras = map(
    ols.deserialize, [TF_OPTIMIZER_CONFIG, KERAS_OPTIMIZER_CONFIG]
  )
  assert tf.get_config() == keras.get_config()  # the same loss scale
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), tf)
  step = _train_step(tx)
  params = _mlp_params()
  state = tx.init(params)
  scales, applied = [], []
  for _ in range(12):
    params, state = step(params, state)
    scales.append(np.float32(state.loss_scale()))
    applied.append(bool(state.should_apply))
  ref = tf_dynamic_loss_scale(applied, 2.0**15, 3, 2.0)
  assert scales == [s for s, _, _ in ref]
  assert not all(applied) and any(applied)
  assert bool(jnp.all(jnp.isfinite(params["w1"])))
