"""Run in a subprocess with 8 host CPU devices (see test_multidevice.py)."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import sys  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_lossscale as ols  # noqa: E402

assert jax.device_count() == 8, jax.devices()
N = 8
AUTO = jax.sharding.AxisType.Auto


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


def _make(axis_name=None):
  return ols.loss_scale_optimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**10, 2), axis_name=axis_name
  )


def _per_replica_grads(step, bad_replica):
  grads = np.ones((N, 4), np.float32) * 2.0**10
  if step == 0:
    grads[bad_replica, 1] = np.nan
  return {"w": jnp.asarray(grads)}


def check_pmap():
  tx = _make("i")
  params = {"w": jnp.zeros((N, 4))}
  state = jax.pmap(tx.init)(params)

  @partial(jax.pmap, axis_name="i")
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for t in range(2):
    params, state = step(params, state, _per_replica_grads(t, 3))
    scales = np.asarray(state.loss_scale.current_loss_scale)
    applied = np.asarray(state.should_apply)
    assert len(set(scales.tolist())) == 1, scales
    if t == 0:
      assert not applied.any() and scales[0] == 2.0**9
      np.testing.assert_array_equal(params["w"], 0.0)
    else:
      assert applied.all()
      # 2**10 unscaled by the halved scale 2**9 is 2; times the rate 0.1.
      np.testing.assert_allclose(params["w"], -0.2, rtol=1e-6)
  # The per-replica verdict really differs without axis_name.
  plain = _make(None)
  s0 = jax.pmap(plain.init)(params)
  _, s1 = jax.pmap(plain.update)(_per_replica_grads(0, 3), s0, params)
  assert np.asarray(s1.should_apply).sum() == N - 1

  # The other entry points agree across the axis too.
  grads = _per_replica_grads(0, 6)
  finite = jax.pmap(lambda g: ols.all_finite(g, axis_name="i"), "i")(grads)
  assert not np.asarray(finite).any()
  ls = ols.DynamicLossScale(2.0**10, 2)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * N), ls)
  new_ls, ok = jax.pmap(lambda s, g: s.update(g, axis_name="i"), "i")(
    stacked, grads
  )
  assert not np.asarray(ok).any()
  np.testing.assert_array_equal(new_ls.current_loss_scale, 2.0**9)
  unscale = ols.unscale_gradients(ols.DynamicLossScale(2.0**10), axis_name="i")
  u_state = jax.pmap(unscale.init)(params)
  _, u_state = jax.pmap(unscale.update, "i")(grads, u_state)
  assert not np.asarray(u_state.should_apply).any()
  np.testing.assert_array_equal(u_state.loss_scale.current_loss_scale, 2.0**9)


def check_pmap_readme_step():
  # The README's pmap step, with and without its `pmean` of the gradients.
  tx = ols.loss_scale_optimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**10), axis_name="batch"
  )

  def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] - y) ** 2)

  def train_step(mean):
    @partial(jax.pmap, axis_name="batch")
    def step(params, opt_state, x, y):
      loss, grads = ols.scaled_value_and_grad(loss_fn)(opt_state, params, x, y)
      if mean:
        grads = jax.lax.pmean(grads, "batch")
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return step

  x = jax.random.normal(jax.random.PRNGKey(0), (N, 4, 3))
  y = jax.random.normal(jax.random.PRNGKey(1), (N, 4))
  params = {"w": jnp.zeros((N, 3))}  # the same on every replica
  state = jax.pmap(tx.init)(params)
  for mean in (True, False):
    p, s = params, state
    for _ in range(2):
      p, s = train_step(mean)(p, s, x, y)
    distinct = len({tuple(row) for row in np.asarray(p["w"]).tolist()})
    assert distinct == (1 if mean else N), (mean, distinct)

  # `check_state` reads the replicas' states element by element.
  assert ols.check_state(s) is s
  bad = s._replace(consecutive_skipped_steps=s.skipped_steps + 1)
  try:
    ols.check_state(bad)
    raise AssertionError("check_state accepted more consecutive skips")
  except ValueError as e:
    assert "got 1 at index (0,), with skipped_steps=0." in str(e), e


def check_shard_map():
  mesh = _mesh((N,), ("i",))
  tx = _make("i")
  params = {"w": jnp.zeros((N, 4))}
  state = tx.init({"w": jnp.zeros((1, 4))})

  @jax.jit
  @partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P("i"), P(), P("i")),
    out_specs=(P("i"), P()),
    check_vma=False,
  )
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  sharded = NamedSharding(mesh, P("i"))
  params = jax.device_put(params, sharded)
  params, state = step(
    params, state, jax.device_put(_per_replica_grads(0, 5), sharded)
  )
  assert not bool(state.should_apply)
  assert float(state.loss_scale()) == 2.0**9
  np.testing.assert_array_equal(params["w"], 0.0)
  params, state = step(
    params, state, jax.device_put(_per_replica_grads(1, 5), sharded)
  )
  assert bool(state.should_apply)
  np.testing.assert_allclose(params["w"], -0.2, rtol=1e-6)


def _sharded_run(mesh, param_spec, data_spec):
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (16, 8))
  y = x @ jnp.arange(8.0)[:, None]
  params = {"w": jnp.zeros((8, 8)), "v": jnp.zeros((8, 1))}

  def loss_fn(p, x, y):
    h = x.astype(jnp.float16) @ p["w"].astype(jnp.float16)
    pred = (h @ p["v"].astype(jnp.float16)).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2) + jnp.sum(p["w"] ** 2) * 1e-3

  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), ols.DynamicLossScale(2.0**15, 3)
  )

  def step(params, state, x, y):
    _, grads = ols.scaled_value_and_grad(loss_fn)(state, params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  applied = []
  if mesh is not None:
    ps = {k: NamedSharding(mesh, param_spec[k]) for k in params}
    params = jax.device_put(params, ps)
    state = tx.init(params)
    x = jax.device_put(x, NamedSharding(mesh, data_spec))
    y = jax.device_put(y, NamedSharding(mesh, data_spec))
    in_state_shardings = jax.tree.map(lambda a: a.sharding, state)
  run = jax.jit(step, donate_argnums=(0, 1))
  for _ in range(12):
    params, state = run(params, state, x, y)
    applied.append(bool(state.should_apply))
  if mesh is not None:
    for k in params:
      assert params[k].sharding.is_equivalent_to(ps[k], 2), params[k].sharding
    out_state_shardings = jax.tree.map(lambda a: a.sharding, state)
    for a, b, leaf in zip(
      jax.tree.leaves(in_state_shardings),
      jax.tree.leaves(out_state_shardings),
      jax.tree.leaves(state),
      strict=True,
    ):
      if leaf.ndim:  # arrays keep their sharding: nothing is gathered
        assert b.is_equivalent_to(a, leaf.ndim), (a, b)
      else:  # scalars (the loss scale, counters) end up replicated
        assert b.is_fully_replicated, b
    assert state.loss_scale.current_loss_scale.sharding.is_fully_replicated
  return params, state, applied


def check_sharded_jit():
  ref_params, ref_state, ref_applied = _sharded_run(None, None, None)
  assert not all(ref_applied)  # 2**15 overflows float16 at first
  data_mesh = _mesh((N,), ("data",))
  model_mesh = _mesh((2, 4), ("data", "model"))
  for mesh, pspec, dspec in [
    (data_mesh, {"w": P(), "v": P()}, P("data")),
    (model_mesh, {"w": P(None, "model"), "v": P("model", None)}, P("data")),
  ]:
    params, state, applied = _sharded_run(mesh, pspec, dspec)
    assert applied == ref_applied
    assert float(state.loss_scale()) == float(ref_state.loss_scale())
    assert int(state.skipped_steps) == int(ref_state.skipped_steps)
    for k in params:
      np.testing.assert_allclose(params[k], ref_params[k], rtol=2e-3, atol=1e-5)


def check_sharded_leaves_are_checked_in_place():
  # A model-parallel gradient leaf is checked shard by shard: the compiled
  # check moves no gradient data between devices (only the scalar verdict),
  # for float16 and bfloat16 (summed in rows of 16 along the last axis) and
  # float32.
  mesh = _mesh((2, 4), ("data", "model"))
  sharding = NamedSharding(mesh, P("data", "model"))
  check = jax.jit(ols.all_finite)
  for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
    for shape in [(512, 1024), (512, 1000)]:
      x = jax.device_put(jnp.ones(shape, dtype), sharding)
      hlo = check.lower(x).compile().as_text()
      for op in ("all-gather", "all-to-all", "collective-permute"):
        assert op not in hlo, (dtype, shape, op)
      assert bool(check(x))
      for index in [(0, 0), (300, 700), (511, shape[1] - 1)]:
        bad = jax.device_put(x.at[index].set(jnp.nan), sharding)
        assert not bool(check(bad)), (dtype, shape, index)


def check_nan_loss_on_one_replica():
  # A NaN loss on one replica only: every replica skips, the loss scale stays
  # bit for bit, and the counters agree (4 devices).
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**10, 2), axis_name="i"
  )
  params = {"w": jnp.zeros((4, 4))}
  state = jax.pmap(tx.init, devices=jax.devices()[:4])(params)
  grads = {"w": jnp.ones((4, 4))}
  loss = jnp.array([1.0, 1.0, np.nan, 1.0])
  step = jax.pmap(
    lambda g, s, p, v: tx.apply_gradients(g, s, p, value=v),
    axis_name="i",
    devices=jax.devices()[:4],
  )
  params, state = step(grads, state, params, loss)
  assert not np.asarray(state.should_apply).any()
  np.testing.assert_array_equal(state.loss_scale.current_loss_scale, 2.0**10)
  np.testing.assert_array_equal(state.nonfinite_loss_steps, 1)
  np.testing.assert_array_equal(params["w"], 0.0)


def check_minimize_retries_agree():
  # One replica's batch overflows at high scales: all replicas run the same
  # number of attempts (the loss has a collective inside, which would
  # deadlock otherwise), and end with equal scales.
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**15, 100), axis_name="i"
  )
  devices = jax.devices()[:4]
  params = {"w": jnp.full((4, 3), 0.5, jnp.float32)}
  state = jax.pmap(tx.init, devices=devices)(params)
  x = np.ones((4, 2, 3), np.float32)
  x[1] *= 300.0  # replica 1 only

  def loss(p, x):
    h = (x.astype(jnp.float16) * p["w"].astype(jnp.float16)).astype(jnp.float32)
    return jax.lax.pmean(jnp.mean(h**2), "i")

  step = jax.pmap(
    lambda p, s, x: tx.minimize(loss, p, s, x, max_retries=16),
    axis_name="i",
    devices=devices,
  )
  _, params, state = step(params, state, jnp.asarray(x))
  retries = np.asarray(state.retries)
  assert (retries == retries[0]).all() and retries[0] > 0, retries
  assert np.asarray(state.should_apply).all()
  assert len(set(np.asarray(state.loss_scale.current_loss_scale).tolist())) == 1
  assert np.isfinite(np.asarray(params["w"])).all()
  # With a report: retries that succeed report nothing; retries that run out
  # report once per step (not once per replica).
  needed = int(retries[0])
  params = {"w": jnp.full((4, 3), 0.5, jnp.float32)}
  reports = []
  reporting = ols.LossScaleOptimizer(
    optax.sgd(0.1),
    ols.DynamicLossScale(2.0**15, 100),
    axis_name="i",
    on_skip=reports.append,
  )
  state = jax.pmap(reporting.init, devices=devices)(params)
  for max_retries in (needed, needed - 1):
    step = jax.pmap(
      lambda p, s, x, r=max_retries: reporting.minimize(
        loss, p, s, x, max_retries=r
      ),
      axis_name="i",
      devices=devices,
    )
    _, _, new_state = step(params, state, jnp.asarray(x))
    jax.effects_barrier()
    skipped = np.asarray(new_state.skipped_steps)
    assert (skipped == (max_retries < needed)).all(), skipped
  assert len(reports) == 1, reports
  assert list(reports[0].nonfinite) == ["['w']"], reports


if __name__ == "__main__":
  for name in sys.argv[1:]:
    globals()[f"check_{name}"]()
    print("ok", name)
