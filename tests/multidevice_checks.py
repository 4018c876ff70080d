"""Run in a subprocess with 8 host CPU devices (see test_multidevice.py).

`python tests/multidevice_checks.py NAME[:AXES] ...` runs `check_NAME`, with
meshes of `jax.make_mesh`'s default axis types (Explicit) or, with `:auto`,
of `AxisType.Auto`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
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
# Set from the command line: None (jax.make_mesh's default) or AUTO.
AXIS_TYPE = None
GATHERS = ("all-gather", "all-to-all", "collective-permute")


def _last_skip(state):
  """The last skip an unbatched state records, or None."""
  reports = ols.skip_reports(state)
  assert len(reports) <= 1 and all(r.member is None for r in reports)
  return reports[0] if reports else None


def _mesh(shape, names):
  if AXIS_TYPE is None:
    return jax.make_mesh(shape, names)
  return jax.make_mesh(shape, names, axis_types=(AXIS_TYPE,) * len(shape))


def _no_gradient_moves(compiled, what):
  hlo = compiled.as_text()
  for op in GATHERS:
    assert f"{op}(" not in hlo and f"{op}-start(" not in hlo, (what, op)


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
  # The docs' pmap step, with and without its `pmean` of the gradients.
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

  # Under Explicit axes, a contraction over a sharded axis says how its
  # output is sharded.
  explicit = mesh is not None and AXIS_TYPE is None
  out = dict(out_sharding=P(data_spec[0], None)) if explicit else {}

  def loss_fn(p, x, y):
    h = x.astype(jnp.float16) @ p["w"].astype(jnp.float16)
    pred = jnp.matmul(h, p["v"].astype(jnp.float16), **out)
    pred = pred.astype(jnp.float32)
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
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
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
      if leaf.ndim and len(a.device_set) > 1:
        # Sharded arrays keep their sharding: nothing is gathered.
        assert b.is_equivalent_to(a, leaf.ndim), (a, b)
      else:  # the rest (the loss scale, counters, record) end up replicated
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
  with jax.set_mesh(mesh):
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
      for shape in [(512, 1024), (512, 1000), (64, 24)]:
        x = jax.device_put(jnp.ones(shape, dtype), sharding)
        _no_gradient_moves(check.lower(x).compile(), (dtype, shape))
        assert bool(check(x))
        for index in [(0, 0), (40, 17), (63, shape[1] - 1)]:
          host = np.ones(shape, dtype)
          host[index] = np.nan
          bad = jax.device_put(host, sharding)
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
  # The skip record: retries that succeed record nothing; retries that run
  # out record the step once, with the flags agreed over replicas, and
  # every replica holds the same record.
  needed = int(retries[0])
  params = {"w": jnp.full((4, 3), 0.5, jnp.float32)}
  state = jax.pmap(tx.init, devices=devices)(params)
  for max_retries in (needed, needed - 1):
    step = jax.pmap(
      lambda p, s, x, r=max_retries: tx.minimize(loss, p, s, x, max_retries=r),
      axis_name="i",
      devices=devices,
    )
    _, _, new_state = step(params, state, jnp.asarray(x))
    skipped = np.asarray(new_state.skipped_steps)
    assert (skipped == (max_retries < needed)).all(), skipped
    reports = ols.skip_reports(new_state)  # one per replica
    assert (reports == []) == (max_retries == needed), reports
  assert [r.member for r in reports] == [0, 1, 2, 3], reports
  for report in reports:  # replica 1's 3 values, on every replica
    assert report._replace(member=0) == reports[0], reports
  assert reports[0].nonfinite == ("['w']",), reports
  replica = jax.tree.map(lambda x: x[0], new_state)
  assert _last_skip(replica) == reports[0]._replace(member=None)


# --- every public function on sharded trees ----------------------------------


def _mixed_specs(two_d):
  """Leaves sharded along every axis, of every dtype, of awkward shapes."""
  d = ("x", "y") if two_d else "d"
  specs = {
    "small_row": ((8, 16), P(d, None), jnp.float32),
    "small_col": ((8, 16), P(None, d), jnp.float32),
    "big_row": ((256, 136), P(d, None), jnp.float32),
    "big_col": ((136, 256), P(None, d), jnp.float32),
    "half_last": ((24, 64), P(None, d), jnp.float16),
    "brain_last": ((24, 40), P(None, d), jnp.bfloat16),
    "half_big": ((40, 1024), P(None, d), jnp.float16),
    "three_d": ((8, 3, 8), P(None, None, d), jnp.float32),
    "odd": ((7, 5), P(), jnp.float32),
    "vector": ((8,), P(d), jnp.float16),
    "replicated": ((100,), P(), jnp.float32),
  }
  if two_d:
    specs["both"] = ((8, 16), P("x", "y"), jnp.float32)
    specs["crossed"] = ((16, 8), P("y", "x"), jnp.bfloat16)
  return specs


def _mixed_tree(specs, mesh, value):
  rng = np.random.default_rng(0)
  tree = {}
  for k, (shape, spec, dtype) in specs.items():
    host = (rng.uniform(0.5, 1.5, shape) * value).astype(dtype)
    tree[k] = jnp.asarray(host) if mesh is None else jax.device_put(host, spec)
  return tree


def _assert_kept(tree, specs, what):
  """Each leaf of `tree` is sharded as `specs` says, in its type too."""
  for k, x in tree.items():
    shape, spec, _ = specs[k]
    expected = NamedSharding(x.sharding.mesh, spec)
    assert x.sharding.is_equivalent_to(expected, len(shape)), (what, k, x)
    if AXIS_TYPE is None:  # Explicit: the sharding is part of the type
      typed = jax.typeof(x).sharding.spec
      assert tuple(typed) + (None,) * (len(shape) - len(typed)) == tuple(
        spec
      ) + (None,) * (len(shape) - len(spec)), (what, k, typed, spec)


def _assert_close(a, b):
  """Equal up to float rounding: tight for float32, loose for half types."""
  half = jnp.dtype(a.dtype).itemsize < 4
  np.testing.assert_allclose(
    np.asarray(a, np.float32),
    np.asarray(b, np.float32),
    rtol=1e-2 if half else 1e-5,
    atol=1e-4 if half else 1e-6,
  )


def _loss(p, c):
  return sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in p.values()) * c


def _run_every_function(mesh, specs):
  """The public functions, jitted, for 4 steps; what they returned."""
  params = _mixed_tree(specs, mesh, 1.0)
  grads_ok = _mixed_tree(specs, mesh, 2.0**8)
  host = {k: np.array(v) for k, v in grads_ok.items()}
  host["half_last"][5, 60] = np.inf  # on the last device along the axis
  host["small_col"][3, 9] = np.nan
  bad = {
    k: (jnp.asarray(v) if mesh is None else jax.device_put(v, specs[k][1]))
    for k, v in host.items()
  }
  batches = [grads_ok, bad, grads_ok, grads_ok]
  tx = ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale(2.0**8))
  chained = optax.chain(
    ols.unscale_gradients(ols.DynamicLossScale(2.0**8)), optax.sgd(0.1)
  )
  out = {"finite": [], "chain": [], "update": [], "apply": [], "minimize": []}
  # Eager inits: under Auto axes a jitted one would leave the moments'
  # shardings to XLA, which replicates zeros (as for any Optax optimizer).
  state = tx.init(params)
  c_state = chained.init(params)
  # Compiled once, and called as compiled (their HLO is checked).
  compiled = {
    "finite": jax.jit(ols.all_finite).lower(grads_ok),
    "update": jax.jit(tx.update).lower(grads_ok, state, params),
    "apply": jax.jit(tx.apply_gradients, donate_argnums=(1, 2)).lower(
      grads_ok, state, params
    ),
    "chain": jax.jit(chained.update).lower(grads_ok, c_state, params),
    "minimize": jax.jit(
      lambda p, s, c: tx.minimize(_loss, p, s, c, max_retries=2)
    ).lower(params, state, jnp.float32(1)),
    "scaled": jax.jit(
      lambda s, p: ols.scaled_value_and_grad(_loss)(s, p, jnp.float32(1))
    ).lower(state, params),
  }
  compiled = {k: v.compile() for k, v in compiled.items()}
  finite, update, apply, chain, minimize, scaled = compiled.values()
  scale_of = jax.jit(lambda s: ols.get_loss_scale(s)())
  a_params = jax.tree.map(jnp.copy, params)  # donated
  a_state = tx.init(params)
  u_params, u_state = params, state
  m_params, m_state = params, state
  for grads in batches:
    out["finite"].append(bool(finite(grads)))
    updates, c_state = chain(grads, c_state, params)
    out["chain"].append((float(scale_of(c_state)), updates))
    updates, u_state = update(grads, u_state, u_params)
    u_params = optax.apply_updates(u_params, updates)
    out["update"].append((bool(u_state.should_apply), updates))
    a_params, a_state = apply(grads, a_state, a_params)
    out["apply"].append(float(scale_of(a_state)))
  for c in [1.0, np.nan, 1.0]:
    _, m_params, m_state = minimize(m_params, m_state, jnp.float32(c))
    out["minimize"].append(float(scale_of(m_state)))
  value, g = scaled(m_state, m_params)
  out["scaled"] = (value, g)
  out["params"] = (u_params, a_params, m_params)
  out["states"] = (u_state, a_state, m_state, c_state)
  return out, compiled


def check_every_function():
  # Every public function under jit, in `jax.set_mesh`, on trees of leaves
  # sharded along any axis: no gradient data moves, shardings are kept,
  # and the results are those of one device.
  for two_d in (False, True):
    specs = _mixed_specs(two_d)
    ref, _ = _run_every_function(None, specs)
    assert ref["finite"] == [True, False, True, True]
    assert [a for a, _ in ref["update"]] == [True, False, True, True]
    mesh = _mesh((2, 4), ("x", "y")) if two_d else _mesh((N,), ("d",))
    with jax.set_mesh(mesh):
      got, compiled = _run_every_function(mesh, specs)
    for what, c in compiled.items():
      _no_gradient_moves(c, (two_d, what))
    assert got["finite"] == ref["finite"]
    assert got["apply"] == ref["apply"] and got["minimize"] == ref["minimize"]
    for (a, u), (b, v) in zip(got["update"], ref["update"], strict=True):
      assert a == b
      _assert_kept(u, specs, "updates")
      for k in u:
        _assert_close(u[k], v[k])
    for (s, u), (t, v) in zip(got["chain"], ref["chain"], strict=True):
      assert s == t
      _assert_kept(u, specs, "chain updates")
      for k in u:
        _assert_close(u[k], v[k])
    for p, q in zip(got["params"], ref["params"], strict=True):
      _assert_kept(p, specs, "params")
      for k in p:
        _assert_close(p[k], q[k])
    for state in got["states"][:3]:
      _assert_kept(state.inner_state[0].mu, specs, "adam's mu")
      _assert_kept(state.inner_state[0].nu, specs, "adam's nu")
    _assert_kept(got["scaled"][1], specs, "scaled gradients")
    # The skip record names the global arrays' leaves, read on the host.
    report = _last_skip(got["states"][0])
    assert report == _last_skip(ref["states"][0])
    assert report.nonfinite == ("['half_last']", "['small_col']")


def check_orbax_sharded_state():
  # A sharded optimizer state, with a skip recorded, saved and restored
  # under the mesh: values, the record and every sharding come back.
  import tempfile

  import orbax.checkpoint as ocp

  specs = _mixed_specs(two_d=False)
  mesh = _mesh((N,), ("d",))
  with jax.set_mesh(mesh):
    params = _mixed_tree(specs, mesh, 1.0)
    tx = ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale())
    grads = _mixed_tree(specs, mesh, np.inf)
    _, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
    assert _last_skip(state).skipped_steps == 1
    target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      tx.init(params),
    )
    with tempfile.TemporaryDirectory() as tmp:
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(f"{tmp}/ckpt", state)
      with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(f"{tmp}/ckpt", target)
  assert _last_skip(restored) == _last_skip(state)
  for a, b in zip(
    jax.tree.leaves(restored), jax.tree.leaves(state), strict=True
  ):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b)
    if AXIS_TYPE is None:
      assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _assert_kept(restored.inner_state[0].mu, specs, "restored mu")


def check_vmap_members_sharded():
  # An ensemble of 8 members, the member axis sharded over the mesh: each
  # member skips on its own, and the record flags its own gradients.
  mesh = _mesh((N,), ("x",))
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
  with jax.set_mesh(mesh):
    params = {"w": jax.device_put(jnp.ones((N, 16)), P("x"))}
    host = np.ones((N, 16), np.float32)
    host[5, 3] = np.nan
    grads = {"w": jax.device_put(host, P("x"))}
    state = jax.vmap(tx.init)(params)
    step = jax.jit(jax.vmap(tx.apply_gradients))
    new_params, state = step(grads, state, params)
    applied = np.asarray(state.should_apply)
    assert applied.tolist() == [m != 5 for m in range(N)], applied
    np.testing.assert_array_equal(np.asarray(new_params["w"])[5], 1.0)
    flags = np.asarray(state.last_skip.nonfinite)[:, 0]
    assert flags.tolist() == [m == 5 for m in range(N)], flags
    assert new_params["w"].sharding.is_equivalent_to(
      NamedSharding(mesh, P("x")), 2
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class _OwnVerdict(ols.DynamicLossScale):
  """A loss scale whose class overrides `grads_finite`."""

  def grads_finite(self, scaled_grads, *, axis_name=None):
    return ols.all_finite(scaled_grads, axis_name=axis_name)


def check_vmap_members_sharded_with_integer_leaves():
  # Integer leaves beside float ones of several sizes, in an ensemble whose
  # member axis is sharded: each member's record flags its own float leaves,
  # with the check's flags and with a loss scale's own `grads_finite`.
  mesh = _mesh((N,), ("x",))
  with jax.set_mesh(mesh):
    host = {
      "c": np.ones((N, 7), np.float32),
      "d": np.ones((N, 3), np.float32),
      "n": np.ones((N, 2), np.int32),
    }
    host["c"][1, 0] = np.nan
    host["d"][2, 0] = np.inf
    grads = jax.device_put(host, P("x"))
    params = jax.tree.map(jnp.zeros_like, grads)
    expected = [[m == 1, m == 2, False] for m in range(N)]
    for loss_scale in [ols.DynamicLossScale(8.0), _OwnVerdict(8.0)]:
      tx = ols.LossScaleOptimizer(optax.sgd(0.1), loss_scale)
      step = jax.jit(jax.vmap(tx.apply_gradients))
      _, state = step(grads, jax.vmap(tx.init)(params), params)
      flags = np.asarray(state.last_skip.nonfinite).tolist()
      assert flags == expected, (type(loss_scale).__name__, flags)


def _aval(x):
  """What `select_tree` must agree on with jmp: its type, varying axes too."""
  t = jax.typeof(x)
  return t.shape, t.dtype, t.weak_type, t.manual_axis_type.varying


def _vary_over(x, axes):
  """`x` marked varying along every one of `axes` it does not vary along."""
  have = jax.typeof(x).manual_axis_type.varying
  missing = tuple(a for a in axes if a not in have)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def check_jmp_select_tree_in_shard_map():
  # jmp's `select_tree` is a `lax.select` per leaf, which takes leaves that
  # vary along different mesh axes; so does ours (one `cond`), with the same
  # values, dtypes, weak types and varying axes.
  from optax_lossscale import jmp

  try:
    import jmp as reference
  except ImportError:  # jmp's `select_tree`, as jmp writes it
    reference = None
  mesh = _mesh((2, 4), ("x", "y"))
  axes = ("x", "y")
  u = jax.device_put(jnp.arange(6.0) - 2.0, NamedSharding(mesh, P("x")))
  v = jax.device_put(jnp.arange(12.0) * 10, NamedSharding(mesh, P("y")))
  w = jax.device_put(jnp.ones(3) * 7, NamedSharding(mesh, P()))

  def trees(u, v, w):
    a = {"u": u, "v": v, "w": w, "h": w.astype(jnp.float16), "k": 2.0}
    b = {"u": w, "v": u * 2, "w": v, "h": v.astype(jnp.float16), "k": 3.0}
    return a, b

  results = {}
  for pred_name in ["invariant", "varying"]:

    @jax.jit
    @partial(
      jax.shard_map,
      mesh=mesh,
      in_specs=(P("x"), P("y"), P()),
      out_specs=P(axes),
    )
    def select(u, v, w, pred_name=pred_name):
      pred = jnp.sum(w) > 0 if pred_name == "invariant" else jnp.sum(u) > 0
      a, b = trees(u, v, w)
      ours = jmp.select_tree(pred, a, b)
      expected = jax.tree.map(partial(jax.lax.select, pred), a, b)
      if reference is not None:
        theirs = reference.select_tree(pred, a, b)
        for t, e in zip(
          jax.tree.leaves(theirs), jax.tree.leaves(expected), strict=True
        ):
          assert _aval(t) == _aval(e), (_aval(t), _aval(e))
      for o, e in zip(
        jax.tree.leaves(ours), jax.tree.leaves(expected), strict=True
      ):
        assert _aval(o) == _aval(e), (pred_name, _aval(o), _aval(e))
      out = (ours, expected)
      return jax.tree.map(lambda x: _vary_over(jnp.atleast_1d(x), axes), out)

    ours, expected = select(u, v, w)
    assert jax.tree.structure(ours) == jax.tree.structure(expected)
    for o, e in zip(
      jax.tree.leaves(ours), jax.tree.leaves(expected), strict=True
    ):
      assert o.dtype == e.dtype, (o, e)
      np.testing.assert_array_equal(np.asarray(o), np.asarray(e))
    results[pred_name] = ours
  # The invariant predicate is True: `a` everywhere. The varying one is
  # False on the devices whose shard of `u` sums to at most 0.
  np.testing.assert_array_equal(
    np.asarray(results["invariant"]["u"]).reshape(8, 3)[::4],
    np.arange(6.0).reshape(2, 3) - 2.0,
  )
  varying_u = np.asarray(results["varying"]["u"]).reshape(2, 4, 3)
  np.testing.assert_array_equal(varying_u[0], 7.0)  # sum(-2, -1, 0) <= 0
  np.testing.assert_array_equal(varying_u[1], [[1.0, 2.0, 3.0]] * 4)


def check_sharded_step_differentiates_in_reverse_mode():
  # The step's `cond` over sharded leaves is differentiated as a plain
  # `cond` (meta-learning through an optimizer step), forward and reverse.
  mesh = _mesh((N,), ("d",))
  with jax.set_mesh(mesh):
    tx = ols.LossScaleOptimizer(optax.sgd(0.5), ols.DynamicLossScale(4.0))
    params = {"w": jax.device_put(jnp.arange(16.0), P("d"))}
    state = tx.init(params)

    def applied(grads):
      return jnp.sum(tx.update(grads, state, params)[0]["w"])

    grads = {"w": jax.device_put(jnp.ones(16), P("d"))}
    got = jax.jit(jax.grad(applied))(grads)
    np.testing.assert_array_equal(got["w"], -0.5 / 4.0)
    if AXIS_TYPE is None:  # Explicit axes: the sharding is in the type
      assert jax.typeof(got["w"]).sharding.spec == P("d")
    nan = jnp.full(16, jnp.nan).at[1:].set(1.0)
    skipped = {"w": jax.device_put(nan, P("d"))}
    np.testing.assert_array_equal(jax.grad(applied)(skipped)["w"], 0.0)


def check_vmap_members_sharded_inside():
  # 4 members, each FSDP-sharded on an inner axis: `vmap` turns the step's
  # `cond` into a select, which must keep the members' shardings. Each
  # member equals the member run alone (to rounding: XLA fuses a batched
  # Adam step differently).
  mesh = _mesh((N,), ("d",))
  spec = P(None, "d", None)
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))

  def loss(p, x):
    return jnp.sum((p["w"] * x) ** 2) + jnp.sum(p["b"] ** 2)

  def minimize(p, s, x):
    return tx.minimize(loss, p, s, x, max_retries=2)

  with jax.set_mesh(mesh):
    params = {
      "w": jax.device_put(jnp.ones((4, 32, 8)), spec),
      "b": jnp.ones((4, 3)),
    }
    host = np.full((4, 32, 8), 2.0, np.float32)
    host[2, 3, 1] = np.nan
    grads = {"w": jax.device_put(host, spec), "b": jnp.ones((4, 3))}
    x = np.ones((4, 32, 8), np.float32)
    x[1] = 1e20  # member 1's loss is not finite: skipped
    x = jax.device_put(x, spec)
    state = jax.vmap(tx.init)(params)
    runs = {
      "update": (tx.update, (grads, state, params), 0),
      "apply_gradients": (tx.apply_gradients, (grads, state, params), 0),
      "minimize": (minimize, (params, state, x), 1),
    }
    for name, (fn, args, at) in runs.items():
      out = jax.jit(jax.vmap(fn))(*args)
      for m in range(4):
        alone = jax.jit(fn)(*jax.tree.map(lambda a, m=m: a[m], args))
        jax.tree.map(
          lambda a, b, m=m: np.testing.assert_allclose(
            np.asarray(a)[m], b, rtol=1e-6
          ),
          out,
          alone,
        )
      w = out[at]["w"]  # the updates or the new parameters
      assert w.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3), name
      if AXIS_TYPE is None:
        assert jax.typeof(w).sharding.spec == spec, (name, jax.typeof(w))
      applied = np.asarray(out[-1].should_apply).tolist()
      expected = (
        [True, False, True, True]
        if name == "minimize"
        else [True, True, False, True]
      )
      assert applied == expected, (name, applied)


if __name__ == "__main__":
  for arg in sys.argv[1:]:
    name, _, axes = arg.partition(":")
    AXIS_TYPE = {"": None, "explicit": None, "auto": AUTO}[axes]
    globals()[f"check_{name}"]()
    print("ok", arg)
