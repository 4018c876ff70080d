"""optax_lossscale in the stacks users have: Orbax, Flax NNX and linen,
Equinox, and configs written by TensorFlow and Keras."""

from __future__ import annotations

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
  pytest.mark.filterwarnings("ignore::DeprecationWarning"),
  pytest.mark.filterwarnings("ignore::UserWarning"),
]

X = jax.random.normal(jax.random.PRNGKey(0), (32, 4))
Y = jnp.sin(X @ jnp.array([[1.0], [-2.0], [0.5], [3.0]]))


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
    _, grads = ols.scaled_value_and_grad(_loss)(opt_state, params, X, Y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


# --- Orbax --------------------------------------------------------------------


def test_orbax_checkpoint_mid_run_resumes_bit_for_bit(tmp_path):
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), ols.DynamicLossScale(2.0**15, 4)
  )

  step = _train_step(tx)

  params = _mlp_params()
  state = tx.init(params)
  for _ in range(10):
    params, state = step(params, state)
  assert int(state.skipped_steps) > 0  # the run has real loss-scale history

  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, {"params": params, "opt_state": state})
  fresh = {"params": _mlp_params(key=1), "opt_state": tx.init(_mlp_params(1))}
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(path, fresh)
  assert isinstance(restored["opt_state"], ols.LossScaleOptimizerState)
  assert isinstance(restored["opt_state"].loss_scale, ols.DynamicLossScale)
  chex.assert_trees_all_equal(restored["opt_state"], state)

  p1, s1 = params, state
  p2, s2 = restored["params"], restored["opt_state"]
  for _ in range(10):
    p1, s1 = step(p1, s1)
    p2, s2 = step(p2, s2)
  chex.assert_trees_all_equal((p1, s1), (p2, s2))


# --- Flax NNX -------------------------------------------------------------------


class _NNXModel(nnx.Module):
  def __init__(self, rngs):
    kw = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
    self.hidden = nnx.Linear(4, 16, **kw)
    self.out = nnx.Linear(16, 1, **kw)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


def test_nnx_optimizer_train_step():
  model = _NNXModel(nnx.Rngs(0))
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), ols.DynamicLossScale(2.0**15, 5)
  )
  optimizer = nnx.Optimizer(model, tx=tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss_scale = ols.get_loss_scale(optimizer.opt_state)

    def loss_fn(model):
      loss = jnp.mean((model(x).astype(jnp.float32) - y) ** 2)
      return loss_scale.scale(loss), loss

    (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer, X, Y)) for _ in range(60)]
  assert model.hidden.kernel.value.dtype == jnp.float32  # master weights
  assert losses[-1] < 0.5 * losses[0]
  assert float(ols.get_loss_scale(optimizer.opt_state)()) > 0


# --- Flax linen -------------------------------------------------------------------


class _LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, dtype=jnp.float16, param_dtype=jnp.float32)(x)
    return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(jnp.tanh(x))


def _linen_state():
  model = _LinenModel()
  params = model.init(jax.random.PRNGKey(0), X)["params"]
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), ols.DynamicLossScale())
  return train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=tx
  )


def _linen_loss_and_grads(state, x, y):
  def loss_fn(params):
    pred = state.apply_fn({"params": params}, x).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)

  return ols.scaled_value_and_grad(loss_fn)(state.opt_state, state.params)


def test_linen_train_state_step():
  state = _linen_state()

  @jax.jit
  def train_step(state, x, y):
    loss, grads = _linen_loss_and_grads(state, x, y)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(60):
    state, loss = train_step(state, X, Y)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0]
  assert int(state.step) == 60  # TrainState counts every call, skipped or not
  assert isinstance(state.opt_state, ols.LossScaleOptimizerState)
  assert state.params["Dense_0"]["kernel"].dtype == jnp.float32


def test_linen_fused_step_matches_train_state_apply_gradients():
  # The frameworks guide's fused linen step: `ols.apply_gradients` and `state.replace`
  # give the same state as `TrainState.apply_gradients` (up to rounding: XLA
  # may fuse the last multiply and the addition differently).
  state = _linen_state()

  @jax.jit
  def plain_step(state, x, y):
    grads = _linen_loss_and_grads(state, x, y)[1]
    return state.apply_gradients(grads=grads)

  @jax.jit
  def fused_step(state, x, y):
    grads = _linen_loss_and_grads(state, x, y)[1]
    params, opt_state = ols.apply_gradients(
      state.tx, grads, state.opt_state, state.params
    )
    return state.replace(
      step=state.step + 1, params=params, opt_state=opt_state
    )

  plain = fused = state
  for i in range(12):
    y = Y.at[0].set(jnp.inf) if i == 5 else Y  # one skipped step
    plain, fused = plain_step(plain, X, y), fused_step(fused, X, y)
  assert int(fused.opt_state.skipped_steps) == 1
  assert int(fused.step) == int(plain.step) == 12
  chex.assert_trees_all_close(fused, plain, rtol=1e-5, atol=1e-6)


# --- Equinox -------------------------------------------------------------------------


def test_equinox_filter_value_and_grad_step():
  model = eqx.nn.MLP(
    4, 1, 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0)
  )
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), ols.DynamicLossScale())
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    loss_scale = ols.get_loss_scale(opt_state)

    def loss_fn(model):
      half = jax.tree.map(
        lambda a: a.astype(jnp.float16) if eqx.is_array(a) else a, model
      )
      pred = jax.vmap(half)(x.astype(jnp.float16)).astype(jnp.float32)
      loss = jnp.mean((pred - y) ** 2)
      return loss_scale.scale(loss), loss

    (_, loss), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
    updates, opt_state = tx.update(
      grads, opt_state, eqx.filter(model, eqx.is_array)
    )
    return eqx.apply_updates(model, updates), opt_state, loss

  losses = []
  for _ in range(60):
    model, opt_state, loss = train_step(model, opt_state, X, Y)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0]
  assert model.layers[0].weight.dtype == jnp.float32


# --- TensorFlow / Keras migration -------------------------------------------------------

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


@pytest.mark.parametrize(
  "config", [TF_OPTIMIZER_CONFIG, KERAS_OPTIMIZER_CONFIG], ids=["tf", "keras"]
)
def test_train_with_configs_written_by_tensorflow_and_keras(config):
  loss_scale = ols.deserialize(config)
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), loss_scale)

  step = _train_step(tx)

  params = _mlp_params()
  state = tx.init(params)
  scales, applied = [], []
  for _ in range(12):
    params, state = step(params, state)
    scales.append(np.float32(ols.get_loss_scale(state)()))
    applied.append(bool(state.should_apply))
  ref = tf_dynamic_loss_scale(applied, 2.0**15, 3, 2.0)
  assert scales == [s for s, _, _ in ref]
  assert not all(applied) and any(applied)
  assert bool(jnp.all(jnp.isfinite(params["w1"])))


def test_orbax_checkpoint_in_the_0_1_0_layout_restores(tmp_path):
  # 0.1.0's optimizer state had five fields; its DynamicLossScale the same
  # two keyed leaves as a default one today.
  import typing

  class State010(typing.NamedTuple):
    loss_scale: typing.Any
    inner_state: typing.Any
    should_apply: typing.Any
    skipped_steps: typing.Any
    consecutive_skipped_steps: typing.Any

  tx = ols.LossScaleOptimizer(
    optax.adam(1e-2), ols.DynamicLossScale(2.0**15, 4)
  )
  params = _mlp_params()
  new = tx.init(params)
  old = State010(*new[:5])._replace(skipped_steps=jnp.int32(3))
  path = tmp_path / "ckpt010"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, {"params": params, "opt_state": old})
  target = {
    k: v
    for k, v in tx.init(params)._asdict().items()
    if k not in ("nonfinite_loss_steps", "retries", "last_skip")
  }
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(
      path, {"params": params, "opt_state": target}
    )
  state = tx.init(params)._replace(**restored["opt_state"])
  assert int(state.skipped_steps) == 3 and int(state.retries) == 0
  assert isinstance(state.loss_scale, ols.DynamicLossScale)
  _, state = jax.jit(tx.apply_gradients)(
    jax.tree.map(jnp.ones_like, params), state, params
  )
  assert bool(state.should_apply)
