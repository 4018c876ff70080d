"""Checks run in a subprocess with 8 host CPU devices (see test_multidevice.py).

`python tests/multidevice_checks.py AXES NAME ...` runs each `check_NAME` in
one process (JAX starts once, and the checks share its compile caches), with
meshes of `jax.make_mesh`'s default axis types (AXES `explicit`) or of
`AxisType.Auto` (`auto`). Each check prints `ok NAME` or `FAIL NAME` and its
traceback; a failure does not stop the others.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_lossscale as ols  # noqa: E402
from optax_lossscale import jmp  # noqa: E402

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
  # A compiled step's only collectives are all-reduces of verdicts and
  # scalars: no gradient data is gathered or moved between devices.
  hlo = compiled.as_text()
  for op in GATHERS:
    assert f"{op}(" not in hlo and f"{op}-start(" not in hlo, (what, op)


# --- pmap (no mesh: run once) -------------------------------------------------


def _in_shard_map(mesh):
  """A decorator: `step(params, state, grads)` jitted inside `shard_map`,
  the parameters and gradients split along "i", the state replicated."""
  specs = {"in_specs": (P("i"), P(), P("i")), "out_specs": (P("i"), P())}
  return lambda step: jax.jit(jax.shard_map(step, mesh=mesh, **specs))


def _replica_grads(bad=None):
  """Gradients of 2**10 on each replica, with a NaN on replica `bad`."""
  grads = np.full((N, 4), 2.0**10, np.float32)
  if bad is not None:
    grads[bad, 1] = np.nan
  return {"w": jnp.asarray(grads)}


def check_pmap_replicas_agree():
  # A NaN gradient on one replica, then a NaN loss on another: every
  # replica skips, with the same scale (halved, then kept) and counters.
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**10, 2), axis_name="i"
  )
  params = {"w": np.zeros((N, 4), np.float32)}
  fresh = jax.pmap(tx.init)(params)
  step = jax.pmap(
    lambda g, s, p, v: tx.apply_gradients(g, s, p, value=v), axis_name="i"
  )
  ones = np.ones(N, np.float32)
  nan_loss = ones.copy()
  nan_loss[2] = np.nan
  state = fresh
  for grads, loss, applied, scale, w in [
    (_replica_grads(3), ones, False, 2.0**9, 0.0),
    (_replica_grads(), nan_loss, False, 2.0**9, 0.0),
    # 2**10 unscaled by 2**9 is 2; times the rate 0.1.
    (_replica_grads(), ones, True, 2.0**9, -0.2),
  ]:
    params, state = step(grads, state, params, loss)
    np.testing.assert_array_equal(state.should_apply, applied)
    np.testing.assert_array_equal(state.loss_scale.current_loss_scale, scale)
    np.testing.assert_allclose(params["w"], w, rtol=1e-6)
  np.testing.assert_array_equal(state.skipped_steps, 2)
  np.testing.assert_array_equal(state.nonfinite_loss_steps, 1)

  # Without axis_name, each replica decides alone (through `update`).
  alone = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**10, 2)
  )
  _, state = jax.pmap(alone.update)(_replica_grads(3), fresh, params)
  assert np.asarray(state.should_apply).sum() == N - 1

  # `all_finite`, `LossScale.update` and `unscale_gradients` agree too.
  loss_scale = ols.DynamicLossScale(2.0**10)
  unscale = ols.unscale_gradients(loss_scale, axis_name="i")

  @partial(jax.pmap, axis_name="i")
  def entry_points(grads, loss_scale, u_state):
    _, u_state = unscale.update(grads, u_state)
    finite = ols.all_finite(grads, axis_name="i")
    return finite, loss_scale.update(grads, axis_name="i"), u_state

  stack = partial(jax.tree.map, lambda x: np.stack([x] * N))
  finite, (new, ok), u_state = entry_points(
    _replica_grads(6), stack(loss_scale), stack(unscale.init(None))
  )
  assert not np.asarray(finite).any() and not np.asarray(ok).any()
  assert not np.asarray(u_state.should_apply).any()
  np.testing.assert_array_equal(new.current_loss_scale, 2.0**9)
  np.testing.assert_array_equal(u_state.loss_scale.current_loss_scale, 2.0**9)


def check_pmap_docs_step():
  # The docs' pmap step: with its `pmean` of the gradients the replicas stay
  # equal; without it they diverge (axis_name only makes them skip together).
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**10), axis_name="batch"
  )

  def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] - y) ** 2)

  def step(params, opt_state, x, y, mean):
    loss, grads = ols.scaled_value_and_grad(loss_fn)(opt_state, params, x, y)
    if mean:
      grads = jax.lax.pmean(grads, "batch")
    return tx.apply_gradients(grads, opt_state, params, value=loss)

  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, 4, 3)).astype(np.float32)
  y = rng.normal(size=(N, 4)).astype(np.float32)
  params = {"w": np.zeros((N, 3), np.float32)}  # the same on every replica
  state = jax.pmap(tx.init)(params)
  for mean in (True, False):
    run = jax.pmap(partial(step, mean=mean), axis_name="batch")
    p, s = run(*run(params, state, x, y), x, y)
    distinct = len({tuple(row) for row in np.asarray(p["w"]).tolist()})
    assert distinct == (1 if mean else N), (mean, distinct)

  # `check_state` reads the replicas' states element by element.
  assert ols.check_state(s) is s
  bad = s._replace(consecutive_skipped_steps=s.skipped_steps + 1)
  try:
    ols.check_state(bad)
    raise AssertionError("check_state accepted more consecutive skips")
  except ValueError as e:
    assert "`tree.consecutive_skipped_steps`" in str(e), e


def check_pmap_minimize_retries_agree():
  # One replica's batch overflows at high scales: all replicas run the same
  # number of attempts (the loss has a collective inside, which would
  # deadlock otherwise) and end with equal scales. Retries that run out
  # record the step once, with the flags agreed over the replicas.
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**15, 100), axis_name="i"
  )
  devices = jax.devices()[:4]
  params = {"w": jnp.full((4, 3), 0.5, jnp.float32)}
  state = jax.pmap(tx.init, devices=devices)(params)
  x = np.ones((4, 2, 3), np.float32)
  x[1] *= 300.0  # replica 1 only
  x = jnp.asarray(x)

  def loss(p, x):
    h = (x.astype(jnp.float16) * p["w"].astype(jnp.float16)).astype(jnp.float32)
    return jax.lax.pmean(jnp.mean(h**2), "i")

  def run(max_retries):
    step = jax.pmap(
      lambda p, s, x: tx.minimize(loss, p, s, x, max_retries=max_retries),
      axis_name="i",
      devices=devices,
    )
    return step(params, state, x)[1:]

  new_params, new_state = run(16)
  retries = np.asarray(new_state.retries)
  assert (retries == retries[0]).all() and retries[0] > 0, retries
  assert np.asarray(new_state.should_apply).all()
  scales = np.asarray(new_state.loss_scale.current_loss_scale)
  assert len(set(scales.tolist())) == 1, scales
  assert np.isfinite(np.asarray(new_params["w"])).all()
  assert ols.skip_reports(new_state) == []  # retries that succeed: no record

  _, new_state = run(int(retries[0]) - 1)  # one attempt short
  np.testing.assert_array_equal(new_state.skipped_steps, 1)
  reports = ols.skip_reports(new_state)  # one per replica
  assert [r.member for r in reports] == [0, 1, 2, 3], reports
  for report in reports:  # replica 1's overflow, on every replica
    assert report._replace(member=0) == reports[0], reports
  assert reports[0].nonfinite == ("['w']",), reports
  replica = jax.tree.map(lambda x: x[0], new_state)
  assert _last_skip(replica) == reports[0]._replace(member=None)


# --- shard_map ------------------------------------------------------------------


def check_shard_map():
  # `update` inside `shard_map`, the replicas agreeing through axis_name.
  mesh = _mesh((N,), ("i",))
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(2.0**10, 2), axis_name="i"
  )
  state = tx.init({"w": jnp.zeros((1, 4))})

  @_in_shard_map(mesh)
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  sharded = NamedSharding(mesh, P("i"))
  params = jax.device_put({"w": jnp.zeros((N, 4))}, sharded)
  for bad, applied, w in [(5, False, 0.0), (None, True, -0.2)]:
    grads = jax.device_put(_replica_grads(bad), sharded)
    params, state = step(params, state, grads)
    assert bool(state.should_apply) == applied
    assert float(state.loss_scale()) == 2.0**9
    np.testing.assert_allclose(params["w"], w, rtol=1e-6)
  # A skipped step given a NaN in one replica's block of the parameters: the
  # replicas agree on the record of it.
  host = np.asarray(params["w"]).copy()
  host[3, 0] = np.nan
  grads = jax.device_put(_replica_grads(5), sharded)
  _, state = step(jax.device_put({"w": host}, sharded), state, grads)
  assert not bool(state.should_apply)
  assert int(state.last_nonfinite_write.step) == 1  # the last applied
  assert np.asarray(state.last_nonfinite_write.nonfinite).tolist() == [True]


def check_shard_map_spikes():
  # The spike rule on sharded (FSDP) gradients inside `shard_map`: the norm
  # and each leaf's norm sum the blocks; a spike in one block skips all.
  mesh = _mesh((N,), ("i",))
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1),
    ols.DynamicLossScale(2.0**10),
    axis_name="i",
    spike_sigmas=6.0,
    spike_window=8,
  )
  state = tx.init({"w": jnp.zeros((1, 4)), "b": jnp.zeros((1, 2))})

  @_in_shard_map(mesh)
  def step(params, state, grads):
    return tx.apply_gradients(grads, state, params)

  sharded = NamedSharding(mesh, P("i"))
  params = jax.device_put(
    {"w": jnp.zeros((N, 4)), "b": jnp.zeros((N, 2))}, sharded
  )
  rng = np.random.default_rng(0)
  for i in range(10):
    w = rng.normal(size=(N, 4)).astype(np.float32) * 2.0**10
    if i == 9:
      w[3] *= 1000.0  # one block's outlier
    b = rng.normal(size=(N, 2)).astype(np.float32) * 2.0**10
    grads = jax.device_put({"w": w, "b": b}, sharded)
    before = params
    params, state = step(params, state, grads)
  assert not bool(state.should_apply)
  jax.tree.map(np.testing.assert_array_equal, before, params)
  (report,) = ols.skip_reports(state)
  assert report.reason == "spike" and report.largest[0] == "['w']", report


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
  # vary along different mesh axes; so does ours, with the same values,
  # dtypes, weak types and varying axes.
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


# --- sharded jit: every public function on trees sharded along every axis ------

XY = ("x", "y")
# Leaves sharded along each axis, along both (jointly and separately) and
# along none; float32, float16 and bfloat16; small (read in stacks when
# whole) and large; 1-D, 2-D and 3-D.
SPECS = {
  "both": ((8, 16), P("x", "y"), jnp.float32),
  "half_last": ((24, 64), P(None, XY), jnp.float16),
  "big_col": ((136, 256), P(None, XY), jnp.float32),
  "half_big": ((40, 1000), P(None, "y"), jnp.float16),
  "crossed": ((2, 16, 8), P(None, "y", "x"), jnp.bfloat16),
  "vector": ((8,), P("x"), jnp.float16),
  "odd": ((7, 5), P(), jnp.float32),
}


def _tree(mesh, value, poison=()):
  """A tree of SPECS' leaves around `value`; `poison`: (leaf, index, value)."""
  rng = np.random.default_rng(0)
  tree = {}
  for k, (shape, spec, dtype) in SPECS.items():
    host = (rng.uniform(0.5, 1.5, shape) * value).astype(dtype)
    for leaf, index, bad in poison:
      if leaf == k:
        host[index] = bad
    tree[k] = jnp.asarray(host) if mesh is None else jax.device_put(host, spec)
  return tree


def _assert_kept(tree, what):
  """Each leaf of `tree` is sharded as SPECS says, in its type too."""
  for k, x in tree.items():
    shape, spec, _ = SPECS[k]
    expected = NamedSharding(x.sharding.mesh, spec)
    assert x.sharding.is_equivalent_to(expected, len(shape)), (what, k, x)
    if AXIS_TYPE is None:  # Explicit: the sharding is part of the type
      typed = tuple(jax.typeof(x).sharding.spec)
      typed += (None,) * (len(shape) - len(typed))
      assert typed == tuple(spec) + (None,) * (len(shape) - len(spec)), (
        what,
        k,
        typed,
        spec,
      )


def _assert_close(a, b, what):
  """Equal up to float rounding: tight for float32, loose for half types."""
  rtol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 3e-2}[a.dtype.name]
  np.testing.assert_allclose(
    np.asarray(a, np.float32),
    np.asarray(b, np.float32),
    rtol=rtol,
    atol=1e-6 if rtol < 1e-2 else 1e-4,
    err_msg=str(what),
  )


def _loss(p, c):
  # Linear: its gradients are `c` everywhere, whatever the parameters.
  return sum(jnp.sum(x.astype(jnp.float32)) for x in p.values()) * c


def _half_square(p):
  # Gradients `p`, sharded as the parameters under Auto axes too.
  return sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in p.values()) / 2


def _compile_every_function(tx, chained, grads, state, c_state, params):
  """The public functions, jitted and compiled once (their HLO is read)."""
  lowered = {
    "finite": jax.jit(ols.all_finite).lower(grads),
    "update": jax.jit(tx.update).lower(grads, state, params),
    "apply": jax.jit(tx.apply_gradients, donate_argnums=(1, 2)).lower(
      grads, state, params
    ),
    "chain": jax.jit(chained.update).lower(grads, c_state, params),
    "minimize": jax.jit(
      lambda p, s, c: tx.minimize(_loss, p, s, c, max_retries=2)
    ).lower(params, state, jnp.float32(1)),
    "scaled": jax.jit(ols.scaled_value_and_grad(_half_square)).lower(
      state, params
    ),
  }
  compiled = {k: v.compile() for k, v in lowered.items()}
  for what, c in compiled.items():
    _no_gradient_moves(c, what)
  return compiled


def check_every_function():
  # Every public function under jit, in `jax.set_mesh`, on a tree of leaves
  # sharded along every axis: no gradient data moves, shardings are kept
  # (through an Orbax checkpoint too), and the values are those of one
  # device. The unscaled gradients repeat,
  # so every step of Adam is -lr: the values are known.
  mesh = _mesh((2, 4), XY)
  with jax.set_mesh(mesh):
    _every_function(mesh)


def _every_function(mesh):
  params = _tree(mesh, 1.0)
  grads = _tree(mesh, 2.0**8)
  # An inf on the last device along the axes, a NaN on the first.
  poison = [("half_last", (5, 60), np.inf), ("both", (0, 1), np.nan)]
  bad = _tree(mesh, 2.0**8, poison)
  halved = _tree(mesh, 2.0**7)  # the same gradients at the halved scale
  unscaled = {k: np.asarray(x, np.float32) for k, x in _tree(None, 1.0).items()}
  tx = ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale(2.0**8))
  chained = optax.chain(
    ols.unscale_gradients(ols.DynamicLossScale(2.0**8)), optax.sgd(0.1)
  )
  # Eager inits: under Auto axes a jitted one would leave the moments'
  # shardings to XLA, which replicates zeros (as for any Optax optimizer).
  state, c_state = tx.init(params), chained.init(params)
  compiled = _compile_every_function(tx, chained, grads, state, c_state, params)
  finite, update, apply, chain, minimize, scaled = compiled.values()
  a_params, a_state = _tree(mesh, 1.0), tx.init(params)  # donated
  u_params, u_state = params, state
  apply_updates = jax.jit(optax.apply_updates)
  for t, g in enumerate([grads, bad, halved, halved]):
    ok, scale = t != 1, 2.0**8 if t < 1 else 2.0**7  # the scale after
    assert bool(finite(g)) == ok
    updates, c_state = chain(g, c_state, params)
    assert float(c_state[0].loss_scale()) == scale
    _assert_kept(updates, "chain updates")
    for k, u in updates.items():  # sgd(0.1) of the unscaled gradients
      if ok:
        _assert_close(u, -0.1 * unscaled[k], ("chain", t, k))
    updates, u_state = update(g, u_state, u_params)
    u_params = apply_updates(u_params, updates)
    assert bool(u_state.should_apply) == ok
    _assert_kept(updates, "updates")
    for k, u in updates.items():
      _assert_close(u, np.full(u.shape, -1e-2 * ok), ("update", t, k))
    a_params, a_state = apply(g, a_state, a_params)
    assert float(a_state.loss_scale()) == scale
  m_params, m_state = params, state
  for c in [1.0, np.nan, 1.0]:  # a NaN loss: skipped, the scale kept
    _, m_params, m_state = minimize(m_params, m_state, jnp.float32(c))
    assert float(m_state.loss_scale()) == 2.0**8
  value, scaled_grads = scaled(m_state, m_params)
  _assert_kept(scaled_grads, "scaled gradients")
  host = {k: np.asarray(x, np.float32) for k, x in m_params.items()}
  total = sum(np.sum(x.astype(np.float64) ** 2) for x in host.values()) / 2
  np.testing.assert_allclose(float(value), total, rtol=1e-5)
  for k, g in scaled_grads.items():
    _assert_close(g, host[k] * 2**8, ("scaled", k))
  for steps, p in [(3, u_params), (3, a_params), (2, m_params)]:
    _assert_kept(p, "params")
    for k in p:
      expected = np.asarray(params[k], np.float32) - 1e-2 * steps
      _assert_close(p[k], expected, ("params", steps, k))
  for s in (u_state, a_state, m_state):
    _assert_kept(s.inner_state[0].mu, "adam's mu")
    _assert_kept(s.inner_state[0].nu, "adam's nu")
    # The loss scale, the counters and the record are replicated.
    for x in jax.tree.leaves(s._replace(inner_state=None)):
      assert x.sharding.is_fully_replicated, x.sharding
  # The skip record names the global arrays' leaves, read on the host.
  report = _last_skip(u_state)
  assert report.nonfinite == ("['both']", "['half_last']"), report
  assert (report.loss_scale, report.next_loss_scale) == (2.0**8, 2.0**7)
  # A sharded state, with a skip recorded, saved and restored in the mesh;
  # the same Orbax code restores under either axis type.
  if AXIS_TYPE is None:
    _orbax_round_trip(u_state)
  # Each shard is read: a NaN on the first, a middle or the last device
  # along a leaf's axes is found.
  for leaf in ("big_col", "half_big", "crossed", "vector"):
    for f in (0, 0.4, 1):
      index = tuple(int(f * (d - 1)) for d in SPECS[leaf][0])
      assert not bool(finite(_tree(mesh, 1.0, [(leaf, index, np.nan)])))


def check_global_norm():
  # The norm is the global one: under jit on a mesh, sharded leaves sum
  # their shards and replicated ones count once; the clip uses it.
  mesh = _mesh((2, 4), XY)
  with jax.set_mesh(mesh):
    grads, params = _tree(mesh, 2.0**8), _tree(mesh, 1.0)
    host = {k: np.asarray(x, np.float64) / 2**8 for k, x in grads.items()}
    norm = np.sqrt(sum(np.sum(x**2) for x in host.values()))
    tx = ols.LossScaleOptimizer(
      optax.sgd(1.0), ols.DynamicLossScale(2.0**8), max_norm=norm / 2
    )
    step = jax.jit(tx.apply_gradients)
    new, state = step(grads, tx.init(params), params)
    np.testing.assert_allclose(float(state.grad_norm), norm, rtol=1e-5)
    _assert_kept(new, "clipped parameters")
    for k, x in new.items():  # clipped to half the norm
      expected = np.asarray(params[k], np.float32) - host[k] / 2
      _assert_close(x, expected, ("clipped", k))
    _no_gradient_moves(step.lower(grads, state, params).compile(), "norm")
  # Inside shard_map, the blocks of gradients that vary along axis_name are
  # summed across it (FSDP); gradients that do not vary count once; in
  # float32 and float16.
  mesh = _mesh((N,), ("i",))
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.NoOpLossScale(), axis_name="i"
  )
  for dtype in (np.float32, np.float16):
    blocks = np.arange(1.0, 4 * N + 1).reshape(N, 4).astype(dtype)
    state = tx.init({"w": jnp.zeros((1, 4), dtype)})
    for spec, grads in [(P("i"), blocks), (P(), blocks[:1])]:

      @jax.jit
      @partial(
        jax.shard_map, mesh=mesh, in_specs=(spec, P(), spec), out_specs=P()
      )
      def norm_of(params, state, grads):
        return tx.update(grads, state, params)[1].grad_norm

      sharded = NamedSharding(mesh, spec)
      zeros = jax.device_put({"w": np.zeros_like(grads)}, sharded)
      found = norm_of(zeros, state, jax.device_put({"w": grads}, sharded))
      expected = np.linalg.norm(grads.astype(np.float64))
      np.testing.assert_allclose(float(found), expected, rtol=1e-6)


def check_pmap_global_norm():
  # Under pmap, gradients averaged across the replicas count once.
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.NoOpLossScale(), axis_name="i"
  )
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)
  grads = np.arange(1.0, 4 * N + 1, dtype=np.float32).reshape(N, 4)

  def step(params, state, grads):
    grads = jax.lax.pmean(grads, "i")
    return tx.update(grads, state, params)[1].grad_norm

  stack = lambda x: jnp.stack([x] * N)  # noqa: E731
  found = jax.pmap(step, axis_name="i")(
    jax.tree.map(stack, params), jax.tree.map(stack, state), {"w": grads}
  )
  np.testing.assert_allclose(found, np.linalg.norm(grads.mean(0)), rtol=1e-6)


def _orbax_round_trip(state):
  """`state` saved and restored with Orbax into a target of its shardings."""
  import orbax.checkpoint as ocp

  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    state,
  )
  with tempfile.TemporaryDirectory() as tmp:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(f"{tmp}/ckpt", state)
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(f"{tmp}/ckpt", target)
  # Values, the skip record and every sharding come back.
  assert _last_skip(restored) == _last_skip(state)
  for a, b in zip(
    jax.tree.leaves(restored), jax.tree.leaves(state), strict=True
  ):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b)
    if AXIS_TYPE is None:
      assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _assert_kept(restored.inner_state[0].mu, "restored mu")


def check_sharded_step_differentiates_in_reverse_mode():
  # The step's `cond` over sharded leaves is differentiated as a plain
  # `cond` (meta-learning through an optimizer step).
  mesh = _mesh((N,), ("d",))
  with jax.set_mesh(mesh):
    tx = ols.LossScaleOptimizer(optax.sgd(0.5), ols.DynamicLossScale(4.0))
    params = {"w": jax.device_put(jnp.arange(16.0), P("d"))}
    state = tx.init(params)

    @jax.jit
    @jax.grad
    def applied(grads):
      return jnp.sum(tx.update(grads, state, params)[0]["w"])

    got = applied({"w": jax.device_put(jnp.ones(16), P("d"))})
    np.testing.assert_array_equal(got["w"], -0.5 / 4.0)
    if AXIS_TYPE is None:  # Explicit axes: the sharding is in the type
      assert jax.typeof(got["w"]).sharding.spec == P("d")
    nan = jnp.full(16, jnp.nan).at[1:].set(1.0)
    skipped = applied({"w": jax.device_put(nan, P("d"))})
    np.testing.assert_array_equal(skipped["w"], 0.0)


# --- vmap ensembles -------------------------------------------------------------


def check_vmap_members_sharded():
  # An ensemble of 8 members, the member axis sharded over the mesh, with
  # float leaves of two sizes, float16 ones (stacked and read in place) and
  # an integer leaf: each member skips on its own, keeps its
  # parameters when it does, and its record flags its own float leaves; the
  # shardings are kept.
  mesh = _mesh((N,), ("x",))
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0))
  with jax.set_mesh(mesh):
    host = {
      "c": np.ones((N, 7), np.float32),
      "d": np.ones((N, 3), np.float32),
      "e": np.ones((N, 2, 3), np.float16),
      "f": np.ones((N, 50, 100), np.float16),
      "n": np.ones((N, 2), np.int32),
    }
    host["c"][1, 0] = np.nan
    host["d"][2, 0] = np.inf
    host["f"][5, 10, 20] = -np.inf
    grads = jax.device_put(host, P("x"))
    params = jax.tree.map(jnp.zeros_like, grads)
    step = jax.jit(jax.vmap(tx.apply_gradients))
    new_params, state = step(grads, jax.vmap(tx.init)(params), params)
  applied = np.asarray(state.should_apply).tolist()
  assert applied == [m not in (1, 2, 5) for m in range(N)], applied
  flags = np.asarray(state.last_skip.nonfinite).tolist()
  assert flags == [[m == 1, m == 2, False, m == 5, False] for m in range(N)]
  w = np.asarray(new_params["c"])
  np.testing.assert_array_equal(w[[1, 2, 5]], 0.0)
  np.testing.assert_allclose(np.delete(w, [1, 2, 5], axis=0), -0.1 / 8.0)
  for x in jax.tree.leaves(new_params):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 2), x
  reports = ols.skip_reports(state)
  assert [(r.member, r.nonfinite) for r in reports] == [
    (1, ("['c']",)),
    (2, ("['d']",)),
    (5, ("['f']",)),
  ], reports


def check_vmap_members_sharded_inside():
  # 4 members, each FSDP-sharded on an inner axis: `vmap` turns the step's
  # `cond` into a select, which must keep the members' shardings. Member 2's
  # gradients hold a NaN; member 1's loss is not finite. Adam's first step
  # is -lr: each member's values are those it has run alone.
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
    x[1] = 1e20
    x = jax.device_put(x, spec)
    state = jax.vmap(tx.init)(params)
    updates, u_state = jax.jit(jax.vmap(tx.update))(grads, state, params)
    new_params, a_state = jax.jit(jax.vmap(tx.apply_gradients))(
      grads, state, params
    )
    _, m_params, m_state = jax.jit(jax.vmap(minimize))(params, state, x)
  for s, applied in [
    (u_state, [True, True, False, True]),
    (a_state, [True, True, False, True]),
    # A non-finite loss is not retried: skipped, the scale kept.
    (m_state, [True, False, True, True]),
  ]:
    assert np.asarray(s.should_apply).tolist() == applied
    scales = [8.0 if ok or s is m_state else 4.0 for ok in applied]
    np.testing.assert_array_equal(s.loss_scale(), scales)
    np.testing.assert_array_equal(s.retries, 0)
    for m, ok in enumerate(applied):
      for k in ("w", "b"):
        p = m_params if s is m_state else new_params
        np.testing.assert_allclose(p[k][m], 1 - 0.1 * ok, rtol=1e-5)
        if s is u_state:
          np.testing.assert_allclose(updates[k][m], -0.1 * ok, rtol=1e-5)
  for what, w in [
    ("update", updates["w"]),
    ("apply_gradients", new_params["w"]),
    ("minimize", m_params["w"]),
  ]:
    assert w.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3), what
    if AXIS_TYPE is None:
      assert jax.typeof(w).sharding.spec == spec, (what, jax.typeof(w))


def main(axes, names):
  global AXIS_TYPE
  AXIS_TYPE = {"explicit": None, "auto": AUTO}[axes]
  for name in names:
    start = time.perf_counter()
    try:
      globals()[f"check_{name}"]()
    except Exception:
      print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    else:
      print(f"ok {name} ({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
