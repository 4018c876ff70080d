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


def _last_skip(state):
  """The last skip an unbatched state records, or None."""
  reports = ols.skip_reports(state)
  assert len(reports) <= 1 and all(r.member is None for r in reports)
  return reports[0] if reports else None


def _member(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


def _assert_close(actual, expected):
  """Equal up to a couple of units in the last place of each leaf's dtype.

  XLA fuses a batched update differently from a single member's, which can
  round the last bit differently (a float16 Adam step by one ulp).
  """

  def close(a, b):
    eps = float(jnp.finfo(jnp.asarray(b).dtype).eps)
    np.testing.assert_allclose(
      np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=2 * eps
    )

  jax.tree.map(close, actual, expected)


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
      _assert_close(_member(params, i), p)
      chex.assert_trees_all_equal(
        _member(state, i)._replace(inner_state=None),
        s._replace(inner_state=None),
      )
      assert _last_skip(_member(state, i)) == _last_skip(s)
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
  reports = [_last_skip(_member(state, i)) for i in range(MEMBERS)]
  assert reports[2].nonfinite == ("['w']",)
  assert reports[:2] == [None, None] and reports[3] is None
  assert ols.skip_reports(state) == [reports[2]._replace(member=2)]


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
  assert caplog.text.count("member 3: skipped step") == 2
  assert caplog.text.count("skipped step") == 2
  assert [r.member for r in ols.skip_reports(state)] == [3]
  assert _last_skip(_member(state, 3)).nonfinite == ("['w']",)
  params, state = step(grads, state, params)
  with pytest.raises(ols.ConsecutiveSkipsError, match=r"\(member 3\): 3") as e:
    monitor(state)
  skipped_at = float(state.last_skip.loss_scale[3])
  now = float(state.loss_scale()[3])
  assert skipped_at != now  # hysteresis spent: this skip halved the scale
  assert (
    f"The last skipped step ran at loss scale {skipped_at:g}, above its"
    f" floor (min_loss_scale); the loss scale is now {now:g}." in str(e.value)
  )


def _lines(caplog):
  lines = [
    r.getMessage() for r in caplog.records if r.name == "optax_lossscale"
  ]
  caplog.clear()
  return lines


@pytest.mark.parametrize("members", [2, 4])
def test_members_skipping_at_the_same_step_are_logged_apart(
  members, standard_promotion, caplog
):
  # Members 0 and 1 skip the same step alike (of 2 members: all of them).
  tx = _tx()
  params = {"w": jnp.ones((members, 3))}
  state = jax.vmap(tx.init)(params)
  grads = {"w": jnp.ones((members, 3)).at[:2, 1].set(jnp.nan)}
  _, state = jax.jit(jax.vmap(tx.apply_gradients))(grads, state, params)
  with caplog.at_level("WARNING", logger="optax_lossscale"):
    assert ols.SkipMonitor()(state).member == 0
  line = "skipped step (1 in a row, 1 in all): loss scale 8 -> 8; no loss given"
  assert _lines(caplog) == [
    f"member 0: {line}; non-finite gradients: ['w']",
    f"member 1: {line}; non-finite gradients: ['w']",
  ]
  assert [r.member for r in ols.skip_reports(state)] == [0, 1]


def test_members_that_skip_together_then_apart_log_each_skip_once(
  standard_promotion,
):
  # Every member skips the first two steps alike, then each on its own
  # (`_grads`); the monitor reads the state after every step.
  tx = _tx()
  params = _params()
  state = jax.vmap(tx.init)(params)
  step = jax.jit(jax.vmap(tx.apply_gradients))
  logged = []
  monitor = ols.SkipMonitor(log=logged.append)
  everywhere = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
  seen = np.zeros(MEMBERS, np.int32)
  for t in range(8):
    grads = everywhere if t < 2 else _grads(t)
    params, state = step(grads, state, params)
    monitor(state)
    skipped = np.asarray(state.skipped_steps)
    expected = [(m, int(skipped[m])) for m in np.flatnonzero(skipped != seen)]
    assert [(r.member, r.skipped_steps) for r in logged] == expected, t
    recorded = {r.member: r for r in ols.skip_reports(state)}
    assert all(recorded[r.member] == r for r in logged)
    logged.clear()
    seen = skipped
    if t == 1:
      assert len(expected) == MEMBERS  # alike so far
  assert len(set(skipped.tolist())) > 1  # and apart at the end


def test_a_restored_ensemble_is_logged_again_member_by_member(
  standard_promotion,
):
  # After a restore to an earlier checkpoint, a member whose count differs
  # from what the monitor saw is news; one whose count matches is not.
  tx = _tx()
  params = {"w": jnp.ones((2, 3))}
  step = jax.jit(jax.vmap(tx.apply_gradients))
  both = {"w": jnp.full((2, 3), jnp.nan)}
  first = {"w": jnp.ones((2, 3)).at[0, 0].set(jnp.nan)}
  _, early = step(both, jax.vmap(tx.init)(params), params)  # counts [1, 1]
  _, late = step(first, step(first, early, params)[1], params)  # [3, 1]
  logged = []
  monitor = ols.SkipMonitor(log=logged.append)
  monitor(late)
  assert [(r.member, r.skipped_steps) for r in logged] == [(0, 3), (1, 1)]
  logged.clear()
  _, after = step(first, early, params)  # the restored checkpoint: [2, 1]
  assert monitor(after).skipped_steps == 2
  assert [(r.member, r.skipped_steps) for r in logged] == [(0, 2)]
  assert monitor(after) is None


def test_a_state_stacked_over_two_axes_reports_row_major_members(
  standard_promotion,
):
  # A (2, 3) stack (vmap over vmap, or pmap over vmap): element [1, 2] is
  # member 5.
  tx = _tx()
  params = {"w": jnp.ones((2, 3, 4))}
  state = jax.vmap(jax.vmap(tx.init))(params)
  grads = {"w": jnp.ones((2, 3, 4)).at[1, 2, 0].set(jnp.inf)}
  step = jax.jit(jax.vmap(jax.vmap(tx.apply_gradients)))
  logged = []
  monitor = ols.SkipMonitor(max_consecutive_skips=2, log=logged.append)
  for t in range(2):
    _, state = step(grads, state, params)
    if t == 0:
      assert monitor(state).member == 5
  assert [r.member for r in ols.skip_reports(state)] == [5]
  with pytest.raises(ols.ConsecutiveSkipsError, match=r"\(member 5\): 2"):
    monitor(state)
  assert [(r.member, r.skipped_steps) for r in logged] == [(5, 1), (5, 2)]
