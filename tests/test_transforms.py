"""unscale_gradients, loss_scale_optimizer, get_loss_scale and the helper."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_lossscale as ols

pytestmark = pytest.mark.usefixtures("standard_promotion")


def _last_skip(state):
  """The last skip an unbatched state records, or None."""
  reports = ols.skip_reports(state)
  assert len(reports) <= 1 and all(r.member is None for r in reports)
  return reports[0] if reports else None


def _sgd_step(tx, params, loss_fn, state):
  loss, grads = ols.scaled_value_and_grad(loss_fn)(state, params)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state, grads


# --- TensorFlow's optimizer test vectors ------------------------------------


def test_tf_fixed_scale_sgd():
  tx = ols.loss_scale_optimizer(optax.sgd(2.0), ols.FixedLossScale(10))
  params = jnp.array(5.0)
  state = tx.init(params)
  params, state, grads = _sgd_step(tx, params, lambda v: v, state)
  assert float(grads) == 10.0  # the gradient seen is the scaled one
  assert float(params) == 3.0


def test_tf_dynamic_scale_sgd():
  tx = ols.loss_scale_optimizer(optax.sgd(2.0), ols.DynamicLossScale(2, 1, 2))
  params = jnp.array(5.0)
  state = tx.init(params)
  seen = [(float(params), float(ols.get_loss_scale(state)()))]
  for _ in range(2):
    params, state, _ = _sgd_step(tx, params, lambda v: v, state)
    seen.append((float(params), float(ols.get_loss_scale(state)())))
  assert seen == [(5, 2), (3, 4), (1, 8)]


def test_tf_nan_step_leaves_variables_and_halves_scale():
  tx = ols.loss_scale_optimizer(optax.sgd(2.0), ols.DynamicLossScale(2, 1, 2))
  params = jnp.array(5.0)
  state = tx.init(params)
  params, state, _ = _sgd_step(tx, params, lambda v: v * jnp.nan, state)
  assert float(params) == 5.0
  assert float(ols.get_loss_scale(state)()) == 1.0
  assert not bool(state.should_apply)


def test_tf_momentum_dynamic_scale():
  tx = ols.loss_scale_optimizer(
    optax.sgd(1.0, momentum=1.0), ols.DynamicLossScale(2, 1, 4)
  )
  params = jnp.array([1.0, 2.0])
  state = tx.init(params)
  trace = [(params.tolist(), float(ols.get_loss_scale(state)()))]
  for _ in range(2):
    params, state, _ = _sgd_step(tx, params, jnp.sum, state)
    trace.append((params.tolist(), float(ols.get_loss_scale(state)())))
  assert trace == [([1, 2], 2), ([0, 1], 8), ([-2, -1], 32)]


# --- skipping -----------------------------------------------------------------


def _tree(dtype=jnp.float32):
  return {
    "w": jnp.linspace(-1, 1, 12).reshape(3, 4).astype(dtype),
    "b": jnp.zeros((4,), dtype),
  }


def test_skipped_step_keeps_inner_state_bit_for_bit_and_returns_zeros():
  tx = ols.loss_scale_optimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
  params = _tree()
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  _, state = tx.update(grads, state, params)  # one applied step
  bad = dict(grads, b=grads["b"].at[2].set(jnp.inf))
  updates, new_state = jax.jit(tx.update)(bad, state, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
  assert int(new_state.skipped_steps) == 1
  assert int(new_state.consecutive_skipped_steps) == 1
  assert float(new_state.loss_scale()) == 4.0


def test_counters_count_skips_and_reset_consecutive_on_apply():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0))
  params = _tree()
  state = tx.init(params)
  update = jax.jit(tx.update)
  pattern = [False, False, True, False, True, True, False, False, False]
  for finite in pattern:
    value = 1.0 if finite else jnp.nan
    _, state = update(
      jax.tree.map(lambda p, v=value: jnp.full_like(p, v), params),
      state,
      params,
    )
  assert state.skipped_steps.dtype == jnp.int32
  assert int(state.skipped_steps) == pattern.count(False)
  assert int(state.consecutive_skipped_steps) == 3


@pytest.mark.parametrize(
  "loss_scale", [ols.FixedLossScale(2), ols.NoOpLossScale()], ids=repr
)
def test_fixed_and_noop_scales_skip_nonfinite_by_default_but_not_when_asked(
  loss_scale,
):
  # Their own `update` always applies; the optimizer skips all the same.
  grads = {"w": jnp.array([jnp.nan, 1.0])}
  assert bool(loss_scale.update(grads)[1])
  params = {"w": jnp.zeros(2)}
  skipping = ols.loss_scale_optimizer(optax.sgd(1.0), loss_scale)
  updates, state = skipping.update(grads, skipping.init(params), params)
  assert not bool(state.should_apply)
  np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
  tf_exact = ols.loss_scale_optimizer(
    optax.sgd(1.0), loss_scale, skip_nonfinite=False
  )
  updates, state = tf_exact.update(grads, tf_exact.init(params), params)
  assert bool(state.should_apply) and bool(jnp.isnan(updates["w"][0]))


def test_unscaled_overflow_is_caught_when_scale_is_below_one():
  loss_scale = ols.DynamicLossScale(0.5, 1, 2.0, min_loss_scale=0.5)
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), loss_scale)
  grads = {"w": jnp.array([60000.0], jnp.float16)}  # finite, 2x is not
  _, state = tx.update(grads, tx.init(grads))
  assert not bool(state.should_apply)


def test_unscale_gradients_reports_and_does_not_skip():
  tx = optax.chain(
    ols.unscale_gradients(ols.DynamicLossScale(4.0)), optax.sgd(1.0)
  )
  params = {"w": jnp.ones(2), "n": None}
  state = tx.init(params)
  updates, state = tx.update(
    {"w": jnp.array([8.0, 4.0]), "n": None}, state, params
  )
  assert updates["n"] is None
  np.testing.assert_array_equal(updates["w"], [-2.0, -1.0])
  assert isinstance(state[0], ols.UnscaleGradientsState)
  assert bool(state[0].should_apply)
  updates, state = tx.update(
    {"w": jnp.array([jnp.inf, 4.0]), "n": None}, state, params
  )
  assert not bool(state[0].should_apply)
  assert bool(jnp.isinf(updates["w"][0]))  # it reports; it does not skip
  assert float(ols.get_loss_scale(state)()) == 2.0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_gradients_keep_their_dtype(dtype):
  params = _tree(dtype)
  grads = jax.tree.map(
    lambda p: jnp.ones_like(p) * jnp.asarray(64, dtype), params
  )
  loss_scale = ols.FixedLossScale(64)
  unscaled, _ = ols.unscale_gradients(loss_scale).update(
    grads, ols.unscale_gradients(loss_scale).init(params)
  )
  chex.assert_trees_all_equal_dtypes(unscaled, params)
  chex.assert_trees_all_equal(unscaled, jax.tree.map(jnp.ones_like, params))
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), loss_scale)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  chex.assert_trees_all_equal_dtypes(updates, params)


# --- composition ---------------------------------------------------------------


def test_clipping_in_the_inner_chain_sees_unscaled_gradients():
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  tx = ols.loss_scale_optimizer(inner, ols.FixedLossScale(1024))
  params = {"w": jnp.zeros(2)}
  grads = {"w": jnp.array([0.3, 0.4]) * 1024}  # unscaled norm 0.5 < 1
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)


def _clipped_steps(where: str, initial_scale: float) -> list[np.ndarray]:
  """Three sgd(1) steps, clipped to global norm 1, from gradients [3, 4]."""
  clip = optax.clip_by_global_norm(1.0)
  loss_scale = ols.DynamicLossScale(initial_scale, increment_period=1)
  if where == "inside":
    tx = ols.loss_scale_optimizer(optax.chain(clip, optax.sgd(1.0)), loss_scale)
  else:
    tx = optax.chain(clip, ols.loss_scale_optimizer(optax.sgd(1.0), loss_scale))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  steps = []
  for _ in range(3):  # The scale doubles every step.
    grads = {"w": jnp.array([3.0, 4.0]) * ols.get_loss_scale(state)()}
    updates, state = update(grads, state, params)
    steps.append(np.asarray(updates["w"]))
  return steps


@pytest.mark.parametrize("initial_scale", [1.0, 2.0**10, 2.0**15])
def test_clipping_before_the_loss_scale_optimizer_shrinks_steps_by_the_scale(
  initial_scale,
):
  # The gradient [3, 4] has norm 5: clipped to norm 1, the step is -[.6, .8].
  intended = np.array([-0.6, -0.8], np.float32)
  inside = _clipped_steps("inside", initial_scale)
  before = _clipped_steps("before", initial_scale)
  for i in range(3):
    np.testing.assert_allclose(inside[i], intended, rtol=1e-6)
    # Before, the clip sees the scaled gradients, of norm 5 * scale: the
    # step is `scale` times too small, and shrinks as the scale grows.
    scale = initial_scale * 2**i
    np.testing.assert_allclose(before[i], intended / scale, rtol=1e-6)


def test_multisteps_inside_drops_only_the_bad_micro_batch():
  # Recommended: loss_scale_optimizer(MultiSteps(...)). The accumulator holds
  # unscaled gradients; a non-finite micro-batch is dropped alone and never
  # reaches it.
  tx = ols.loss_scale_optimizer(
    optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2),
    ols.DynamicLossScale(8.0, 100),
  )
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  scales = []
  for value in [1.0, jnp.nan, 3.0, 1.0, 1.0]:
    grads = {"w": jnp.full((2,), value) * ols.get_loss_scale(state)()}
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    acc = state.inner_state.acc_grads["w"]
    assert bool(jnp.all(jnp.isfinite(acc)))
    assert bool(jnp.all(jnp.isfinite(params["w"])))
    scales.append(float(ols.get_loss_scale(state)()))
  # Windows: (1, 3) -> mean 2, then (1, 1) -> mean 1.
  np.testing.assert_array_equal(params["w"], [-2.0, -2.0])
  # The NaN backs off at once; finite micro-batches hold the scale until a
  # window completes (increment_period=100 windows: no growth here).
  assert scales == [8, 4, 4, 4, 4]
  assert int(state.skipped_steps) == 1
  assert int(state.inner_state.gradient_step) == 2


def test_multisteps_accepts_the_gradient_transformation_too():
  inner = optax.MultiSteps(optax.adam(0.1), 4).gradient_transformation()
  tx = ols.loss_scale_optimizer(inner, ols.FixedLossScale(4))
  params = {"w": jnp.ones(2)}
  updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  assert int(state.inner_state.mini_step) == 1


def test_schedule_does_not_advance_on_skipped_steps():
  schedule = optax.linear_schedule(1.0, 0.0, 10)
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
  tx = ols.loss_scale_optimizer(inner, ols.DynamicLossScale(4.0))
  params = {"w": jnp.zeros(1)}
  state = tx.init(params)
  for value in [1.0, jnp.nan, jnp.nan, 1.0]:
    _, state = tx.update({"w": jnp.full((1,), value)}, state, params)
  # Two applied steps: the stored rate is the schedule's at count 1.
  assert int(state.inner_state.count) == 2
  assert float(state.inner_state.hyperparams["learning_rate"]) == float(
    schedule(1)
  )


def test_extra_args_reach_the_inner_transformation():
  seen = {}

  def update(updates, state, params=None, *, value=None):
    seen["value"] = value
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: (), update)
  tx = ols.loss_scale_optimizer(inner, ols.NoOpLossScale())
  tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}), value=3.0)
  assert seen["value"] == 3.0


# --- pairings of unscale_gradients with a skip -----------------------------------


def _own_skip_step(loss_scale):
  # The train-step guide's own skip after `unscale_gradients`.
  tx = optax.chain(ols.unscale_gradients(loss_scale), optax.sgd(1.0))

  def train_step(params, opt_state, grads):
    updates, new_state = tx.update(grads, opt_state, params)
    params, rest = jax.lax.cond(
      new_state[0].should_apply,
      lambda: (optax.apply_updates(params, updates), new_state[1:]),
      lambda: (params, opt_state[1:]),
    )
    return params, (new_state[0], *rest)

  return tx, train_step


def _update_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, step


def _fused_step(tx):
  return tx, lambda params, state, grads: tx.apply_gradients(
    grads, state, params
  )


BACKING_OFF = {
  "LossScaleOptimizer": lambda ls: _fused_step(
    ols.LossScaleOptimizer(optax.sgd(1.0), ls)
  ),
  "loss_scale_optimizer": lambda ls: _update_step(
    ols.loss_scale_optimizer(optax.sgd(1.0), ls)
  ),
  "chain_then_apply_if_finite": lambda ls: _update_step(
    optax.chain(
      ols.unscale_gradients(ls),
      optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=100),
    )
  ),
  "own_lax_cond": _own_skip_step,
}

STALLING = {
  "multisteps_skip_not_finite": lambda ls: _update_step(
    optax.MultiSteps(
      optax.chain(ols.unscale_gradients(ls), optax.sgd(1.0)),
      every_k_schedule=1,
      should_skip_update_fn=optax.skip_not_finite,
    ).gradient_transformation()
  ),
  "apply_if_finite_of_the_chain": lambda ls: _update_step(
    optax.apply_if_finite(
      optax.chain(ols.unscale_gradients(ls), optax.sgd(1.0)),
      max_consecutive_errors=100,
    )
  ),
}


def _scales_over_nan_steps(pairing, steps=3):
  tx, step = pairing(ols.DynamicLossScale())
  step = jax.jit(step)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  scales = []
  for _ in range(steps):
    params, state = step(params, state, {"w": jnp.array([jnp.nan, 1.0])})
    scales.append(float(ols.get_loss_scale(state)()))
  return params, state, step, scales


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("pairing", BACKING_OFF)
def test_pairings_that_skip_after_unscale_gradients_back_off(pairing):
  params, state, step, scales = _scales_over_nan_steps(BACKING_OFF[pairing])
  assert scales == [2.0**14, 2.0**13, 2.0**12]
  np.testing.assert_array_equal(params["w"], [1.0, 1.0])  # nothing applied
  grads = {"w": jnp.full(2, 2.0**12)}  # 1 once unscaled
  params, state = step(params, state, grads)
  np.testing.assert_array_equal(params["w"], [0.0, 0.0])


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("pairing", STALLING)
def test_pairings_that_skip_before_unscale_gradients_stall_the_scale(pairing):
  # What the docs warn about: unscale_gradients is never called on the
  # skipped steps, so the scale never backs off.
  params, _, _, scales = _scales_over_nan_steps(STALLING[pairing])
  assert scales == [2.0**15] * 3
  np.testing.assert_array_equal(params["w"], [1.0, 1.0])


# --- jit, scan, donation ---------------------------------------------------------


def _train_setup(n=8):
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (n, 4))
  y = x @ jnp.array([1.0, -2.0, 0.5, 3.0])
  params = {"w": jnp.zeros(4), "b": jnp.zeros(())}

  def loss_fn(p, x, y):
    pred = x.astype(jnp.float16) @ p["w"].astype(jnp.float16) + p["b"].astype(
      jnp.float16
    )
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  return params, x, y, loss_fn


def test_train_step_under_jit_does_not_retrace_and_donates():
  params, x, y, loss_fn = _train_setup()
  tx = ols.loss_scale_optimizer(
    optax.adam(0.05), ols.DynamicLossScale(2**15, 5)
  )

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, x, y):
    loss, grads = ols.scaled_value_and_grad(loss_fn)(state, params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  donated = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
  state = tx.init(params)
  losses = []
  params0 = params
  for _ in range(200):
    params, state, loss = donated(params, state, x, y)
    losses.append(float(loss))
  assert losses[-1] < 0.05 * losses[0]
  assert params0["w"].is_deleted()  # donated, and updated in place
  state = tx.init(jax.tree.map(jnp.zeros_like, params))  # init still works
  for _ in range(3):
    params, state, _ = step(params, state, x, y)


def test_state_keeps_shapes_and_dtypes_through_scan_and_cond():
  params, x, y, loss_fn = _train_setup()
  tx = ols.loss_scale_optimizer(
    optax.adam(0.05), ols.DynamicLossScale(2**15, 5)
  )
  state = tx.init(params)

  def body(carry, _):
    params, state = carry
    _, grads = ols.scaled_value_and_grad(loss_fn)(state, params, x, y)
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), state.should_apply

  (new_params, new_state), applied = jax.jit(
    lambda c: lax.scan(body, c, None, length=300)
  )((params, state))
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
  chex.assert_trees_all_equal_shapes_and_dtypes(new_params, params)
  assert int(new_state.skipped_steps) == int(jnp.sum(~applied))
  assert int(new_state.skipped_steps) > 0  # 2**15 overflows float16 at first
  cond_state = lax.cond(True, lambda s: s, lambda s: s, new_state)
  chex.assert_trees_all_equal_shapes_and_dtypes(cond_state, state)


def test_optax_tree_helpers_on_the_state():
  tx = ols.loss_scale_optimizer(optax.adam(0.1), ols.DynamicLossScale(16.0))
  params = _tree()
  state = tx.init(params)
  loss_scale = optax.tree.get(state, "loss_scale")
  assert isinstance(loss_scale, ols.DynamicLossScale)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 16.0, params)
  _, state = tx.update(grads, state, params)  # moments become non-zero
  bad = jax.tree.map(lambda g: g * jnp.nan, grads)
  _, state = tx.update(bad, state, params)  # and a skip is recorded
  doubled = optax.tree.map_params(tx.init, lambda p: p * 2, state)
  assert type(doubled) is ols.LossScaleOptimizerState
  assert float(doubled.loss_scale()) == 8.0  # not a parameter: untouched
  chex.assert_trees_all_equal(
    doubled.inner_state[0].mu,
    jax.tree.map(lambda m: m * 2, state.inner_state[0].mu),
  )
  chex.assert_trees_all_equal(doubled.last_skip, state.last_skip)


def test_jaxpr_has_one_cond_and_no_select_over_arrays():
  params = {f"p{i}": jnp.ones((8, 8)) for i in range(20)}
  tx = ols.loss_scale_optimizer(optax.adam(0.1), ols.DynamicLossScale())
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(tx.update)(params, state, params).jaxpr
  conds = [e for e in jaxpr.eqns if e.primitive is lax.cond_p]
  assert len(conds) == 1
  selects = [
    e
    for e in jaxpr.eqns
    if e.primitive is lax.select_n_p and e.outvars[0].aval.shape != ()
  ]
  assert selects == []


# --- get_loss_scale --------------------------------------------------------------


@pytest.mark.parametrize(
  "make",
  [
    lambda ls: optax.chain(
      optax.identity(),
      ols.loss_scale_optimizer(
        optax.chain(optax.clip(1.0), optax.sgd(0.1)), ls
      ),
    ),
    lambda ls: optax.chain(ols.unscale_gradients(ls), optax.adam(0.1)),
    lambda ls: optax.MultiSteps(
      ols.loss_scale_optimizer(optax.adam(0.1), ls), 4
    ),
    lambda ls: optax.inject_hyperparams(
      lambda learning_rate: optax.chain(
        ols.unscale_gradients(ls), optax.sgd(learning_rate)
      )
    )(0.1),
    lambda ls: optax.multi_transform(
      {
        "a": ols.loss_scale_optimizer(optax.sgd(0.1), ls),
        "b": optax.set_to_zero(),
      },
      {"w": "a", "b": "b"},
    ),
  ],
  ids=["chain", "unscale-chain", "multisteps", "inject", "multi_transform"],
)
def test_get_loss_scale_finds_nested_states(make):
  loss_scale = ols.DynamicLossScale(64.0)
  state = make(loss_scale).init({"w": jnp.ones(2), "b": jnp.ones(1)})
  assert float(ols.get_loss_scale(state)()) == 64.0


def test_get_loss_scale_raises_on_none_or_many():
  with pytest.raises(ValueError, match="found 0"):
    ols.get_loss_scale(optax.adam(0.1).init(jnp.ones(1)))
  two = optax.chain(
    ols.unscale_gradients(ols.FixedLossScale(2)),
    ols.unscale_gradients(ols.FixedLossScale(4)),
  )
  with pytest.raises(ValueError, match="found 2"):
    ols.get_loss_scale(two.init(jnp.ones(1)))


# --- the forward/backward helper ------------------------------------------------


def test_scaled_value_and_grad_returns_unscaled_value_aux_and_scaled_grads():
  def loss_fn(w, x):
    loss = jnp.sum((w * x) ** 2)
    return loss, {"norm": jnp.sum(w)}

  w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
  (loss, aux), grads = ols.scaled_value_and_grad(loss_fn, has_aux=True)(
    ols.FixedLossScale(8), w, x
  )
  assert float(loss) == 73.0 and float(aux["norm"]) == 3.0
  np.testing.assert_array_equal(
    grads, 8 * jax.grad(lambda w: loss_fn(w, x)[0])(w)
  )
  _, (gw, gx) = ols.scaled_value_and_grad(
    lambda w, x: loss_fn(w, x)[0], argnums=(0, 1)
  )(ols.FixedLossScale(2), w, x)
  assert gw.shape == gx.shape == (2,)


def test_scaled_value_and_grad_rejects_non_callables():
  with pytest.raises(TypeError, match="fun"):
    ols.scaled_value_and_grad(3)  # type: ignore[arg-type]


# --- bad input ------------------------------------------------------------------


def test_rejects_inner_that_is_not_an_optax_transformation():
  with pytest.raises(TypeError, match="inner"):
    ols.loss_scale_optimizer(lambda g: g, ols.FixedLossScale(2))
  with pytest.raises(TypeError, match="inner"):
    ols.loss_scale_optimizer(optax.adam, ols.FixedLossScale(2))


@pytest.mark.parametrize("bad", [2.0, "dynamic", None, optax.adam(0.1)])
def test_rejects_loss_scale_that_is_not_a_loss_scale(bad):
  with pytest.raises(TypeError, match="loss_scale"):
    ols.loss_scale_optimizer(optax.adam(0.1), bad)
  with pytest.raises(TypeError, match="loss_scale"):
    ols.unscale_gradients(bad)


def test_rejects_gradients_whose_structure_does_not_match():
  tx = ols.loss_scale_optimizer(optax.adam(0.1), ols.FixedLossScale(2))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  with pytest.raises(ValueError, match="updates"):
    tx.update({"v": jnp.ones(2)}, state, params)
  tx2 = ols.unscale_gradients(ols.FixedLossScale(2))
  with pytest.raises(ValueError, match="updates"):
    tx2.update([jnp.ones(2)], tx2.init(params), params)


def test_rejects_a_foreign_state():
  tx = ols.loss_scale_optimizer(optax.adam(0.1), ols.FixedLossScale(2))
  with pytest.raises(TypeError, match="LossScaleOptimizerState"):
    tx.update({"w": jnp.ones(2)}, optax.adam(0.1).init({"w": jnp.ones(2)}))


def _with_integer_leaf(nan=False):
  params = {"w": jnp.ones(2), "n": jnp.arange(3)}
  grads = {"w": jnp.array([8.0, jnp.nan if nan else 4.0]), "n": jnp.arange(3)}
  return params, grads


def test_unscale_gradients_passes_integer_leaves_through():
  tx = optax.chain(
    ols.unscale_gradients(ols.DynamicLossScale(4.0)), optax.identity()
  )
  params, grads = _with_integer_leaf()
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], [2.0, 1.0])
  assert updates["n"].dtype == jnp.int32
  np.testing.assert_array_equal(updates["n"], grads["n"])


@pytest.mark.parametrize("nan", [False, True])
def test_optimizer_passes_integer_leaves_through(nan):
  tx = ols.LossScaleOptimizer(optax.identity(), ols.DynamicLossScale(4.0))
  params, grads = _with_integer_leaf(nan)
  state = tx.init(params)
  updates, new = jax.jit(tx.update)(grads, state, params)
  assert updates["n"].dtype == jnp.int32
  np.testing.assert_array_equal(updates["n"], 0 if nan else grads["n"])
  new_params, new = jax.jit(tx.apply_gradients)(grads, state, params)
  assert new_params["n"].dtype == jnp.int32
  np.testing.assert_array_equal(
    new_params["n"], params["n"] + (0 if nan else grads["n"])
  )
  assert bool(new.should_apply) is not nan
  # The skip record flags the float leaf's NaN, and not the integer leaf.
  if nan:
    np.testing.assert_array_equal(new.last_skip.nonfinite, [False, True])
    assert _last_skip(new).nonfinite == ("['w']",)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_wrapper_is_clean_under_strict_promotion(dtype):
  with jax.numpy_dtype_promotion("strict"):
    params = _tree(dtype)
    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
    for loss_scale in [ols.DynamicLossScale(), ols.FixedLossScale(3.0)]:
      for tx in [
        ols.loss_scale_optimizer(optax.sgd(0.5), loss_scale),
        optax.chain(ols.unscale_gradients(loss_scale), optax.sgd(0.5)),
      ]:
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        chex.assert_trees_all_equal_dtypes(updates, params)


def test_skips_a_nan_in_a_large_leaf():
  params = {"big": jnp.zeros((1_000_000,)), "small": jnp.zeros((3,))}
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(8.0))
  grads = {
    "big": jnp.ones((1_000_000,)).at[777_777].set(jnp.nan),
    "small": jnp.ones((3,)),
  }
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert not bool(state.should_apply)
  assert not bool(jnp.any(updates["big"]))


# --- apply_gradients -----------------------------------------------------------


def _grad_sequence(params, n=12, seed=0):
  rng = np.random.RandomState(seed)
  for t in range(n):
    grads = jax.tree.map(
      lambda p: jnp.asarray(rng.randn(*p.shape) * 64, p.dtype), params
    )
    if t % 4 == 2:
      grads["b"] = grads["b"].at[1].set(jnp.inf)
    yield grads


@pytest.mark.parametrize(
  "inner",
  [optax.adam(1e-2), optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)],
  ids=["adam", "multisteps"],
)
def test_apply_gradients_matches_update_then_apply_updates(inner):
  tx = ols.loss_scale_optimizer(inner, ols.DynamicLossScale(64.0, 2))
  params = _tree()
  fused = jax.jit(
    lambda g, s, p: ols.apply_gradients(tx, g, s, p), donate_argnums=(1, 2)
  )

  @jax.jit
  def separate(g, s, p):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  p1, s1 = params, tx.init(params)
  p2, s2 = jax.tree.map(jnp.copy, (params, s1))
  for grads in _grad_sequence(params):
    p1, s1 = separate(grads, s1, p1)
    p2, s2 = fused(grads, s2, p2)
  assert int(s1.skipped_steps) == 3
  chex.assert_trees_all_close(p2, p1, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(s2, s1, rtol=1e-6, atol=1e-7)


def test_apply_gradients_skip_leaves_params_untouched():
  tx = ols.loss_scale_optimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
  params = _tree()
  state = tx.init(params)
  bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
  new_params, new_state = jax.jit(
    lambda g, s, p: ols.apply_gradients(tx, g, s, p)
  )(bad, state, params)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert int(new_state.skipped_steps) == 1


def test_apply_gradients_puts_the_parameter_update_inside_the_cond():
  tx = ols.loss_scale_optimizer(optax.adam(0.1), ols.DynamicLossScale())
  params = {f"p{i}": jnp.ones((8, 8)) for i in range(6)}
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(lambda g, s, p: ols.apply_gradients(tx, g, s, p))(
    params, state, params
  ).jaxpr
  (cond,) = [e for e in jaxpr.eqns if e.primitive is lax.cond_p]
  big_outputs = [v for v in cond.outvars if v.aval.shape == (8, 8)]
  # New parameters, and Adam's two moments: no separate updates.
  assert len(big_outputs) == 3 * len(params)
  assert not [
    e
    for e in jaxpr.eqns
    if e.primitive is lax.select_n_p and e.outvars[0].aval.shape != ()
  ]
  adds = [
    e
    for e in jaxpr.eqns
    if e.primitive is lax.add_p and e.outvars[0].aval.shape == (8, 8)
  ]
  assert adds == []  # apply_updates happens in the cond


def test_apply_gradients_falls_back_for_other_transformations():
  params = {"w": jnp.ones(2)}
  for tx in [
    optax.sgd(1.0),
    optax.chain(ols.unscale_gradients(ols.FixedLossScale(2)), optax.sgd(1.0)),
  ]:
    new_params, _ = ols.apply_gradients(
      tx, {"w": jnp.array([2.0, 4.0])}, tx.init(params), params
    )
    assert new_params["w"].shape == (2,)
  with pytest.raises(TypeError, match="tx"):
    ols.apply_gradients(optax.sgd, {}, (), {})
