"""`minimize` and `scaled_value_and_grad`: one train step, retrying overflows.

The one rule for retries and hysteresis: a batch recomputed at lower scales
is one non-finite step for the loss scale. It spends one unit of hysteresis
budget and keeps the scale while budget remains; once none remains, the
scale drops to the scale the batch fit at (or, if it never fit, one below
its last attempt).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_lossscale as ols

pytestmark = pytest.mark.usefixtures("standard_promotion")

X = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)


def _loss(params, x):
  """Finite, but its float16 gradients overflow at scales above 2**17."""
  h = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
  return jnp.mean(h.astype(jnp.float32) ** 2) + jnp.sum(params["b"] ** 2)


def _params():
  return {"w": jnp.full((2, 3), 0.5), "b": jnp.ones(3)}


FIT = 2.0**17  # the highest power of two at which `_loss` fits on X


@jax.jit
def _fits(scale):
  loss_scale = ols.DynamicLossScale(1.0, current_loss_scale=scale)
  grads = jax.grad(lambda p: loss_scale.scale(_loss(p, X)))(_params())
  return ols.all_finite(grads)


def test_fit_is_the_highest_scale_that_fits():
  assert bool(_fits(jnp.float32(FIT))) and not bool(_fits(jnp.float32(2 * FIT)))


@jax.jit
def _sgd_step(params):
  """One sgd(0.1) step on `_loss`'s true gradients."""
  grads = jax.grad(_loss)(params, X)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@functools.cache
def _retrying(hysteresis, max_retries):
  """An optimizer and its jitted `minimize` step on X, compiled once."""
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**24, 100, hysteresis=hysteresis)
  )
  step = jax.jit(
    lambda p, s, x: tx.minimize(_loss, p, s, x, max_retries=max_retries)
  )
  return tx, step


# --- without retries -----------------------------------------------------------


def test_minimize_is_scaled_value_and_grad_then_apply_gradients():
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1, momentum=0.9), ols.DynamicLossScale(2.0**15, 3)
  )
  p1 = p2 = _params()
  s1 = s2 = tx.init(p1)

  @jax.jit
  def manual(p, s, x):
    loss, grads = ols.scaled_value_and_grad(_loss)(s, p, x)
    p, s = tx.apply_gradients(grads, s, p, value=loss)
    return loss, p, s

  step = jax.jit(lambda p, s, x: tx.minimize(_loss, p, s, x))
  for i in range(5):
    x = X * (1e4 if i == 2 else 1.0)  # one overflow
    l1, p1, s1 = step(p1, s1, x)
    l2, p2, s2 = manual(p2, s2, x)
    assert float(l1) == float(l2)
    chex.assert_trees_all_equal(s1.loss_scale, s2.loss_scale)
  assert int(s1.skipped_steps) == 1 == int(s2.skipped_steps)
  chex.assert_trees_all_close((p1, s1), (p2, s2), rtol=1e-6)


def test_has_aux_and_keyword_arguments_reach_fun():
  def loss(params, x, *, scale):
    value = _loss(params, x) * scale
    return value, {"double": 2 * value}

  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**10))
  params = _params()
  (value, aux), _, state = jax.jit(
    lambda p, s: tx.minimize(
      loss, p, s, X, scale=2.0, has_aux=True, max_retries=2
    )
  )(params, tx.init(params))
  assert float(aux["double"]) == 2 * float(value) > 0
  assert int(state.skipped_steps) == 0


# --- retries and hysteresis: the one rule -----------------------------------------


def test_retries_recompute_the_batch_in_one_trace_and_apply_it():
  traces, passes = [], []

  def loss(params, x):
    traces.append(1)
    jax.debug.callback(lambda: passes.append(1))
    return _loss(params, x)

  # Momentum: a second update of the inner state would show in its trace.
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1, momentum=0.9), ols.DynamicLossScale(2.0**24, 100)
  )
  params = _params()
  fresh = tx.init(params)
  step = jax.jit(
    lambda p, s, x: tx.minimize(loss, p, s, x, max_retries=16),
    donate_argnums=(0, 1),
  )
  value, new_params, state = step(params, tx.init(params), X)
  jax.effects_barrier()
  assert len(traces) == 1  # `fun` is traced once
  assert int(state.retries) == 7 and len(passes) == 8  # 2**24 down to 2**17
  assert int(state.skipped_steps) == 0 and bool(state.should_apply)
  np.testing.assert_allclose(value, _loss(_params(), X), rtol=1e-6)
  # The attempt that fit is applied once, as sgd on the true gradients.
  chex.assert_trees_all_close(new_params, _sgd_step(_params()), rtol=1e-6)
  chex.assert_trees_all_close(
    state.inner_state[0].trace, jax.grad(_loss)(_params(), X), rtol=1e-6
  )
  # Retried attempts write no skip record.
  assert ols.skip_reports(state) == []
  chex.assert_trees_all_equal(state.last_skip, fresh.last_skip)
  # The scale moves as for one overflowed step: one halving, not to FIT.
  assert float(state.loss_scale()) == 2.0**23
  assert int(state.loss_scale.num_good_steps) == 0
  assert int(state.loss_scale.num_bad_steps) == 1
  passes.clear()
  _, _, state = step(new_params, state, X)  # from 2**23: six retries
  jax.effects_barrier()
  assert len(passes) == 7 and int(state.retries) == 7 + 6
  assert float(state.loss_scale()) == 2.0**22


def test_retried_batches_move_the_scale_as_overflowed_steps_do():
  # DynamicLossScale(2**24, hysteresis=3), three bad batches: each one is
  # applied at FIT; the scale moves as three overflowed steps move it: the
  # first two spend budget and keep 2**24, the third halves it.
  tx, step = _retrying(hysteresis=3, max_retries=20)
  params = _params()  # the same batch and parameters every time
  expected = _sgd_step(params)
  state = tx.init(params)
  seen = []
  for _ in range(3):
    _, new_params, state = step(params, state, X)
    chex.assert_trees_all_close(new_params, expected, rtol=1e-6)
    ls = state.loss_scale
    seen.append((float(ls()), int(ls.num_bad_steps), int(ls.num_good_steps)))
  assert seen == [(2.0**24, 1, 0), (2.0**24, 2, 0), (2.0**23, 3, 0)]
  assert int(state.skipped_steps) == 0 and int(state.retries) == 3 * 7


@pytest.mark.parametrize(
  ("hysteresis", "scale", "bad"), [(1, 2.0**23, 1), (3, 2.0**24, 1)]
)
def test_a_batch_that_never_fits_is_skipped_under_the_same_rule(
  hysteresis, scale, bad
):
  # Two retries (2**23, 2**22), then the batch is dropped: for the loss scale
  # one overflowed step.
  tx, step = _retrying(hysteresis, max_retries=2)
  params = _params()
  _, new_params, state = step(params, tx.init(params), X)
  assert int(state.retries) == 2 and int(state.skipped_steps) == 1
  assert not bool(state.should_apply)
  assert float(state.loss_scale()) == scale
  assert int(state.loss_scale.num_bad_steps) == bad
  chex.assert_trees_all_equal(new_params, params)
  report = ols.skip_reports(state)[0]  # the step's scale, not an attempt's
  assert (report.loss_scale, report.next_loss_scale) == (2.0**24, scale)


def test_an_outlier_batch_halves_the_scale_once():
  # A PyTorch user's case: one batch with a loss near 1e6 at 2**16 and
  # max_retries=8. It is applied at the scale it fits at; the scale halves
  # once, as one overflowed step, and the next batches apply without retries.
  tx, step = _retrying(hysteresis=1, max_retries=8)
  state = tx.init(_params())
  state = state._replace(loss_scale=ols.DynamicLossScale(2.0**16, 100))
  _, params, state = step(_params(), state, X * 2.0**4)  # fits at 2**9
  assert int(state.retries) == 7 and int(state.skipped_steps) == 0
  assert float(state.loss_scale()) == 2.0**15
  for _ in range(3):
    _, params, state = step(params, state, X / 2.0**4)
  assert int(state.retries) == 7 and int(state.skipped_steps) == 0
  assert float(state.loss_scale()) == 2.0**15


def test_a_scale_far_too_high_comes_down_a_halving_per_step():
  # From 2**24 (FIT is 2**17): each step retries down to FIT and applies,
  # and the scale halves once per step, as it would without retries.
  tx, step = _retrying(hysteresis=1, max_retries=16)
  state, scales = tx.init(_params()), []
  for _ in range(8):  # the same batch and parameters every time
    _, _, state = step(_params(), state, X)
    scales.append(float(state.loss_scale()))
  assert scales == [2.0**e for e in (23, 22, 21, 20, 19, 18, 17, 17)]
  assert int(state.skipped_steps) == 0
  assert int(state.retries) == sum(range(1, 8))


def test_retries_stop_at_min_loss_scale():
  ls = ols.DynamicLossScale(2.0**24, min_loss_scale=2.0**23)
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ls)
  params = _params()
  _, _, state = tx.minimize(_loss, params, tx.init(params), X, max_retries=8)
  assert int(state.retries) == 1 and int(state.skipped_steps) == 1
  assert float(state.loss_scale()) == 2.0**23
  report = ols.skip_reports(state)[0]
  assert report.loss_scale == 2.0**24 and report.next_loss_scale == 2.0**23
  assert bool(state.last_skip.at_floor)  # its last attempt was at the floor


def test_no_retry_when_the_loss_is_not_finite():
  tx, step = _retrying(hysteresis=1, max_retries=2)
  params = _params()
  _, new_params, state = step(params, tx.init(params), X * jnp.nan)
  assert int(state.retries) == 0 and int(state.skipped_steps) == 1
  assert int(state.nonfinite_loss_steps) == 1
  assert float(state.loss_scale()) == 2.0**24  # no scale fixes the loss
  chex.assert_trees_all_equal(new_params, params)


def test_vmap_members_retry_alone():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**15))
  # Member i's float16 gradients overflow until the scale is 2**(15 - i).
  size = jnp.asarray([1.0, 3.0, 6.0, 12.0], jnp.float32)[:, None]
  params = {"w": jnp.ones((4, 2)) * size}

  def loss(p, c):
    return jnp.sum(p["w"].astype(jnp.float16) ** 2).astype(jnp.float32) * c

  def step(p, s, c):
    return tx.minimize(loss, p, s, c, max_retries=3)

  cs = jnp.asarray([1.0, 1.0, 1.0, jnp.nan])
  _, new_params, new_state = jax.jit(jax.vmap(step))(
    params, jax.vmap(tx.init)(params), cs
  )
  assert np.asarray(new_state.retries).tolist() == [1, 2, 3, 0]
  assert np.asarray(new_state.should_apply).tolist() == [1, 1, 1, 0]
  assert np.asarray(new_state.loss_scale()).tolist() == [
    2.0**14,  # each applied at the scale it fit at, each scale halved once
    2.0**14,
    2.0**14,
    2.0**15,  # the NaN loss: skipped, the scale kept
  ]
  alone = jax.jit(step)
  for i in range(4):
    p = jax.tree.map(lambda x, i=i: x[i], params)
    _, p1, s1 = alone(p, tx.init(p), cs[i])
    chex.assert_trees_all_close(
      jax.tree.map(lambda x, i=i: x[i], new_params), p1, rtol=1e-6
    )
    chex.assert_trees_all_equal(
      jax.tree.map(lambda x, i=i: x[i], new_state._replace(inner_state=None)),
      s1._replace(inner_state=None),
    )


# --- the retry loop's structure ---------------------------------------------------


def test_the_retry_loop_carries_parameters_and_state_never_the_gradients():
  # The update runs in the loop's last iteration: the gradients stay
  # temporaries of one iteration, and a step with retries needs no more
  # memory than one without.
  big = {"w": jnp.zeros((64, 256)), "b": jnp.zeros(256)}
  x = jnp.ones((4, 64))
  loss = lambda p, x: jnp.sum((x @ p["w"] + p["b"][None]) ** 2)  # noqa: E731
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1, momentum=0.9), ols.DynamicLossScale()
  )
  state = tx.init(big)
  jaxpr = jax.make_jaxpr(
    lambda p, s: tx.minimize(loss, p, s, x, max_retries=4)
  )(big, state)
  (loop,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is lax.while_p]
  carried = len(loop.outvars)
  # The attempt count, the "again" flag, the loss scale, the loss, and the
  # parameters and state.
  assert carried == 2 + len(jax.tree.leaves(state.loss_scale)) + 1 + len(
    jax.tree.leaves((big, state))
  )
  temp = {
    retries: jax.jit(
      lambda p, s, r=retries: tx.minimize(loss, p, s, x, max_retries=r),
      donate_argnums=(0, 1),
    )
    .lower(big, state)
    .compile()
    .memory_analysis()
    .temp_size_in_bytes
    for retries in (0, 4)
  }
  assert temp[4] <= 1.05 * temp[0]


# --- errors ----------------------------------------------------------------------


@pytest.mark.parametrize("max_retries", [0, 2])
def test_a_fun_returning_loss_and_aux_needs_has_aux(max_retries):
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = _params()
  with pytest.raises(TypeError, match=r"pass `has_aux=True`"):
    tx.minimize(
      lambda p, x: (_loss(p, x), {"aux": 1.0}),
      params,
      tx.init(params),
      X,
      max_retries=max_retries,
    )


@pytest.mark.parametrize(
  "loss_scale", [ols.FixedLossScale(8), ols.NoOpLossScale()], ids=repr
)
def test_max_retries_needs_a_loss_scale_that_can_be_lowered(loss_scale):
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), loss_scale)
  params = _params()
  with pytest.raises(
    ValueError,
    match=r"`LossScaleOptimizer.minimize\(max_retries=...\)` must be 0",
  ):
    tx.minimize(_loss, params, tx.init(params), X, max_retries=1)
  jax.eval_shape(  # max_retries=0 is fine
    lambda p, s: tx.minimize(_loss, p, s, X), params, tx.init(params)
  )


def test_minimize_names_a_bad_argument():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = _params()
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"minimize\(max_retries=...\)"):
    tx.minimize(_loss, params, state, X, max_retries=-1)
  with pytest.raises(
    TypeError,
    match=r"minimize\(max_retries=...\)` must be an int, got float 1.0",
  ):
    tx.minimize(_loss, params, state, X, max_retries=1.0)
  with pytest.raises(TypeError, match=r"\(has_aux=...\)` must be a bool"):
    tx.minimize(_loss, params, state, X, has_aux=1)
  with pytest.raises(TypeError, match=r"must be the loss function, got int 3"):
    tx.minimize(3, params, state)


# --- scaled_value_and_grad ----------------------------------------------------------


def test_scaled_value_and_grad_returns_the_loss_and_aux_and_scaled_grads():
  def loss_fn(w, x):
    return jnp.sum((w * x) ** 2), {"norm": jnp.sum(w)}

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
  np.testing.assert_array_equal(gx, 2 * 2 * w**2 * x)
  assert gw.shape == (2,)


@pytest.mark.parametrize(
  "make",
  [
    lambda ls: ols.LossScaleOptimizer(optax.sgd(0.1), ls),
    lambda ls: optax.chain(
      optax.identity(),
      ols.LossScaleOptimizer(optax.chain(optax.clip(1.0), optax.sgd(0.1)), ls),
    ),
    lambda ls: optax.chain(ols.unscale_gradients(ls), optax.adam(0.1)),
    lambda ls: optax.MultiSteps(ols.LossScaleOptimizer(optax.adam(0.1), ls), 4),
    lambda ls: optax.inject_hyperparams(
      lambda learning_rate: optax.chain(
        ols.unscale_gradients(ls), optax.sgd(learning_rate)
      )
    )(0.1),
    lambda ls: optax.multi_transform(
      {
        "a": ols.LossScaleOptimizer(
          optax.sgd(0.1), ls
        ).gradient_transformation(),
        "b": optax.set_to_zero(),
      },
      {"w": "a", "b": "b"},
    ),
  ],
  ids=[
    "optimizer",
    "chain",
    "unscale-chain",
    "multisteps",
    "inject",
    "multi_transform",
  ],
)
def test_scaled_value_and_grad_finds_the_loss_scale_in_a_nested_state(make):
  params = {"w": jnp.ones(2), "b": jnp.ones(1)}
  state = make(ols.DynamicLossScale(64.0)).init(params)
  loss, grads = ols.scaled_value_and_grad(lambda p: jnp.sum(p["w"]))(
    state, params
  )
  assert float(loss) == 2.0
  np.testing.assert_array_equal(grads["w"], [64.0, 64.0])


def test_scaled_value_and_grad_says_the_first_argument_is_the_state():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = {"w": jnp.ones(2)}
  grad_fn = ols.scaled_value_and_grad(lambda p: jnp.sum(p["w"]))
  # The arguments swapped: the parameters hold no loss scale.
  with pytest.raises(
    ValueError,
    match=r"first argument, the optimizer state \(did you pass the parameters\?\).*found 0 in dict",
  ):
    grad_fn(params, tx.init(params))
  two = optax.chain(
    ols.unscale_gradients(ols.FixedLossScale(2)),
    ols.unscale_gradients(ols.FixedLossScale(4)),
  )
  with pytest.raises(ValueError, match="found 2"):
    grad_fn(two.init(params), params)
  with pytest.raises(
    TypeError, match=r"`scaled_value_and_grad\(fun\)` takes a callable"
  ):
    ols.scaled_value_and_grad(3)  # type: ignore[arg-type]
  with pytest.raises(TypeError, match="pass `has_aux=True`"):
    ols.scaled_value_and_grad(lambda p: (jnp.sum(p["w"]), 1))(
      tx.init(params), params
    )
