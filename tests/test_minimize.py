"""LossScaleOptimizer.minimize: one train step, retrying overflowed batches."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_lossscale as ols

pytestmark = [
  pytest.mark.usefixtures("standard_promotion"),
  pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

X = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)


def _last_skip(state):
  """The last skip an unbatched state records, or None."""
  reports = ols.skip_reports(state)
  assert len(reports) <= 1 and all(r.member is None for r in reports)
  return reports[0] if reports else None


def _loss(params, x):
  h = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
  return jnp.mean(h.astype(jnp.float32) ** 2) + jnp.sum(params["b"] ** 2)


def _params():
  return {"w": jnp.full((2, 3), 0.5), "b": jnp.ones(3)}


def test_no_retries_equals_scaled_value_and_grad_then_apply_gradients():
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(2.0**15, 3))
  p1 = p2 = _params()
  s1 = s2 = tx.init(p1)

  @jax.jit
  def manual(p, s, x):
    loss, grads = ols.scaled_value_and_grad(_loss)(s, p, x)
    p, s = ols.apply_gradients(tx, grads, s, p, value=loss)
    return loss, p, s

  step = jax.jit(lambda p, s, x: tx.minimize(_loss, p, s, x))
  for i in range(8):
    x = X * (1e4 if i == 2 else 1.0)  # one overflow
    l1, p1, s1 = step(p1, s1, x)
    l2, p2, s2 = manual(p2, s2, x)
    assert float(l1) == float(l2)
    chex.assert_trees_all_equal(s1.loss_scale, s2.loss_scale)
    assert int(s1.skipped_steps) == int(s2.skipped_steps)
  assert int(s1.skipped_steps) >= 1
  chex.assert_trees_all_close((p1, s1), (p2, s2), rtol=1e-6)


def test_retries_recompute_the_batch_at_a_lower_scale_and_apply_it():
  traces, passes = [], []

  def loss(params, x):
    traces.append(1)
    jax.debug.callback(lambda: passes.append(1))
    return _loss(params, x)

  ls = ols.DynamicLossScale(2.0**24, 100, hysteresis=3)
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ls)
  params = _params()
  state = tx.init(params)
  step = jax.jit(
    lambda p, s, x: tx.minimize(loss, p, s, x, max_retries=16),
    donate_argnums=(0, 1),
  )
  value, params, state = step(params, state, X)
  jax.effects_barrier()
  assert len(traces) == 1  # traced once
  retries = int(state.retries)
  assert retries > 0 and len(passes) == retries + 1
  assert int(state.skipped_steps) == 0 and bool(state.should_apply)
  # Each retry halved the scale as TensorFlow does, whatever the hysteresis;
  # the successful attempt then counts as a finite step.
  scale = float(ols.get_loss_scale(state)())
  assert scale == 2.0**24 / 2**retries
  assert int(state.loss_scale.num_good_steps) == 1
  assert int(state.loss_scale.hysteresis_budget) == 3
  # The gradients scaled by that scale were finite; one scale higher was not.
  scaled = jax.grad(lambda p: ols.FixedLossScale(scale).scale(_loss(p, X)))
  assert bool(ols.all_finite(scaled(_params())))
  higher = jax.grad(lambda p: ols.FixedLossScale(2 * scale).scale(_loss(p, X)))
  assert not bool(ols.all_finite(higher(_params())))
  # The next step runs one pass.
  passes.clear()
  _, params, state = step(params, state, X)
  jax.effects_barrier()
  assert len(passes) == 1 and int(state.retries) == retries


def test_retries_stop_at_the_limit_then_skip_under_the_ordinary_rules():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**24))
  params = _params()
  _, new_params, state = tx.minimize(
    _loss, params, tx.init(params), X, max_retries=2
  )
  assert int(state.retries) == 2 and int(state.skipped_steps) == 1
  # Two retries (2**23, 2**22), then the skip halves once more.
  assert float(ols.get_loss_scale(state)()) == 2.0**21
  chex.assert_trees_all_equal(new_params, params)


def test_retries_stop_at_min_loss_scale():
  ls = ols.DynamicLossScale(2.0**24, min_loss_scale=2.0**23)
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ls)
  params = _params()
  _, _, state = tx.minimize(_loss, params, tx.init(params), X, max_retries=8)
  assert int(state.retries) == 1 and int(state.skipped_steps) == 1
  assert float(ols.get_loss_scale(state)()) == 2.0**23


def test_no_retry_when_the_loss_is_not_finite():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**10))
  params = _params()
  state = tx.init(params)
  value, _, state = tx.minimize(
    _loss, params, state, X * jnp.nan, max_retries=8
  )
  assert int(state.retries) == 0 and int(state.skipped_steps) == 1
  assert int(state.nonfinite_loss_steps) == 1
  assert float(ols.get_loss_scale(state)()) == 2.0**10


def test_has_aux_and_kwargs():
  def loss(params, x, *, scale):
    value = _loss(params, x) * scale
    return value, {"double": 2 * value}

  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**20))
  params = _params()
  (value, aux), _, state = jax.jit(
    lambda p, s: tx.minimize(
      loss, p, s, X, scale=2.0, has_aux=True, max_retries=9
    )
  )(params, tx.init(params))
  assert float(aux["double"]) == 2 * float(value)
  assert int(state.skipped_steps) == 0


@pytest.mark.parametrize(
  "loss_scale", [ols.FixedLossScale(8), ols.NoOpLossScale()]
)
def test_max_retries_with_a_loss_scale_that_cannot_be_lowered(loss_scale):
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), loss_scale)
  params = _params()
  with pytest.raises(ValueError, match="max_retries"):
    tx.minimize(_loss, params, tx.init(params), X, max_retries=1)
  tx.minimize(_loss, params, tx.init(params), X)  # max_retries=0 is fine


def test_max_retries_validation():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = _params()
  with pytest.raises(ValueError, match="max_retries"):
    tx.minimize(_loss, params, tx.init(params), X, max_retries=-1)
  with pytest.raises(TypeError, match="max_retries"):
    tx.minimize(_loss, params, tx.init(params), X, max_retries=1.0)
  with pytest.raises(TypeError, match="has_aux"):
    tx.minimize(_loss, params, tx.init(params), X, has_aux=1)


def test_retried_attempts_record_nothing_and_a_dropped_batch_once():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**24))
  monitor = ols.SkipMonitor(max_consecutive_skips=2, log=None)
  params = _params()
  step = jax.jit(
    lambda p, s, x, r: tx.minimize(_loss, p, s, x, max_retries=r),
    static_argnums=3,
  )
  # Retries that end in a finite attempt: no skip, so no record.
  _, _, state = step(params, tx.init(params), X, 16)
  assert _last_skip(state) is None and int(state.retries) > 0
  assert monitor(state) is None
  # Retries that run out: one record, of the last attempt's scale.
  _, new_params, state = step(params, tx.init(params), X, 2)
  report = monitor(state)
  assert report.loss_scale == 2.0**22 and report.next_loss_scale == 2.0**21
  assert report.consecutive_skipped_steps == 1 and report.nonfinite
  assert report.skipped_steps == 1
  chex.assert_trees_all_equal(new_params, params)
  # The next dropped batch (a NaN loss: no retry) is the second in a row.
  _, _, state = step(params, state, X * jnp.nan, 2)
  with pytest.raises(ols.ConsecutiveSkipsError, match="2 consecutive"):
    monitor(state)


def test_retries_that_run_out_then_skip_under_hysteresis():
  # The retries lower the scale whatever the hysteresis; the final skip is
  # an ordinary non-finite step: it spends budget and does not lower.
  ls = ols.DynamicLossScale(2.0**24, hysteresis=2)
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ls)
  params = _params()
  _, new_params, state = tx.minimize(
    _loss, params, tx.init(params), X, max_retries=1
  )
  assert int(state.retries) == 1 and int(state.skipped_steps) == 1
  assert float(ols.get_loss_scale(state)()) == 2.0**23
  assert int(state.loss_scale.hysteresis_budget) == 1
  chex.assert_trees_all_equal(new_params, params)


def test_a_retried_step_updates_the_inner_state_once():
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(2.0**24))
  params = _params()
  _, new_params, state = jax.jit(
    lambda p, s: tx.minimize(_loss, p, s, X, max_retries=16)
  )(params, tx.init(params))
  assert int(state.retries) > 0
  scale = float(ols.get_loss_scale(state)())
  # One Adam step on the gradients of the attempt that worked.
  grads = jax.grad(_loss)(params, X)
  reference = optax.adam(0.1)
  updates, adam_state = reference.update(grads, reference.init(params), params)
  assert int(state.inner_state[0].count) == 1
  chex.assert_trees_all_close(
    new_params, optax.apply_updates(params, updates), rtol=1e-6
  )
  chex.assert_trees_all_close(state.inner_state, adam_state, rtol=1e-6)
  assert scale < 2.0**24


def test_the_retry_loop_carries_parameters_and_state_never_the_gradients():
  # The update runs inside the loop's last iteration: the gradients stay
  # temporaries of one iteration, so a step with retries needs no more memory
  # than one without.
  big = {"w": jnp.zeros((64, 256)), "b": jnp.zeros(256)}
  x = jnp.ones((4, 64))
  loss = lambda p, x: jnp.sum((x @ p["w"] + p["b"][None]) ** 2)  # noqa: E731
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale())
  state = tx.init(big)
  jaxpr = jax.make_jaxpr(
    lambda p, s: tx.minimize(loss, p, s, x, max_retries=4)
  )(big, state)
  (carry,) = [
    [v.aval for v in eqn.outvars]
    for eqn in jaxpr.jaxpr.eqns
    if eqn.primitive.name == "while"
  ]
  expected = (
    2  # attempts, again
    + len(jax.tree.leaves(state.loss_scale))
    + 1  # the loss
    + len(jax.tree.leaves((big, state)))
  )
  assert len(carry) == expected
  compiled = {
    retries: jax.jit(
      lambda p, s, r=retries: tx.minimize(loss, p, s, x, max_retries=r),
      donate_argnums=(0, 1),
    )
    .lower(big, state)
    .compile()
    .memory_analysis()
    for retries in (0, 4)
  }
  assert compiled[4].temp_size_in_bytes <= 1.05 * compiled[0].temp_size_in_bytes


def test_calibration_first_batch_finds_a_workable_scale():
  tx = ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale(2.0**24))
  params = _params()
  state = tx.init(params)
  step = jax.jit(lambda p, s: tx.minimize(_loss, p, s, X, max_retries=16))
  for _ in range(20):
    _, params, state = step(params, state)
  assert int(state.skipped_steps) == 0 and int(state.retries) > 0


def test_nnx_functional_step_with_minimize():
  # The frameworks guide's NNX recipe: split the model, minimize a pure function of the
  # parameters, merge back.
  class Model(nnx.Module):
    def __init__(self, rngs):
      kw = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
      self.hidden = nnx.Linear(2, 8, **kw)
      self.out = nnx.Linear(8, 1, **kw)

    def __call__(self, x):
      return self.out(jnp.tanh(self.hidden(x)))

  model = Model(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale(2.0**24))
  opt_state = tx.init(params)
  y = jnp.sin(X[:, :1] * 3)

  def loss_fn(params, x, y):
    model = nnx.merge(graphdef, params)
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)

  @jax.jit
  def train_step(params, opt_state, x, y):
    return tx.minimize(loss_fn, params, opt_state, x, y, max_retries=16)

  losses = []
  for _ in range(50):
    loss, params, opt_state = train_step(params, opt_state, X, y)
    losses.append(float(loss))
  nnx.update(model, params)
  assert losses[-1] < 0.5 * losses[0]
  assert int(opt_state.skipped_steps) == 0
  np.testing.assert_array_equal(
    model.out.kernel.value, params["out"]["kernel"].value
  )


def test_linen_train_state_with_minimize():
  # The frameworks guide's linen recipe: TrainState holds the optimizer itself.
  from flax import linen as nn
  from flax.training import train_state

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(8, dtype=jnp.float16, param_dtype=jnp.float32)(x)
      return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(x)

  model = Model()
  tx = ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale(2.0**24))
  state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.PRNGKey(0), X)["params"],
    tx=tx,
  )
  y = jnp.sin(X[:, :1] * 3)

  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      pred = state.apply_fn({"params": params}, x).astype(jnp.float32)
      return jnp.mean((pred - y) ** 2)

    loss, params, opt_state = state.tx.minimize(
      loss_fn, state.params, state.opt_state, max_retries=4
    )
    return state.replace(
      step=state.step + 1, params=params, opt_state=opt_state
    ), loss

  losses = []
  for _ in range(40):
    state, loss = train_step(state, X, y)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0] and int(state.step) == 40
