"""Ensembles under `jax.vmap`: each member skips, backs off and counts alone."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

MEMBERS = 4


def _member(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _grads(step):
  """Per-member gradients: member `step % 4` has a NaN, member 3 an inf."""
  rng = np.random.default_rng(step)
  g = {
    "w": rng.normal(size=(MEMBERS, 3, 5)).astype(np.float32),
    "b": rng.normal(size=(MEMBERS, 5)).astype(np.float16),
  }
  g["w"][step % MEMBERS, 1, 2] = np.nan
  if step % 2:
    g["b"][3, 0] = np.inf
  return jax.tree.map(jnp.asarray, g)


def _tx():
  return ols.LossScaleOptimizer(
    optax.adam(1e-2), ols.DynamicLossScale(8.0, 2, hysteresis=2)
  )


def _params():
  return {
    "w": jnp.ones((MEMBERS, 3, 5), jnp.float32),
    "b": jnp.zeros((MEMBERS, 5), jnp.float16),
  }


@pytest.mark.parametrize("method", ["update", "apply_gradients"])
def test_vmap_members_equal_running_each_member_alone(
  method, standard_promotion
):
  tx = _tx()
  params = _params()
  state = jax.vmap(tx.init)(params)
  alone = [(_member(params, i), tx.init(_member(params, i))) for i in range(4)]

  def step(grads, state, params):
    out, state = getattr(tx, method)(grads, state, params)
    if method == "update":
      out = optax.apply_updates(params, out)
    return out, state

  batched, single = jax.jit(jax.vmap(step)), jax.jit(step)
  for t in range(6):
    grads = _grads(t)
    params, state = batched(grads, state, params)
    alone = [single(_member(grads, i), s, p) for i, (p, s) in enumerate(alone)]
    for i, (p, s) in enumerate(alone):
      chex.assert_trees_all_close(_member(params, i), p, rtol=1e-6)
      chex.assert_trees_all_equal(
        _member(state, i)._replace(inner_state=None),
        s._replace(inner_state=None),
      )
      assert ols.skip_report(_member(state, i)) == ols.skip_report(s)
  skipped = np.asarray(state.skipped_steps)
  assert len(set(skipped.tolist())) > 1  # the members really differ
  scales = np.asarray(state.loss_scale.current_loss_scale)
  assert len(set(scales.tolist())) > 1


def test_vmap_minimize_retries_each_member_alone(standard_promotion):
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**15))
  # Member i's float16 gradients overflow until the scale is 2**(15 - i).
  size = jnp.asarray([1.0, 3.0, 6.0, 12.0], jnp.float32)[:, None]
  params = {"w": jnp.ones((MEMBERS, 2)) * size}

  def loss(p, c):
    return jnp.sum(p["w"].astype(jnp.float16) ** 2).astype(jnp.float32) * c

  def step(p, s, c):
    return tx.minimize(loss, p, s, c, max_retries=3)

  cs = jnp.asarray([1.0, 1.0, 1.0, jnp.nan])
  state = jax.vmap(tx.init)(params)
  _, new_params, new_state = jax.jit(jax.vmap(step))(params, state, cs)
  retries = np.asarray(new_state.retries)
  assert len(set(retries.tolist())) > 1, retries
  for i in range(MEMBERS):
    p = _member(params, i)
    _, p1, s1 = jax.jit(step)(p, tx.init(p), cs[i])
    chex.assert_trees_all_close(_member(new_params, i), p1, rtol=1e-6)
    chex.assert_trees_all_equal(
      _member(new_state, i)._replace(inner_state=None),
      s1._replace(inner_state=None),
    )
  assert not bool(new_state.should_apply[3])  # the NaN loss: skipped


def test_vmap_step_has_no_callback_and_records_only_skipping_members(
  standard_promotion,
):
  tx = _tx()
  params = _params()
  state = jax.vmap(tx.init)(params)
  jaxpr = jax.make_jaxpr(jax.vmap(tx.apply_gradients))(_grads(0), state, params)
  assert "callback" not in str(jaxpr)
  grads = jax.tree.map(jnp.ones_like, params)
  grads["w"] = grads["w"].at[2, 0, 0].set(jnp.inf)
  _, state = jax.jit(jax.vmap(tx.apply_gradients))(grads, state, params)
  reports = [ols.skip_report(_member(state, i)) for i in range(MEMBERS)]
  assert reports[2].nonfinite == {"['w']": 1}
  assert reports[:2] == [None, None] and reports[3] is None


def test_skip_monitor_watches_every_member_of_an_ensemble(
  standard_promotion, caplog
):
  tx = _tx()
  params = _params()
  state = jax.vmap(tx.init)(params)
  step = jax.jit(jax.vmap(tx.apply_gradients))
  monitor = ols.SkipMonitor(max_consecutive_skips=3)
  grads = jax.tree.map(jnp.ones_like, params)
  grads["w"] = grads["w"].at[3, 0, 0].set(jnp.nan)  # member 3 only
  with caplog.at_level("WARNING", logger="optax_lossscale"):
    for t in range(2):
      params, state = step(grads, state, params)
      assert monitor(state).consecutive_skipped_steps == t + 1
  assert caplog.text.count("skipped step") == 2
  with pytest.raises(ValueError, match="members whose records differ"):
    ols.skip_report(state)
  assert ols.skip_report(_member(state, 3)).nonfinite == {"['w']": 1}
  params, state = step(grads, state, params)
  with pytest.raises(ols.ConsecutiveSkipsError, match=r"\(member 3\): 3"):
    monitor(state)
