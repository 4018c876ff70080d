"""`unscale_gradients`: loss scaling as one link of an `optax.chain`.

It unscales and updates the loss scale on every step, and only reports:
whatever skips must come after it, or the scale never backs off.
"""

from __future__ import annotations

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_lossscale as ols

pytestmark = pytest.mark.usefixtures("standard_promotion")

NAN, INF = float("nan"), float("inf")


def test_it_unscales_reports_and_never_skips():
  tx = optax.chain(
    ols.unscale_gradients(ols.DynamicLossScale(4.0)), optax.sgd(1.0)
  )
  params = {"w": jnp.ones(2), "n": None}
  state = tx.init(params)
  assert isinstance(state[0], ols.UnscaleGradientsState)
  assert bool(state[0].should_apply)
  step = jax.jit(tx.update)
  updates, state = step({"w": jnp.array([8.0, 4.0]), "n": None}, state, params)
  assert updates["n"] is None
  np.testing.assert_array_equal(updates["w"], [-2.0, -1.0])
  assert bool(state[0].should_apply)
  updates, state = step({"w": jnp.array([INF, 4.0]), "n": None}, state, params)
  assert not bool(state[0].should_apply)
  assert bool(jnp.isinf(updates["w"][0]))  # it reports; it does not skip
  assert float(state[0].loss_scale()) == 2.0


def test_a_nonfinite_loss_reports_and_keeps_the_scale():
  tx = ols.unscale_gradients(ols.DynamicLossScale(8.0))
  _, state = tx.update(
    {"w": jnp.ones(2)}, tx.init(None), value=jnp.float32(NAN)
  )
  assert not bool(state.should_apply) and float(state.loss_scale()) == 8


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_gradients_keep_their_dtype_under_strict_promotion(dtype):
  params = {"w": jnp.ones((3, 4), dtype)}
  grads = {"w": jnp.full((3, 4), 64, dtype)}
  with jax.numpy_dtype_promotion("strict"):
    tx = optax.chain(
      ols.unscale_gradients(ols.FixedLossScale(64)), optax.sgd(0.5)
    )
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  chex.assert_trees_all_equal_dtypes(updates, params)
  np.testing.assert_array_equal(updates["w"], jnp.full((3, 4), -0.5, dtype))


def test_integer_leaves_pass_through():
  tx = ols.unscale_gradients(ols.DynamicLossScale(4.0))
  params = {"w": jnp.ones(2), "n": jnp.arange(3)}
  grads = {"w": jnp.array([8.0, 4.0]), "n": jnp.arange(3)}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], [2.0, 1.0])
  assert updates["n"].dtype == jnp.int32
  np.testing.assert_array_equal(updates["n"], grads["n"])
  assert bool(state.should_apply)


def test_it_refuses_what_is_not_a_loss_scale_and_a_foreign_state():
  for bad in [2.0, "dynamic", None]:
    with pytest.raises(
      TypeError, match=r"`unscale_gradients\(loss_scale=...\)`"
    ):
      ols.unscale_gradients(bad)
  tx = ols.unscale_gradients(ols.FixedLossScale(2))
  with pytest.raises(TypeError, match="UnscaleGradientsState"):
    tx.update({"w": jnp.ones(2)}, optax.sgd(0.1).init({"w": jnp.ones(2)}))


# --- skipping after it, and the pitfall of skipping before it ---------------------


def _own_cond_step(loss_scale, inner=None):
  # The train-step guide's own skip after `unscale_gradients`: it keeps the
  # link's new state, and the rest of the old one.
  inner = optax.sgd(1.0) if inner is None else inner
  tx = optax.chain(ols.unscale_gradients(loss_scale), inner)

  def step(params, opt_state, grads):
    updates, new_state = tx.update(grads, opt_state, params)
    params, rest = lax.cond(
      new_state[0].finite,
      lambda: (optax.apply_updates(params, updates), new_state[1:]),
      lambda: (params, opt_state[1:]),
    )
    return params, (new_state[0], *rest)

  return tx, step


def _update_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, step


PAIRINGS = {
  "apply_if_finite_after": lambda ls: _update_step(
    optax.chain(
      ols.unscale_gradients(ls),
      optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=100),
    )
  ),
  "own_lax_cond_after": _own_cond_step,
  # Skipping before it: the link is not called on skipped steps, so the
  # scale never backs off, as the docs warn.
  "multisteps_skip_not_finite_before": lambda ls: _update_step(
    optax.MultiSteps(
      optax.chain(ols.unscale_gradients(ls), optax.sgd(1.0)),
      every_k_schedule=1,
      should_skip_update_fn=optax.skip_not_finite,
    ).gradient_transformation()
  ),
  "apply_if_finite_before": lambda ls: _update_step(
    optax.apply_if_finite(
      optax.chain(ols.unscale_gradients(ls), optax.sgd(1.0)),
      max_consecutive_errors=100,
    )
  ),
}


def _scale(state):
  """The loss scale in a nested state, as `scaled_value_and_grad` finds it."""
  _, grads = ols.scaled_value_and_grad(lambda x: x)(state, jnp.float32(1))
  return float(grads)


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_a_skip_after_it_backs_off_and_a_skip_before_it_stalls(pairing):
  tx, step = PAIRINGS[pairing](ols.DynamicLossScale())
  step = jax.jit(step)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  scales = []
  for _ in range(3):
    params, state = step(params, state, {"w": jnp.array([NAN, 1.0])})
    scales.append(_scale(state))
  np.testing.assert_array_equal(params["w"], [1.0, 1.0])  # nothing applied
  if pairing.endswith("_before"):
    assert scales == [2.0**15] * 3
    return
  assert scales == [2.0**14, 2.0**13, 2.0**12]
  params, state = step(params, state, {"w": jnp.full(2, 2.0**12)})  # 1 unscaled
  np.testing.assert_array_equal(params["w"], [0.0, 0.0])


# --- structure ----------------------------------------------------------------------


def test_it_reads_the_incoming_gradients_once_and_never_skips():
  # One sum of squares per leaf (the small exact check runs only when it is
  # not finite); the unscaled gradients go on to the rest of the chain.
  n, shape = 4, (70, 70)
  tx = optax.chain(
    ols.unscale_gradients(ols.DynamicLossScale()), optax.adam(1e-3)
  )
  params = {f"p{i}": jnp.ones(shape) for i in range(n)}
  jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
  reduced = sum(
    e.invars[0].aval.size
    for e in jaxpr.eqns
    if e.primitive is lax.reduce_sum_p and e.invars[0].aval.size > n
  )
  assert reduced == n * shape[0] * shape[1]
  # One small conditional, the exact check, and no output of the
  # gradients' size from it.
  conds = [e for e in jaxpr.eqns if e.primitive is lax.cond_p]
  assert len(conds) == 1
  assert all(v.aval.size <= n for v in conds[0].outvars)


def test_a_cast_state_is_named_at_trace_time():
  tx = ols.unscale_gradients(ols.DynamicLossScale(8.0))
  state = tx.init(None)
  cast = jax.tree.map(
    lambda x: x.astype(jnp.float16) if x.dtype == jnp.float32 else x, state
  )
  with pytest.raises(
    TypeError,
    match=r"current_loss_scale` must be float32, got float16.*check_state",
  ):
    jax.jit(tx.update).trace({"w": jnp.ones(2)}, cast)


@pytest.mark.parametrize(
  "loss_scale",
  [ols.FixedLossScale(8.0), ols.NoOpLossScale(), ols.DynamicLossScale(8.0)],
  ids=["fixed", "noop", "dynamic"],
)
def test_the_own_skip_recipe_keeps_the_parameters_with_every_loss_scale(
  loss_scale,
):
  # The train-step guide's recipe reads `finite`: with a fixed scale, whose
  # `should_apply` is TensorFlow's True, inf gradients must not reach Adam.
  tx, step = _own_cond_step(loss_scale, optax.adam(0.1))
  step = jax.jit(step)
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  grads = {"w": jnp.array([jnp.inf, 1.0, 1.0, 1.0])}
  new, new_state = step(params, state, grads)
  chex.assert_trees_all_equal(new, params)
  chex.assert_trees_all_equal(new_state[1:], state[1:])
  assert not bool(new_state[0].finite)
  # TensorFlow's answer where TensorFlow's meaning is asked for.
  fixed = not isinstance(loss_scale, ols.DynamicLossScale)
  assert bool(new_state[0].should_apply) == fixed
  _, state = step(params, state, {"w": jnp.ones(4)})
  assert bool(state[0].finite) and bool(state[0].should_apply)


def test_a_loss_passed_as_loss_warns_with_the_name_to_use():
  tx = ols.unscale_gradients(ols.DynamicLossScale())
  with pytest.warns(UserWarning, match=r"loss=.*pass the loss as `value=`"):
    tx.update({"w": jnp.ones(2)}, tx.init(None), loss=jnp.float32(1.0))
