"""LossScaleOptimizer: update, apply_gradients and gradient_transformation.

An applied step is `inner` on the unscaled gradients; a skipped step changes
nothing but the loss scale, the counters and the skip record. The step's
structure is read from its jaxpr: one `cond`, the gradients read once, no
host callback.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import warnings
from typing import Any

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.experimental import checkify
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

pytestmark = pytest.mark.usefixtures("standard_promotion")

INF = float("inf")
NAN = float("nan")


def _params(dtype=jnp.float32):
  return {
    "w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)
    .reshape(2, 3)
    .astype(dtype),
    "b": jnp.zeros(3, dtype),
  }


def _unscaled(t, params):
  """Step `t`'s unscaled gradients; step 3's hold an inf."""
  rng = np.random.default_rng(t)
  grads = {
    k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()
  }
  if t == 3:
    grads["b"][1] = np.inf
  return grads


def _scaled(grads, state):
  """`grads` times the state's loss scale (a power of two: exact)."""
  scale = np.float32(state.loss_scale())
  return jax.tree.map(lambda g: jnp.asarray(g * scale), grads)


def _eqns(jaxpr):
  """Every equation of `jaxpr`, nested ones (cond branches, loops) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _count(jaxpr, primitive):
  return sum(e.primitive is primitive for e in _eqns(jaxpr))


# --- applied and skipped steps --------------------------------------------------


def test_gradient_transformation_is_the_instance_s_init_and_update():
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale())
  transformation = tx.gradient_transformation()
  assert isinstance(transformation, optax.GradientTransformationExtraArgs)
  assert transformation.init == tx.init and transformation.update == tx.update


@pytest.mark.parametrize(
  ("inner", "entry", "scales"),
  [
    ("adam", "update", [8, 16, 16, 8, 8, 16]),
    ("adam", "apply_gradients", [8, 16, 16, 8, 8, 16]),
  ],
)
def test_applied_steps_are_inner_on_unscaled_grads_and_a_skip_changes_nothing(
  inner, entry, scales
):
  inner = {"adam": lambda: optax.adam(0.1)}[inner]
  tx = ols.LossScaleOptimizer(inner(), ols.DynamicLossScale(8.0, 2))
  reference = inner()
  reference_update = jax.jit(reference.update)
  params = expected = _params()
  state, ref_state = tx.init(params), reference.init(params)
  step = jax.jit(getattr(tx, entry))
  seen = []
  for t in range(6):
    grads = _unscaled(t, params)
    out, new_state = step(_scaled(grads, state), state, params)
    new_params = (
      out if entry == "apply_gradients" else optax.apply_updates(params, out)
    )
    if t == 3:  # skipped: parameters and inner state bit for bit
      chex.assert_trees_all_equal(new_params, params)
      chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
      if entry != "apply_gradients":
        chex.assert_trees_all_equal(out, jax.tree.map(jnp.zeros_like, params))
      assert not bool(new_state.should_apply)
    else:  # applied: inner on the unscaled gradients
      updates, ref_state = reference_update(grads, ref_state, expected)
      expected = optax.apply_updates(expected, updates)
      assert bool(new_state.should_apply)
    params, state = new_params, new_state
    chex.assert_trees_all_close(params, expected, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(
      state.inner_state, ref_state, rtol=1e-6, atol=1e-7
    )
    seen.append(float(state.loss_scale()))
  assert seen == scales
  assert int(state.skipped_steps) == 1 and int(state.retries) == 0


# One optimizer with an inner state, its steps compiled once for the tests
# that share it (each with the loss as `value=`).
TX = ols.LossScaleOptimizer(
  optax.sgd(0.1, momentum=0.9), ols.DynamicLossScale(8.0)
)
APPLY = jax.jit(TX.apply_gradients)
UPDATE = jax.jit(TX.update)
W = {"w": jnp.ones(2)}


def test_counters_count_skips_nonfinite_losses_and_streaks():
  state = TX.init(W)
  # (gradient, loss): the loss is given as `value=` on every step.
  pattern = [(1, 1), (NAN, 1), (1, 1), (INF, 1), (1, NAN), (1, INF), (1, 1)]
  counts = []
  for grad, loss in pattern:
    before = state
    _, state = APPLY(
      {"w": jnp.full(2, grad)}, state, W, value=jnp.float32(loss)
    )
    if state.should_apply:  # an applied step leaves the record bit for bit
      chex.assert_trees_all_equal(state.last_skip, before.last_skip)
    else:  # a skipped one the inner state
      chex.assert_trees_all_equal(state.inner_state, before.inner_state)
    counts.append(
      (
        int(state.skipped_steps),
        int(state.consecutive_skipped_steps),
        int(state.nonfinite_loss_steps),
        bool(state.should_apply),
      )
    )
  assert counts == [
    (0, 0, 0, True),
    (1, 1, 0, False),
    (1, 0, 0, True),
    (2, 1, 0, False),
    (3, 2, 1, False),
    (4, 3, 2, False),
    (4, 0, 2, True),
  ]
  for counter in (
    "skipped_steps",
    "consecutive_skipped_steps",
    "nonfinite_loss_steps",
    "retries",
  ):
    assert getattr(state, counter).dtype == jnp.int32
  # Two overflows lowered the scale; the two non-finite losses did not.
  assert float(state.loss_scale()) == 2.0
  # An applied step synchronises nothing with the host.
  grads, one = {"w": jnp.ones(2)}, jnp.float32(1)
  with jax.transfer_guard("disallow"):
    for _ in range(2):
      _, state = APPLY(grads, state, W, value=one)
    jax.block_until_ready(state)
  assert int(state.consecutive_skipped_steps) == 0


@pytest.mark.parametrize(
  ("loss_scale", "entry"),
  [
    (TX.loss_scale, "apply_gradients"),
    (TX.loss_scale, "update"),
    (ols.FixedLossScale(8), "apply_gradients"),
  ],
  ids=["dynamic", "dynamic-update", "fixed"],
)
def test_a_nonfinite_loss_skips_and_keeps_the_scale(loss_scale, entry):
  if loss_scale is TX.loss_scale:
    tx, step = TX, {"update": UPDATE, "apply_gradients": APPLY}[entry]
  else:
    tx = ols.LossScaleOptimizer(optax.sgd(0.1, momentum=0.9), loss_scale)
    step = jax.jit(getattr(tx, entry))
  _, state = step({"w": jnp.ones(2)}, tx.init(W), W, value=jnp.float32(1))
  for loss in [NAN, INF]:
    # Finite gradients, non-finite loss: skipped, the loss scale kept.
    out, new = step({"w": jnp.ones(2)}, state, W, value=jnp.float32(loss))
    chex.assert_trees_all_equal(new.loss_scale, state.loss_scale)
    chex.assert_trees_all_equal(new.inner_state, state.inner_state)
    assert not bool(new.should_apply)
    state = new
  assert int(state.nonfinite_loss_steps) == 2 == int(state.skipped_steps)


@pytest.mark.parametrize(
  "loss_scale", [ols.FixedLossScale(2), ols.NoOpLossScale()], ids=repr
)
def test_skip_nonfinite_false_with_fixed_and_noop_is_tensorflow(loss_scale):
  grads, params = {"w": jnp.array([NAN, 1.0])}, {"w": jnp.zeros(2)}
  skipping = ols.LossScaleOptimizer(optax.sgd(1.0), loss_scale)
  updates, state = skipping.update(grads, skipping.init(params), params)
  assert not bool(state.should_apply) and int(state.skipped_steps) == 1
  np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
  tf_exact = ols.LossScaleOptimizer(
    optax.sgd(1.0), loss_scale, skip_nonfinite=False
  )
  updates, state = tf_exact.update(grads, tf_exact.init(params), params)
  assert bool(state.should_apply) and int(state.skipped_steps) == 0
  assert bool(jnp.isnan(updates["w"][0]))
  np.testing.assert_array_equal(updates["w"][1], -1.0 / float(loss_scale()))


# --- TensorFlow's optimizer test vectors ---------------------------------------


@pytest.mark.parametrize(
  ("inner", "loss_scale", "loss", "params", "trace"),
  [
    # (params, loss scale) after each step, from TensorFlow's tests.
    (
      optax.sgd(2.0),
      ols.FixedLossScale(10),
      lambda v: v,
      5.0,
      [(5, 10), (3, 10)],
    ),
    (
      optax.sgd(2.0),
      ols.DynamicLossScale(2, 1, 2),
      lambda v: v,
      5.0,
      [(5, 2), (3, 4), (1, 8)],
    ),
    (
      optax.sgd(2.0),
      ols.DynamicLossScale(2, 1, 2),
      lambda v: v * jnp.nan,
      5.0,
      [(5, 2), (5, 1)],
    ),
    (
      optax.sgd(1.0, momentum=1.0),
      ols.DynamicLossScale(2, 1, 4),
      jnp.sum,
      [1.0, 2.0],
      [([1, 2], 2), ([0, 1], 8), ([-2, -1], 32)],
    ),
  ],
  ids=["fixed", "dynamic", "nan", "momentum"],
)
def test_tensorflow_optimizer_vectors(inner, loss_scale, loss, params, trace):
  tx = ols.LossScaleOptimizer(inner, loss_scale)
  params = jnp.asarray(params)
  state = tx.init(params)
  seen = [(params.tolist(), float(state.loss_scale()))]

  @jax.jit
  def step(params, state):
    _, grads = ols.scaled_value_and_grad(loss)(state, params)
    return tx.apply_gradients(grads, state, params)

  for _ in trace[1:]:
    params, state = step(params, state)
    seen.append((params.tolist(), float(state.loss_scale())))
  assert seen == trace


# --- jit, donation, dtypes, scan ------------------------------------------------


@pytest.mark.parametrize(
  ("dtype", "loss_scale"),
  [
    (jnp.float16, ols.DynamicLossScale(64.0)),
    (jnp.bfloat16, ols.FixedLossScale(64)),
    (jnp.float32, ols.NoOpLossScale()),
  ],
  ids=["float16", "bfloat16", "float32"],
)
def test_donated_jit_step_keeps_dtypes_and_does_not_retrace(dtype, loss_scale):
  tx = ols.LossScaleOptimizer(optax.sgd(0.5, momentum=0.9), loss_scale)
  traces = []

  def step(grads, state, params):
    traces.append(1)
    # Strict promotion: a float16 gradient silently promoted would fail.
    with jax.numpy_dtype_promotion("strict"):
      updates, _ = tx.update(grads, state, params)
      new_params, new_state = tx.apply_gradients(grads, state, params)
    return updates, new_params, new_state

  donated = jax.jit(step, donate_argnums=(1, 2))
  params = _params(dtype)
  with warnings.catch_warnings():  # float16 momentum: `init` warns (tested)
    warnings.simplefilter("ignore", UserWarning)
    state = tx.init(params)
  template = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, state)
  )
  for value in [64, INF, 64]:
    grads = jax.tree.map(lambda p, v=value: jnp.full_like(p, v), params)
    old = params
    updates, params, state = donated(grads, state, params)
    assert old["w"].is_deleted()  # donated, updated in place
    chex.assert_trees_all_equal_dtypes(updates, params)
    chex.assert_trees_all_equal_shapes_and_dtypes((params, state), template)
  assert len(traces) == 1 and donated._cache_size() == 1
  assert int(state.skipped_steps) == 1


def test_lax_scan_over_steps_keeps_the_state_and_counts_skips():
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 4))
  y = x @ jnp.array([1.0, -2.0, 0.5, 3.0])

  def loss_fn(p):
    pred = x.astype(jnp.float16) @ p["w"].astype(jnp.float16)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2**15, 5))
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)

  def body(carry, _):
    params, state = carry
    loss, grads = ols.scaled_value_and_grad(loss_fn)(state, params)
    params, state = tx.apply_gradients(grads, state, params, value=loss)
    return (params, state), (loss, state.should_apply)

  (new_params, new_state), (losses, applied) = jax.jit(
    lambda c: lax.scan(body, c, None, length=60)
  )((params, state))
  chex.assert_trees_all_equal_shapes_and_dtypes(
    (new_params, new_state), (params, state)
  )
  assert int(new_state.skipped_steps) == int(jnp.sum(~applied)) > 0
  assert float(losses[-1]) < 0.05 * float(losses[0])
  kept = lax.cond(True, lambda s: s, lambda s: s, new_state)
  chex.assert_trees_all_equal_shapes_and_dtypes(kept, state)


# --- the step's structure, read from its jaxpr -----------------------------------

REDUCTIONS = {
  lax.reduce_p,  # a variadic reduction: several arrays in one
  lax.reduce_max_p,
  lax.reduce_min_p,
  lax.reduce_sum_p,
  lax.reduce_and_p,
  lax.reduce_or_p,
  lax.reduce_prod_p,
}


def _step_jaxpr(entry, tx, params):
  state = tx.init(params)
  if entry == "minimize":
    loss = lambda p: sum(jnp.sum(x) for x in jax.tree.leaves(p))  # noqa: E731
    fn = lambda g, s, p: tx.minimize(loss, p, s)  # noqa: E731
  elif entry == "minimize-retries":
    loss = lambda p: sum(jnp.sum(x) for x in jax.tree.leaves(p))  # noqa: E731
    fn = lambda g, s, p: tx.minimize(loss, p, s, max_retries=3)  # noqa: E731
  else:
    method = getattr(tx, entry)
    fn = lambda g, s, p: method(g, s, p, value=jnp.float32(1))  # noqa: E731
  return jax.make_jaxpr(fn)(params, state, params).jaxpr


def _conds(jaxpr, leaf_size):
  """The step's conditionals: the one around `inner`, and the small ones.

  A small one (the exact check, run when the sum of squares is not finite)
  returns nothing of a leaf's size.
  """
  conds = [e for e in jaxpr.eqns if e.primitive is lax.cond_p]
  big = lambda e: any(v.aval.size >= leaf_size for v in e.outvars)  # noqa: E731
  return [e for e in conds if big(e)], [e for e in conds if not big(e)]


@pytest.mark.parametrize(
  "entry", ["update", "apply_gradients", "minimize", "minimize-retries"]
)
def test_one_cond_per_step_and_no_host_callback(entry):
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale())
  jaxpr = _step_jaxpr(entry, tx, _params())
  smallest = min(x.size for x in jax.tree.leaves(_params()) if x.size > 1)
  if entry == "minimize-retries":  # the conds are the retry loop's body's
    (loop,) = [e for e in jaxpr.eqns if e.primitive is lax.while_p]
    jaxpr = loop.params["body_jaxpr"].jaxpr
  main, small = _conds(jaxpr, smallest)
  # One conditional around `inner`; any other returns nothing of a leaf's
  # size (the exact check returns flags and a norm).
  assert len(main) == 1
  assert all(v.aval.size < smallest for e in small for v in e.outvars)
  # The skip is the cond, not a select over the parameters or state, on
  # every route: a held attempt of the retry loop takes the skip branch.
  shapes = {jnp.shape(x) for x in jax.tree.leaves(_params())} - {()}
  selects = [
    e
    for e in _eqns(jaxpr)
    if e.primitive is lax.select_n_p and e.outvars[0].aval.shape in shapes
  ]
  assert selects == []
  assert not any("callback" in e.primitive.name for e in _eqns(jaxpr))


@pytest.mark.parametrize(
  ("entry", "n", "shape"),
  [
    ("update", 3, (10, 10)),  # small leaves: read in a stack
    ("update", 40, (70, 70)),  # larger ones: read in place
    ("apply_gradients", 40, (10, 10)),
    ("apply_gradients", 3, (70, 70)),
  ],
)
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_each_gradient_element_is_reduced_once_and_updated_in_the_cond(
  entry, n, shape, max_norm
):
  tx = ols.LossScaleOptimizer(
    optax.adam(1e-3), ols.DynamicLossScale(), max_norm=max_norm
  )
  params = {f"p{i}": jnp.ones(shape) for i in range(n)}
  jaxpr = _step_jaxpr(entry, tx, params)
  outside = [e for e in jaxpr.eqns if e.primitive is not lax.cond_p]
  reduced = sum(
    e.invars[0].aval.size
    for e in outside
    for e in [e, *_eqns_of(e)]
    if e.primitive in REDUCTIONS and e.invars[0].aval.size > n
  )
  assert reduced == n * shape[0] * shape[1]  # the verdict, norm and clip
  # What the conditionals take of the gradients' size are the step's
  # inputs: nothing computed outside (an unscaled copy, a clipped one) is
  # handed to them as a buffer; the update, the unscaling and the clip run
  # inside, fused.
  # (The exact check also takes the stacks of small leaves, which the read
  # builds from the scaled gradients.)
  inputs = set(jaxpr.invars)
  producer = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
  for cond in [e for e in jaxpr.eqns if e.primitive is lax.cond_p]:
    big = [v for v in cond.invars if getattr(v.aval, "size", 0) >= 100]
    stacked = [producer.get(v) in ("stack", "concatenate") for v in big]
    assert all(v in inputs or s for v, s in zip(big, stacked, strict=True))
  if entry == "apply_gradients":  # new parameters and Adam's two moments
    (cond,), _ = _conds(jaxpr, shape[0] * shape[1])
    assert sum(v.aval.shape == shape for v in cond.outvars) == 3 * n


def _eqns_of(eqn):
  for sub in jax.extend.core.jaxprs_in_params(eqn.params):
    yield from _eqns(sub)


def test_the_clip_adds_nothing_inside_the_cond():
  # XLA copies a scalar computed inside a conditional into each leaf's
  # kernel: the clip factor is computed before it and multiplies the
  # unscaling, so that the applied branch is the same with and without it.
  def applied(max_norm):
    tx = ols.LossScaleOptimizer(
      optax.adam(0.1), ols.DynamicLossScale(), max_norm=max_norm
    )
    (cond,), _ = _conds(_step_jaxpr("apply_gradients", tx, _params()), 3)
    branch = cond.params["branches"][1].jaxpr
    return sorted(e.primitive.name for e in _eqns(branch))

  assert applied(1.0) == applied(None)


def test_the_write_record_is_written_in_the_skip_branch_only():
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale())
  params = _params()
  jaxpr = _step_jaxpr("apply_gradients", tx, params)
  (cond,), _ = _conds(jaxpr, 3)
  skip, apply = (b.jaxpr for b in cond.params["branches"])
  state = tx.init(params)
  records = len(jax.tree.leaves(state.last_nonfinite_write))
  # The applied branch passes the record through; the skip branch writes
  # it (where it finds non-finite parameters). The skip record, a few
  # scalars and a flag per leaf, is selected after the conditional.
  assert all(v in apply.invars for v in apply.outvars[-records:])
  assert not all(v in skip.invars for v in skip.outvars[-records:])
  # (`test_counters_...` checks that an applied step leaves it bit for bit.)


def test_the_check_needs_no_more_memory_than_the_one_liner():
  # No copy of a large leaf (nor a float32 conversion of a float16 one) is
  # written out to check it, beyond what `jnp.all(jnp.isfinite(x))` needs.
  tree = [jnp.ones((300, 320), jnp.float16), jnp.ones(7, jnp.float16)]

  def one_liner(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in tree]))

  ours, reference = (
    jax.jit(f).lower(tree).compile().memory_analysis().temp_size_in_bytes
    for f in (ols.all_finite, one_liner)
  )
  assert ours <= reference


def test_the_skip_record_needs_no_buffer_of_the_gradients_size():
  # Compared with Adam in one `lax.cond` on `all_finite`, the step's own
  # temporary memory is small: the record holds one flag per leaf.
  params = {f"p{i}": jnp.zeros(300_000) for i in range(4)}
  adam = optax.adam(0.1)
  tx = ols.LossScaleOptimizer(adam, ols.DynamicLossScale())

  def reference(grads, state, params):
    def apply(params, state):
      updates, state = adam.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return lax.cond(ols.all_finite(grads), apply, lambda *a: a, params, state)

  def temp(fn, state):
    compiled = (
      jax.jit(fn, donate_argnums=(1, 2)).lower(params, state, params).compile()
    )
    return compiled.memory_analysis().temp_size_in_bytes

  ours = temp(tx.apply_gradients, tx.init(params))
  assert ours <= temp(reference, adam.init(params)) + 2**20


# --- debugging tools: no NaN of the library's own ---------------------------------


def _inf_step(entry):
  """A step whose float16 gradients overflow to inf (never NaN), loss finite."""
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**10))
  params = {"w": jnp.ones(2)}

  def loss(p):
    return jnp.sum(p["w"].astype(jnp.float16) * jnp.float16(1000)).astype(
      jnp.float32
    )

  grads = {"w": jnp.array([INF, 1.0])}
  steps = {
    "update": lambda p, s: tx.update(grads, s, p),
    "apply_gradients": lambda p, s: tx.apply_gradients(grads, s, p),
    "minimize": lambda p, s: tx.minimize(loss, p, s),
    "minimize-retries": lambda p, s: tx.minimize(loss, p, s, max_retries=1),
  }
  return steps[entry], params, tx.init(params)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
  "entry", ["update", "apply_gradients", "minimize", "minimize-retries"]
)
def test_debug_nans_accepts_a_skipped_inf_step(entry, jit):
  step, params, state = _inf_step(entry)
  with jax.debug_nans(True):
    *_, new_state = (jax.jit(step) if jit else step)(params, state)
    assert not bool(ols.all_finite({"w": jnp.array([INF])}))
  assert not bool(new_state.should_apply)
  assert int(new_state.skipped_steps) == 1
  assert int(new_state.retries) == (1 if entry == "minimize-retries" else 0)


@pytest.mark.parametrize(
  "entry", ["update", "apply_gradients", "minimize-retries"]
)
def test_checkify_nan_checks_find_no_error_in_a_skipped_inf_step(entry):
  step, params, state = _inf_step(entry)
  error, (*_, new_state) = jax.jit(
    checkify.checkify(step, errors=checkify.nan_checks)
  )(params, state)
  assert error.get() is None
  assert int(new_state.skipped_steps) == 1


# --- composition with Optax ---------------------------------------------------


def test_an_instance_is_a_duck_typed_transformation_in_a_chain():
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ols.FixedLossScale(4))
  params = {"w": jnp.ones(2)}
  for link in [tx, tx.gradient_transformation()]:
    chained = optax.chain(link, optax.scale(0.5))
    updates, state = chained.update(
      {"w": jnp.full(2, 4.0)}, chained.init(params)
    )
    np.testing.assert_array_equal(updates["w"], [-0.5, -0.5])
    assert isinstance(state[0], ols.LossScaleOptimizerState)


def test_clipping_inside_sees_unscaled_gradients_and_before_sees_scaled_ones():
  # The gradient [3, 4] has norm 5: clipped to norm 1, the step is -[.6, .8].
  clip = optax.clip_by_global_norm(1.0)
  loss_scale = ols.DynamicLossScale(2.0**10, increment_period=1)
  inside = ols.LossScaleOptimizer(optax.chain(clip, optax.sgd(1.0)), loss_scale)
  before = optax.chain(clip, ols.LossScaleOptimizer(optax.sgd(1.0), loss_scale))
  params = {"w": jnp.zeros(2)}
  intended = np.array([-0.6, -0.8], np.float32)
  for tx, shrink in [(inside, False), (before, True)]:
    state = tx.init(params)
    step = jax.jit(tx.update)
    for i in range(2):  # the scale doubles every step
      scale = 2.0 ** (10 + i)
      updates, state = step({"w": jnp.array([3.0, 4.0]) * scale}, state, params)
      # Before, the clip sees gradients of norm 5 * scale: the step is
      # `scale` times too small, and shrinks as the scale grows.
      want = intended / scale if shrink else intended
      np.testing.assert_allclose(updates["w"], want, rtol=1e-6)


def test_a_schedule_does_not_advance_on_skipped_steps():
  schedule = optax.linear_schedule(1.0, 0.0, 10)
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
  tx = ols.LossScaleOptimizer(inner, ols.DynamicLossScale(4.0))
  params = {"w": jnp.zeros(1)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for value in [1.0, NAN, NAN, 1.0]:
    _, state = step({"w": jnp.full((1,), value)}, state, params)
  # Two applied steps: the stored rate is the schedule's at count 1.
  assert int(state.inner_state.count) == 2
  rate = state.inner_state.hyperparams["learning_rate"]
  assert float(rate) == float(schedule(1))


def test_extra_args_and_the_loss_reach_the_inner_transformation():
  seen = []

  def update(updates, state, params=None, *, value=None, label=None):
    seen.append((value, label))
    return updates, state

  inner = optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(), update
  )
  tx = ols.LossScaleOptimizer(inner, ols.NoOpLossScale())
  params = {"w": jnp.ones(1)}
  tx.update(params, tx.init(params), params, value=jnp.float32(3.0), label="x")
  assert {(float(v), label) for v, label in seen} == {(3.0, "x")}


def test_an_inner_update_of_another_dtype_and_structure():
  def update(updates, state, params=None):
    total = sum(jnp.sum(x) for x in jax.tree.leaves(updates))
    return {"total": total.astype(jnp.bfloat16)}, state

  inner = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  tx = ols.LossScaleOptimizer(inner, ols.DynamicLossScale(2.0))
  step = jax.jit(tx.update)
  updates, state = step({"a": jnp.full(3, 2.0)}, tx.init(None))
  assert updates["total"].dtype == jnp.bfloat16 and float(updates["total"]) == 3
  updates, state = step({"a": jnp.array([INF, 1.0, 1.0])}, state)
  assert float(updates["total"]) == 0 and int(state.skipped_steps) == 1


def _counted(calls, error=None):
  """sgd(0.1), counting its traces; raising `error` if given."""
  sgd = optax.sgd(0.1)

  def update(updates, state, params=None):
    calls.append(1)
    if error is not None:
      raise error
    return sgd.update(updates, state, params)

  return optax.GradientTransformation(sgd.init, update)


_ROUTES = {
  "update": lambda tx: tx.update,
  "apply_gradients": lambda tx: tx.apply_gradients,
  "gradient_transformation": lambda tx: tx.gradient_transformation().update,
  "minimize": lambda tx: (
    lambda g, s, p: tx.minimize(lambda p: jnp.sum(p["w"] * g["w"]), p, s)[1:]
  ),
  "minimize with retries": lambda tx: (
    lambda g, s, p: tx.minimize(
      lambda p: jnp.sum(p["w"] * g["w"]), p, s, max_retries=2
    )[1:]
  ),
}


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("route", list(_ROUTES))
def test_inner_is_traced_once_per_trace_of_the_step(route, window):
  calls = []
  tx = ols.LossScaleOptimizer(
    _counted(calls),
    ols.DynamicLossScale(4.0),
    gradient_accumulation_steps=window,
  )
  params = {"w": jnp.ones(2)}
  step = jax.jit(_ROUTES[route](tx))
  state = tx.init(params)
  for _ in range(3):
    _, state = step(params, state, params)
  assert len(calls) == 1


@pytest.mark.parametrize("route", list(_ROUTES))
def test_an_error_of_inner_reaches_the_user_once_as_it_is(route):
  calls = []
  inner = _counted(calls, TypeError("my inner's own message"))
  tx = ols.LossScaleOptimizer(inner, ols.DynamicLossScale(2.0))
  params = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match="my inner's own message") as error:
    jax.jit(_ROUTES[route](tx))(params, tx.init(params), params)
  assert type(error.value) is TypeError and len(calls) == 1


def test_optax_tree_helpers_walk_the_state():
  state = TX.init(W)
  assert isinstance(optax.tree.get(state, "loss_scale"), ols.DynamicLossScale)
  one = jnp.float32(1)
  _, state = UPDATE({"w": jnp.ones(2)}, state, W, value=one)  # a momentum
  _, state = UPDATE({"w": jnp.full(2, NAN)}, state, W, value=one)  # a record
  doubled = optax.tree.map_params(TX.init, lambda p: p * 2, state)
  assert type(doubled) is ols.LossScaleOptimizerState
  assert float(doubled.loss_scale()) == 4.0  # not a parameter: untouched
  chex.assert_trees_all_equal(
    doubled.inner_state[0].trace,
    jax.tree.map(lambda m: m * 2, state.inner_state[0].trace),
  )
  chex.assert_trees_all_equal(doubled.last_skip, state.last_skip)


# --- leaves that are not floating point ----------------------------------------


IDENTITY = ols.LossScaleOptimizer(optax.identity(), ols.DynamicLossScale(4.0))


@functools.cache
def _identity_steps():
  """`update` and `apply_gradients` of IDENTITY, compiled once."""

  def both(grads, state, params):
    updates, _ = IDENTITY.update(grads, state, params)
    return updates, IDENTITY.apply_gradients(grads, state, params)

  return jax.jit(both)


@pytest.mark.parametrize("nan", [False, True])
def test_integer_leaves_pass_through_and_are_never_named(nan):
  params = {"n": jnp.arange(3), "w": jnp.ones(2)}
  grads = {"n": jnp.arange(3), "w": jnp.array([8.0, NAN if nan else 4.0])}
  updates, (new_params, new) = _identity_steps()(
    grads, IDENTITY.init(params), params
  )
  assert updates["n"].dtype == jnp.int32
  np.testing.assert_array_equal(updates["n"], 0 if nan else grads["n"])
  np.testing.assert_array_equal(
    new_params["n"], params["n"] + (0 if nan else grads["n"])
  )
  assert bool(new.should_apply) is not nan
  np.testing.assert_array_equal(new.last_skip.nonfinite, [False, nan])


def test_float0_gradients_are_ignored_by_the_check():
  tx = ols.LossScaleOptimizer(optax.identity(), ols.DynamicLossScale(4.0))
  params = {"n": jnp.arange(3), "w": jnp.ones(2)}

  def loss(p):
    return jnp.sum(p["w"] * p["n"][:2].astype(jnp.float32)) * jnp.inf

  grads = jax.grad(loss, allow_int=True)(params)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert ols.skip_reports(state)[0].nonfinite == ("['w']",)
  only_float0 = jax.grad(lambda p: jnp.float32(1.0), allow_int=True)(
    {"n": params["n"]}
  )
  _, state = tx.update(
    only_float0, tx.init({"n": params["n"]}), {"n": params["n"]}
  )
  assert bool(state.should_apply)


def test_a_nan_in_a_large_leaf_is_found():
  params = {
    "big": np.zeros(200_000, np.float32),
    "small": np.zeros(3, np.float32),
  }
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ols.DynamicLossScale(8.0))
  big = np.ones(200_000, np.float32)
  big[177_777] = np.nan
  grads = {"big": big, "small": np.ones(3, np.float32)}
  new_params, state = jax.jit(tx.apply_gradients)(
    grads, tx.init(params), params
  )
  assert not bool(state.should_apply)
  assert not bool(jnp.any(new_params["big"]))


# --- a user's own loss scale ---------------------------------------------------


@ols.register_loss_scale
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class HalvingLossScale(ols.LossScale):
  """The documented methods only: `__call__`, `adjust`, `get_config`."""

  factor: float = dataclasses.field(default=0.5, metadata=dict(static=True))

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.factor, jnp.float32)

  def adjust(self, grads_finite: Any) -> tuple[Any, jax.Array]:
    return self, jnp.asarray(grads_finite, jnp.bool_)

  def get_config(self) -> dict[str, Any]:
    return {"factor": self.factor}


def test_a_user_loss_scale_below_one_skips_a_step_that_overflows_once_unscaled():
  ls = HalvingLossScale()
  params = {"w": jnp.zeros(2, jnp.float16)}
  tx = ols.LossScaleOptimizer(optax.sgd(1e-3), ls)
  # 40000 is finite in float16; unscaled by 0.5 it is 80000: inf.
  grads = {"w": jnp.array([40000.0, 1.0], jnp.float16)}
  new_params, state = jax.jit(tx.apply_gradients)(
    grads, tx.init(params), params
  )
  assert not bool(state.should_apply) and int(state.skipped_steps) == 1
  np.testing.assert_array_equal(new_params["w"], params["w"])
  ok = {"w": jnp.array([1000.0, 1.0], jnp.float16)}
  new_params, state = tx.apply_gradients(ok, tx.init(params), params)
  assert bool(state.should_apply)
  np.testing.assert_allclose(new_params["w"], [-2.0, -0.002], rtol=1e-3)
  assert ols.deserialize(ols.serialize(HalvingLossScale(0.25))).factor == 0.25
  assert ls.lowered() is None  # cannot be lowered: no retries


# --- ensembles under vmap ----------------------------------------------------------

MEMBERS = 4


def _member(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


def _ensemble_grads(t):
  """Member `t % 4` has a NaN; on odd steps member 3 an inf in float16."""
  rng = np.random.default_rng(t)
  g = {
    "w": rng.normal(size=(MEMBERS, 3, 5)).astype(np.float32),
    "b": rng.normal(size=(MEMBERS, 5)).astype(np.float16),
  }
  g["w"][t % MEMBERS, 1, 2] = np.nan
  if t % 2:
    g["b"][3, 0] = np.inf
  return jax.tree.map(jnp.asarray, g)


def _ensemble():
  tx = ols.LossScaleOptimizer(
    optax.sgd(1e-2, momentum=0.9), ols.DynamicLossScale(8.0, 2, hysteresis=2)
  )
  params = {
    "w": jnp.ones((MEMBERS, 3, 5), jnp.float32),
    "b": jnp.zeros((MEMBERS, 5), jnp.float16),
  }
  return tx, params


def _close_in_ulps(actual, expected):
  """Equal to 2 ulps of each leaf's dtype: XLA may fuse a batch otherwise."""

  def close(a, b):
    eps = float(jnp.finfo(jnp.asarray(b).dtype).eps)
    np.testing.assert_allclose(
      np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=2 * eps
    )

  jax.tree.map(close, actual, expected)


def test_vmap_members_equal_running_each_member_alone():
  tx, params = _ensemble()
  with pytest.warns(UserWarning, match="float16 parameters"):
    state = jax.vmap(tx.init)(params)
    alone = [
      (_member(params, i), tx.init(_member(params, i))) for i in range(MEMBERS)
    ]
  batched, single = (
    jax.jit(jax.vmap(tx.apply_gradients)),
    jax.jit(tx.apply_gradients),
  )
  for t in range(4):
    grads = _ensemble_grads(t)
    params, state = batched(grads, state, params)
    alone = [single(_member(grads, i), s, p) for i, (p, s) in enumerate(alone)]
    for i, (p, s) in enumerate(alone):
      _close_in_ulps(_member(params, i), p)
      chex.assert_trees_all_equal(
        _member(state, i)._replace(inner_state=None),
        s._replace(inner_state=None),
      )
  assert np.asarray(state.skipped_steps).tolist() == [1, 1, 1, 2]
  assert len(set(np.asarray(state.loss_scale()).tolist())) > 1


def test_vmap_with_axis_name_makes_the_members_agree():
  tx = ols.LossScaleOptimizer(
    optax.sgd(1.0), ols.DynamicLossScale(8.0), axis_name="members"
  )
  params = {"w": jnp.zeros((MEMBERS, 2))}
  step = jax.jit(jax.vmap(tx.update, axis_name="members"))
  state = jax.vmap(tx.init)(params)
  grads = {"w": jnp.full((MEMBERS, 2), 8.0)}
  updates, state = step(grads, state, params)
  np.testing.assert_array_equal(updates["w"], jnp.full((MEMBERS, 2), -1.0))
  # One member's NaN skips every member, and every scale halves alike.
  updates, state = step({"w": grads["w"].at[1, 0].set(NAN)}, state, params)
  assert np.asarray(state.should_apply).tolist() == [False] * MEMBERS
  assert np.asarray(state.loss_scale()).tolist() == [4.0] * MEMBERS
  np.testing.assert_array_equal(updates["w"], jnp.zeros((MEMBERS, 2)))


# --- errors that name the mistake --------------------------------------------------


def test_the_constructor_names_a_bad_argument_and_cuts_its_repr():
  adam, ls = optax.adam(1e-3), ols.DynamicLossScale()
  with pytest.raises(TypeError, match=r"`LossScaleOptimizer\(inner=...\)`"):
    ols.LossScaleOptimizer(optax.adam, ls)
  for bad in [2.0, "dynamic", None, adam]:
    with pytest.raises(
      TypeError, match=r"`LossScaleOptimizer\(loss_scale=...\)`"
    ):
      ols.LossScaleOptimizer(adam, bad)
  with pytest.raises(
    TypeError, match=r"`LossScaleOptimizer\(skip_nonfinite=...\)`"
  ):
    ols.LossScaleOptimizer(adam, ls, skip_nonfinite=1)
  with pytest.raises(TypeError, match="on_skip"):  # see SkipMonitor
    ols.LossScaleOptimizer(adam, ls, on_skip=print)
  # A long repr is cut with an ellipsis, and its type is named once.
  adam_state = adam.init({"w": jnp.zeros(100)})[0]
  with pytest.raises(
    TypeError, match=r"an array of int\d+ and shape \(1000,\)\.$"
  ):
    ols.LossScaleOptimizer(adam, np.arange(1000))  # no repr of its values
  for bad, name in [
    (adam_state, "ScaleByAdamState"),
    ("x" * 500, "str"),
  ]:
    with pytest.raises(TypeError) as error:
      ols.LossScaleOptimizer(adam, bad)
    message = str(error.value)
    assert message.endswith("....") and len(message) < 200, message
    assert message.count(name) == 1, message


def _cast(state, field, dtype):
  """`state` with `field` (a path such as `loss_scale.num_good_steps`) cast."""
  if field.startswith("loss_scale."):
    name = field.split(".")[1]
    ls = state.loss_scale
    cast = dataclasses.replace(ls, **{name: getattr(ls, name).astype(dtype)})
    return state._replace(loss_scale=cast)
  return state._replace(**{field: getattr(state, field).astype(dtype)})


@pytest.mark.parametrize(
  ("field", "dtype"),
  [
    ("loss_scale.current_loss_scale", jnp.float16),
    ("loss_scale.num_good_steps", jnp.int16),
    ("loss_scale.num_bad_steps", jnp.int16),
    ("skipped_steps", jnp.int16),
  ],
)
@pytest.mark.parametrize("entry", ["update", "apply_gradients", "minimize"])
def test_a_cast_state_is_named_at_trace_time(field, dtype, entry):
  # What a restore into a float16 target gives: named before any compile.
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0))
  params = {"w": jnp.ones(2)}
  state = _cast(tx.init(params), field, dtype)
  if entry == "minimize":
    fn = lambda p, s: tx.minimize(lambda p: jnp.sum(p["w"]), p, s)  # noqa: E731
  else:
    method = getattr(tx, entry)
    fn = lambda p, s: method(p, s, p)  # noqa: E731
  name = jnp.dtype(dtype).name
  match = rf"`\.{field}` must be \w+, got {name}.*`check_state`"
  with pytest.raises(TypeError, match=match):
    jax.jit(fn).trace(params, state)


@pytest.mark.parametrize("entry", ["update", "apply_gradients", "unscale"])
def test_gradients_of_another_structure_or_shape_name_the_leaf(entry):
  params = _params()
  if entry == "unscale":
    tx = ols.unscale_gradients(ols.DynamicLossScale(8.0))
    step = tx.update
  else:
    tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
    step = getattr(tx, entry)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"\['b'\] has shape \(4,\).* \(3,\)"):
    jax.jit(step)(dict(params, b=jnp.ones(4)), state, params)
  with pytest.raises(ValueError, match=r"structures differ.*'v'"):
    step({"v": jnp.ones(3), "w": params["w"]}, state, params)


@pytest.mark.parametrize("entry", ["update", "apply_gradients", "minimize"])
def test_a_state_of_another_transformation_is_refused(entry):
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = {"w": jnp.ones(2)}
  foreign = optax.adam(0.1).init(params)
  with pytest.raises(TypeError, match="LossScaleOptimizerState"):
    if entry == "minimize":
      tx.minimize(lambda p: jnp.sum(p["w"]), params, foreign)
    else:
      getattr(tx, entry)(params, foreign, params)


@pytest.mark.parametrize(
  "entry", ["update", "apply_gradients", "minimize", "transformation"]
)
@pytest.mark.parametrize(
  ("inner", "other"),
  [
    (optax.adamw(0.1), optax.sgd(0.1)),  # Optax: "updates and states"
    (optax.sgd(0.1, momentum=0.9), optax.adam(0.1)),  # an AttributeError
    (optax.adabelief(0.1), optax.adam(0.1)),  # the cond's branches differ
  ],
)
def test_an_inner_state_of_another_optimizer_is_refused_by_name(
  entry, inner, other
):
  params = {"w": jnp.ones(2)}
  tx = ols.LossScaleOptimizer(inner, ols.DynamicLossScale(8.0))
  wrong = ols.LossScaleOptimizer(other, ols.DynamicLossScale(8.0))
  state = wrong.init(params)
  with pytest.raises(TypeError, match=r"`inner_state` is not of the structure"):
    if entry == "minimize":
      tx.minimize(lambda p: jnp.sum(p["w"]), params, state)
    elif entry == "transformation":
      tx.gradient_transformation().update(params, state, params)
    else:
      jax.jit(getattr(tx, entry))(params, state, params)


@pytest.mark.parametrize("abstract_init", [True, False])
def test_an_error_of_inner_itself_is_raised_as_it_is(abstract_init):
  def update(updates, state, params=None):
    raise ValueError("inner's own error")

  def on_host(params):  # an `init` that reads values: none when traced
    return optax.EmptyState() if np.asarray(params["w"]).all() else None

  init = optax.sgd(0.1).init if abstract_init else on_host
  inner = optax.GradientTransformation(init, update)
  tx = ols.LossScaleOptimizer(inner, ols.DynamicLossScale(8.0))
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match="inner's own error"):
    tx.apply_gradients(params, tx.init(params), params)


def test_a_loss_that_is_not_floating_point_is_refused():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match=r"value=\.\.\.\)` must be the loss"):
    tx.update(params, tx.init(params), params, value=jnp.int32(1))


def test_gradients_that_vary_across_shard_map_devices_name_the_missing_pmean():
  mesh = jax.make_mesh((1,), ("x",))
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(8.0), axis_name="x"
  )
  params = {"w": jnp.ones(2)}
  state = tx.init(params)

  def step(params, state, data):
    grads = jax.tree.map(lambda p: p * data[0], params)  # no pmean: varying
    return tx.apply_gradients(grads, state, params)

  sharded = jax.shard_map(
    step, mesh=mesh, in_specs=(P(), P(), P("x")), out_specs=(P(), P())
  )
  data = jax.device_put(jnp.ones(1), jax.NamedSharding(mesh, P("x")))
  with pytest.raises(
    ValueError, match=r"\['w'\] varies across devices.*pmean\(grads"
  ):
    jax.jit(sharded).trace(params, state, data)


# --- the package's modules ------------------------------------------------------


def test_no_module_reads_another_modules_underscore_names():
  package = pathlib.Path(ols.__file__).parent
  modules = {p.stem for p in package.glob("_*.py")}
  offenders = []
  for path in package.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
        base = node.value
        if isinstance(base, ast.Name) and base.id in modules:
          offenders.append(f"{path.name}: {base.id}.{node.attr}")
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "optax_lossscale._"
      ):
        for alias in node.names:
          if alias.name.startswith("_") and not alias.name.startswith("__"):
            offenders.append(f"{path.name}: {node.module}.{alias.name}")
  assert not offenders, offenders


@pytest.mark.parametrize("scale", [0.25, 0.0, np.nan, 1e30])
def test_a_stored_scale_outside_its_bounds_counts_as_the_nearest(scale):
  # Restored into other bounds, or set by hand: the step never unscales by
  # less than min_loss_scale, so a finite scaled gradient cannot overflow.
  tx = ols.LossScaleOptimizer(
    optax.sgd(1.0), ols.DynamicLossScale(4.0, max_loss_scale=8.0)
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  bad = dataclasses.replace(
    state.loss_scale, current_loss_scale=jnp.float32(scale)
  )
  state = state._replace(loss_scale=bad)
  new, state = jax.jit(tx.apply_gradients)(
    {"w": jnp.array([0.0, 1e38])}, state, params
  )
  assert bool(jnp.all(jnp.isfinite(new["w"])))
  assert 1.0 <= float(state.loss_scale.current_loss_scale) <= 8.0


def test_a_none_gradient_needs_a_none_parameter():
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ols.DynamicLossScale())
  params = {"w": jnp.ones(2), "f": jnp.ones(1)}
  with pytest.raises(ValueError, match=r"\['f'\] is None, its parameter not"):
    tx.apply_gradients({"w": jnp.ones(2), "f": None}, tx.init(params), params)


def test_a_gradient_of_a_none_parameter_is_named():
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ols.DynamicLossScale())
  params = {"w": jnp.ones(2), "f": None}
  state = tx.init(params)
  for grad in (jnp.float32(1.0), jnp.ones(1)):
    with pytest.raises(ValueError, match=r"\['f'\] is not None, its param"):
      tx.update({"w": jnp.ones(2), "f": grad}, state, params)


def test_init_warns_for_float16_parameters_with_a_float16_state():
  half = {"w": jnp.ones(3, jnp.float16)}
  tx = ols.LossScaleOptimizer(optax.adam(1e-3), ols.DynamicLossScale())
  with pytest.warns(UserWarning, match="float16 parameters") as caught:
    tx.init(half)
  assert "float32" in str(caught[0].message)
  assert caught[0].filename == __file__  # it points at the caller
  before = {name: id(value) for name, value in vars(tx).items()}
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("default")  # Python's filter: once per place
    for _ in range(3):
      tx.init(half)
  assert len(seen) == 1
  assert {name: id(value) for name, value in vars(tx).items()} == before
  quiet = [
    (optax.adam(1e-3), {"w": jnp.ones(3)}),  # float32 parameters
    (optax.sgd(0.1), half),  # no state
    (optax.adam(1e-3, mu_dtype=jnp.float32), {"w": jnp.ones(3, jnp.bfloat16)}),
  ]
  for inner, params in quiet:
    ols.LossScaleOptimizer(inner, ols.DynamicLossScale()).init(params)


def test_only_skipped_steps_read_the_parameters_for_nonfinite_values():
  # The check of what an update wrote costs applied steps nothing: the
  # applied branch reduces nothing of the parameters' size.
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale())
  params = {"w": jnp.ones((70, 70)), "b": jnp.ones(3)}
  jaxpr = _step_jaxpr("apply_gradients", tx, params)
  (cond,), _ = _conds(jaxpr, 70 * 70)
  skip, apply = (b.jaxpr for b in cond.params["branches"])
  reduced = [
    [e.invars[0].aval.size for e in _eqns(branch) if e.primitive in REDUCTIONS]
    for branch in (skip, apply)
  ]
  assert 70 * 70 in reduced[0]
  assert all(size < 70 * 70 for size in reduced[1])


def test_parameters_other_than_init_s_are_named():
  # flax's `TrainState.create(params=variables)` inits `tx` on
  # `variables["params"]`: a step given all of `variables` says so.
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale())
  params = {"params": {"w": jnp.ones(2)}, "stats": {"m": jnp.ones(2)}}
  state = tx.init(params["params"])
  loss = lambda p: jnp.sum(p["params"]["w"]) + jnp.sum(p["stats"]["m"])  # noqa: E731
  calls = [
    lambda: tx.apply_gradients(params, state, params),
    lambda: tx.update(params, state, params),
    lambda: tx.minimize(loss, params, state),
  ]
  for call in calls:
    with pytest.raises(
      ValueError,
      match=r"2 leaves \(\['params'\]: 1, \['stats'\]: 1\), `init`"
      r" had 1; pass \['params'\] alone and keep \['stats'\] apart .*TrainState",
    ):
      call()


def test_a_mismatch_names_the_subtree_init_did_not_have():
  # A linen model with BatchNorm: init had `variables["params"]` (6 leaves),
  # the step all of `variables` (8): the message names `batch_stats`.
  layer = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}
  variables = {
    "params": {"Dense_0": layer, "Dense_1": layer, "BatchNorm_0": layer},
    "batch_stats": {"BatchNorm_0": {"mean": jnp.ones(2), "var": jnp.ones(2)}},
  }
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale())
  state = tx.init(variables["params"])
  with pytest.raises(ValueError) as error:
    jax.jit(tx.apply_gradients)(variables, state, variables)
  assert str(error.value) == (
    "`LossScaleOptimizer.apply_gradients`: the parameters have 8 leaves"
    " (['batch_stats']: 2, ['params']: 6), `init` had 6; pass ['params']"
    " alone and keep ['batch_stats'] apart (flax's `TrainState` trains"
    " `variables['params']` and carries the other collections)."
  )


def test_swapped_arguments_are_named():
  params = {"w": jnp.ones(2)}
  state = TX.init(params)
  with pytest.raises(
    TypeError, match=r"the first argument must be the loss function, got dict"
  ):
    TX.minimize(params, lambda p: jnp.sum(p["w"]), state)
  with pytest.raises(TypeError, match=r"arguments are \(fun, params, state,"):
    TX.minimize(lambda p: jnp.sum(p["w"]), state, params)
  for entry in ["update", "apply_gradients"]:
    with pytest.raises(TypeError, match=r"arguments are \(grads, state, "):
      getattr(TX, entry)(params, params, state)
    with pytest.raises(TypeError, match=r"`grads` is the state; the arg"):
      getattr(TX, entry)(state, params, params)
  with pytest.raises(TypeError, match=r"call it: `DynamicLossScale\(\)`"):
    ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale)
  with pytest.raises(TypeError, match=r"arguments are \(inner, loss_scale\)"):
    ols.LossScaleOptimizer(ols.DynamicLossScale(), optax.sgd(0.1))


def test_a_state_restored_as_dicts_is_told_to_restore_into_init_s():
  params = {"w": jnp.ones(2)}
  restored = TX.init(params)._asdict()  # a restore without a target
  with pytest.raises(TypeError, match=r"into a target built by `init`"):
    TX.apply_gradients(params, restored, params)


def test_a_loss_per_example_is_refused_as_value():
  params = {"w": jnp.ones(2)}
  state = TX.init(params)
  with pytest.raises(ValueError, match=r"a scalar, got shape \(3,\)"):
    jax.jit(TX.apply_gradients)(params, state, params, value=jnp.ones(3))
  # Under `vmap`, each member's loss is a scalar.
  members = jax.tree.map(lambda x: jnp.stack([x, x]), params)
  states = jax.vmap(TX.init)(members)
  step = jax.jit(
    jax.vmap(lambda g, s, p, v: TX.apply_gradients(g, s, p, value=v))
  )
  _, states = step(members, states, members, jnp.ones(2))
  assert states.should_apply.tolist() == [True, True]


def test_a_leaf_named_value_outside_nnx_keeps_its_name_and_its_checks():
  @jax.tree_util.register_dataclass
  @dataclasses.dataclass
  class Box:
    value: jax.Array
    scale: jax.Array

  params = {"a": Box(jnp.ones(2), jnp.ones(1))}
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0))
  state = tx.init(params)
  assert state.last_skip.names() == ("['a'].value", "['a'].scale")
  for entry in ["update", "apply_gradients"]:
    with pytest.raises(ValueError, match="structures differ"):
      getattr(tx, entry)({"a": jnp.ones(2)}, state, params)


def test_nnx_leaves_are_named_without_value():
  from flax import nnx

  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  grads = jax.tree.map(lambda p: jnp.full(p.shape, NAN), params)
  _, state = tx.update(grads, tx.init(params), params)
  assert state.last_skip.names() == ("['bias']", "['kernel']")
  assert ols.skip_reports(state)[0].nonfinite == ("['bias']", "['kernel']")


# --- the norm and the clip, from the one read -----------------------------------


def _clip_step(entry, tx):
  """`entry`'s step of `tx` as `(grads, state, params) -> (params, state)`."""
  if entry == "update":

    def step(grads, state, params):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

  elif entry == "gradient_transformation":
    chain = optax.chain(tx.gradient_transformation())

    def step(grads, state, params):
      updates, (state,) = chain.update(grads, (state,), params)
      return optax.apply_updates(params, updates), state

  elif entry.startswith("minimize"):
    retries = 2 if entry == "minimize-retries" else 0

    def step(grads, state, params):
      # A linear loss whose gradient is `grads`, unscaled.
      loss = lambda p: sum(  # noqa: E731
        jnp.vdot(g / state.loss_scale(), x)
        for g, x in zip(jax.tree.leaves(grads), jax.tree.leaves(p), strict=True)
      )
      return tx.minimize(loss, params, state, max_retries=retries)[1:]

  else:
    step = tx.apply_gradients
  return jax.jit(step)


@pytest.mark.parametrize(
  "entry",
  [
    "update",
    "apply_gradients",
    "minimize",
    "minimize-retries",
    "gradient_transformation",
  ],
)
@pytest.mark.parametrize(
  "loss_scale", [ols.DynamicLossScale(8.0, 2), ols.DynamicLossScale(1000.0, 2)]
)
def test_max_norm_clips_as_optax_does_and_the_norm_is_logged(entry, loss_scale):
  tx = ols.LossScaleOptimizer(optax.adamw(0.1), loss_scale, max_norm=1.5)
  reference = optax.chain(optax.clip_by_global_norm(1.5), optax.adamw(0.1))
  step = _clip_step(entry, tx)
  params = expected = _params()
  state, ref_state = tx.init(params), reference.init(params)
  for t in range(6):
    grads = jax.tree.map(lambda g, t=t: g * (0.5 + t), _unscaled(t, params))
    params, state = step(_scaled(grads, state), state, params)
    norm = float(optax.tree.norm(grads))
    if t == 3:  # skipped: its norm is not finite
      assert not bool(state.should_apply) and not np.isfinite(state.grad_norm)
      continue
    updates, ref_state = reference.update(grads, ref_state, expected)
    expected = optax.apply_updates(expected, updates)
    assert bool(state.should_apply)
    np.testing.assert_allclose(state.grad_norm, norm, rtol=1e-6)
    assert state.grad_norm.dtype == jnp.float32
    chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-6)
  assert norm > 1.5  # the clip acted


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_gradients_are_clipped_in_their_dtype_and_normed_in_float32(
  dtype,
):
  tx = ols.LossScaleOptimizer(
    optax.sgd(1.0), ols.FixedLossScale(4.0), max_norm=1.0
  )
  # 300 entries of 100: a norm of about 1732, whose square overflows float16.
  grads = {"w": jnp.full((300,), 400.0, dtype), "b": jnp.full((2,), 4.0, dtype)}
  params = jax.tree.map(jnp.zeros_like, grads)
  new, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
  norm = np.sqrt(300 * 100.0**2 + 2)
  np.testing.assert_allclose(state.grad_norm, norm, rtol=1e-6)
  assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(dtype)}
  np.testing.assert_allclose(
    np.asarray(new["w"], np.float32), -100.0 / norm, rtol=1e-2
  )


def test_finite_gradients_whose_squares_overflow_are_applied():
  # Scaled squares past float32's range, at a scale where the bug showed:
  # the exact check finds every leaf finite and norms the unscaled
  # gradients, so the clip is Optax's. Where the unscaled squares overflow
  # too (float32's largest values at scale 1), the norm is inf, as Optax's,
  # and the clip zeroes the step as Optax's does.
  big = float(np.finfo(np.float32).max)
  cases = [
    (ols.DynamicLossScale(2.0**20), [3e15, 4e15], [-0.6, -0.8], 5e15),
    (ols.NoOpLossScale(), [big / 2, -big / 2], [0.0, 0.0], np.inf),
  ]
  for ls, unscaled, clipped, norm in cases:
    grads = {"w": jnp.array(unscaled) * ls(), "b": jnp.zeros(3)}
    params = jax.tree.map(jnp.zeros_like, grads)
    for max_norm in (None, 1.0):
      tx = ols.LossScaleOptimizer(optax.sgd(1.0), ls, max_norm=max_norm)
      new, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
      assert bool(state.should_apply) and int(state.skipped_steps) == 0
      assert float(state.grad_norm) == pytest.approx(norm, rel=1e-6)
      want = clipped if max_norm else [-u for u in unscaled]
      np.testing.assert_allclose(new["w"], want, rtol=1e-6, atol=0)
  # TensorFlow's rule, bit for bit: such a step grows nothing it should not.
  ls = ols.DynamicLossScale(2.0, 1)
  tx = ols.LossScaleOptimizer(optax.sgd(0.0), ls)
  _, state = tx.apply_gradients(
    jax.tree.map(lambda g: g * 2, {"w": jnp.array([big / 2])}),
    tx.init({"w": jnp.zeros(1)}),
    {"w": jnp.zeros(1)},
  )
  assert bool(state.should_apply) and float(state.loss_scale()) == 4.0


def test_each_member_of_an_ensemble_has_its_own_norm():
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.FixedLossScale(2.0), max_norm=4.0
  )
  k = np.arange(1.0, 5.0)[:, None]
  members = k * np.array([[3.0, 4.0]])  # norms 5, 10, 15 and 20
  params = {"w": jnp.zeros((4, 2))}
  state = jax.vmap(tx.init)(params)
  new, state = jax.jit(jax.vmap(tx.apply_gradients))(
    {"w": jnp.asarray(members * 2)}, state, params
  )
  np.testing.assert_allclose(state.grad_norm, 5.0 * k[:, 0], rtol=1e-6)
  clipped = members * 4.0 / (5.0 * k)  # each clipped to norm 4
  np.testing.assert_allclose(new["w"], -0.1 * clipped, rtol=1e-6)


def test_overwritten_leaves_are_not_in_the_norm_nor_clipped():
  tx = ols.LossScaleOptimizer(
    optax.sgd(1.0), ols.FixedLossScale(2.0), max_norm=1.0
  )
  params = {
    "w": jnp.zeros(2),
    "_overwrite_with_gradient": {"amax": jnp.zeros(3)},
  }
  grads = {
    "w": jnp.array([6.0, 8.0]),
    "_overwrite_with_gradient": {"amax": jnp.full(3, 100.0)},
  }
  new, state = tx.apply_gradients(grads, tx.init(params), params)
  assert float(state.grad_norm) == 5.0
  np.testing.assert_allclose(new["w"], [-0.6, -0.8], rtol=1e-6)
  np.testing.assert_array_equal(new["_overwrite_with_gradient"]["amax"], 100.0)


@pytest.mark.parametrize(
  ("max_norm", "error", "match"),
  [
    (0.0, ValueError, r"max_norm=\.\.\.\)` must be positive, got 0.0"),
    (-1, ValueError, "must be positive"),
    (float("inf"), ValueError, "max_norm=.*finite"),
    ("1", TypeError, "max_norm=.*real number"),
    (True, TypeError, "max_norm=.*real number"),
    (jnp.float32(1.0), None, None),
  ],
)
def test_max_norm_is_validated(max_norm, error, match):
  make = lambda: ols.LossScaleOptimizer(  # noqa: E731
    optax.sgd(1.0), ols.NoOpLossScale(), max_norm=max_norm
  )
  if error is None:
    assert make().max_norm == 1.0
    return
  with pytest.raises(error, match=match):
    make()


def test_the_clip_makes_no_nan_of_an_applied_inf_and_the_norm_is_not_nan():
  # skip_nonfinite=False applies non-finite gradients (TensorFlow's rule):
  # the clip leaves them as they are (0 * inf would be NaN). A NaN gradient's
  # norm is inf, so that a skipped step's outputs hold no NaN.
  tx = ols.LossScaleOptimizer(
    optax.sgd(1.0), ols.NoOpLossScale(), max_norm=1.0, skip_nonfinite=False
  )
  params = {"w": jnp.zeros(2)}
  step = jax.jit(
    checkify.checkify(tx.apply_gradients, errors=checkify.nan_checks)
  )
  error, (new, state) = step(
    {"w": jnp.array([INF, 1.0])}, tx.init(params), params
  )
  assert error.get() is None
  np.testing.assert_array_equal(new["w"], [-INF, -1.0])
  skipping = ols.LossScaleOptimizer(optax.sgd(1.0), ols.NoOpLossScale())
  _, state = jax.jit(skipping.apply_gradients)(
    {"w": jnp.array([NAN, 1.0])}, skipping.init(params), params
  )
  assert not bool(state.should_apply) and float(state.grad_norm) == INF


def test_complex_gradients_are_unscaled_part_by_part():
  # (inf + 0j) * (s + 0j) is inf + NaN j: the unscaling scales each part.
  params = {"w": jnp.zeros(3, jnp.complex64)}
  grads = {"w": jnp.array([INF, 1.0, 2.0], jnp.complex64)}
  for loss_scale in [ols.DynamicLossScale(8.0), ols.FixedLossScale(8.0)]:
    tx = ols.LossScaleOptimizer(optax.sgd(0.1), loss_scale)
    step = checkify.checkify(tx.apply_gradients, errors=checkify.float_checks)
    error, (_, state) = jax.jit(step)(grads, tx.init(params), params)
    assert error.get() is None and int(state.skipped_steps) == 1
    unscaled = loss_scale.unscale(grads)["w"]
    assert np.isnan(np.asarray(unscaled)).sum() == 0


def test_only_a_top_level_collection_is_overwritten():
  # flax's rule: `_overwrite_with_gradient` is a top-level key of the
  # variables. Deeper, it is a parameter like any other: unscaled, trained.
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ols.FixedLossScale(2.0))
  params = {"block": {"_overwrite_with_gradient": {"amax": jnp.zeros(3)}}}
  grads = {"block": {"_overwrite_with_gradient": {"amax": jnp.full(3, 4.0)}}}
  new, state = tx.apply_gradients(grads, tx.init(params), params)
  amax = new["block"]["_overwrite_with_gradient"]["amax"]
  np.testing.assert_array_equal(amax, -2.0)
  assert float(state.grad_norm) == pytest.approx(np.sqrt(12.0))


@pytest.mark.parametrize("route", ["update", "apply_gradients", "chain"])
def test_lookahead_runs_as_optax_runs_it(route):
  # optax.lookahead's parameters (fast and slow weights) differ in structure
  # from the gradients (of the fast weights), as Optax allows.
  la = optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5)
  params = optax.LookaheadParams.init_synced({"w": jnp.ones(3)})
  batches = [8.0, INF, 8.0, 16.0, 8.0]
  if route == "chain":
    tx = optax.chain(ols.unscale_gradients(ols.FixedLossScale(8.0)), la)
    batches = [8.0, 8.0, 16.0]  # the chain itself skips nothing
  else:
    tx = ols.LossScaleOptimizer(la, ols.FixedLossScale(8.0))
  expected, la_state = params, la.init(params)
  state, p = tx.init(params), params
  for g in batches:
    grads = {"w": jnp.full(3, g)}
    if route == "apply_gradients":
      p, state = jax.jit(tx.apply_gradients)(grads, state, p)
    else:
      updates, state = jax.jit(tx.update)(grads, state, p)
      p = optax.apply_updates(p, updates)
    if np.isfinite(g):
      unscaled = {"w": jnp.full(3, g / 8.0)}
      updates, la_state = la.update(unscaled, la_state, expected)
      expected = optax.apply_updates(expected, updates)
  chex.assert_trees_all_close(p, expected, rtol=1e-6)
  if route != "chain":
    assert int(state.skipped_steps) == 1
    assert ols.skip_reports(state)[0].nonfinite == ("['w']",)


def test_float0_gradients_reach_inner_as_they_are():
  # The check ignores them and `inner` gets them as given: a masked `inner`
  # passes them on; Optax's sgd, and `optax.apply_updates`, reject them.
  params = {"w": jnp.ones(2), "n": jnp.array(3)}
  grads = jax.grad(lambda p: jnp.sum(p["w"] * p["n"]), allow_int=True)(params)
  inner = optax.masked(optax.sgd(0.1), {"w": True, "n": False})
  tx = ols.LossScaleOptimizer(inner, ols.FixedLossScale(2.0))
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert updates["n"].dtype == jax.dtypes.float0 and bool(state.should_apply)
  np.testing.assert_allclose(updates["w"], -0.15)
  with pytest.raises(TypeError, match="float0"):
    tx.apply_gradients(grads, tx.init(params), params)


def test_update_keeps_inner_s_traceback_eagerly():
  # Eagerly (`jax.disable_jit`), `jax_debug_nans` stops in `inner`'s own
  # code: float16 parameters with Adam, whose eps is 0 in float16.
  tx = ols.LossScaleOptimizer(optax.adam(1e-3), ols.DynamicLossScale(8.0))
  params = {"w": jnp.ones(4, jnp.float16)}
  with pytest.warns(UserWarning, match="float16 parameters"):
    state = tx.init(params)
  grads = {"w": jnp.zeros(4, jnp.float16)}
  for entry in ["update", "apply_gradients"]:
    with jax.debug_nans(True), jax.disable_jit():
      with pytest.raises(FloatingPointError) as error:
        getattr(tx, entry)(grads, state, params)
    frames = [str(frame.path) for frame in error.traceback]
    assert any("optax" in f and "_src" in f for f in frames), entry


def test_lookahead_in_an_ensemble_and_what_it_refuses():
  la = optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5)
  tx = ols.LossScaleOptimizer(la, ols.FixedLossScale(8.0))
  params = optax.LookaheadParams.init_synced({"w": jnp.ones((3, 2))})
  grads = {"w": jnp.asarray([[8.0, 8.0], [INF, 8.0], [16.0, 8.0]])}
  new, state = jax.jit(jax.vmap(tx.apply_gradients))(
    grads, jax.vmap(tx.init)(params), params
  )
  np.testing.assert_allclose(new.fast["w"][:, 1], [0.9, 1.0, 0.9])
  np.testing.assert_allclose(new.fast["w"][:, 0], [0.9, 1.0, 0.8])
  chex.assert_trees_all_equal(new.slow, params.slow)  # synced every 2
  assert np.asarray(state.should_apply).tolist() == [True, False, True]
  with pytest.raises(TypeError, match="gradients are of `params.fast`"):
    tx.minimize(lambda p: jnp.sum(p.fast["w"]), params, tx.init(params))
  fp8 = optax.LookaheadParams.init_synced({"w": jnp.ones(2)})
  fp8_tx = ols.LossScaleOptimizer(
    la, ols.FixedLossScale(8.0), overwrite_with_gradient=lambda path: True
  )
  with pytest.raises(ValueError, match="not supported in `optax.lookahead`"):
    fp8_tx.init(fp8)


# --- The norm and the clip at every scale ------------------------------------


def test_the_clip_does_not_freeze_once_the_scaled_squares_pass_float32():
  # The loop: a growing scale takes the scaled squares past
  # float32's range while every gradient stays finite. The clip must keep
  # stepping, as Optax's does on the unscaled gradients.
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1),
    ols.DynamicLossScale(2.0**58, increment_period=1),
    max_norm=1.0,
  )
  params = {"w": jnp.full((4,), 3.0)}
  state = tx.init(params)
  step = jax.jit(tx.minimize, static_argnums=0)
  loss = lambda p: jnp.sum(p["w"] ** 2)  # noqa: E731  one function: one compile
  for _ in range(8):
    before = params["w"]
    _, params, state = step(loss, params, state)
    assert bool(state.should_apply)
    norm = float(optax.tree.norm({"w": 2 * before}))
    assert float(state.grad_norm) == pytest.approx(norm, rel=1e-6)
    np.testing.assert_allclose(params["w"], before - 0.1 * 0.5, rtol=1e-6)
  assert float(state.loss_scale()) > 2.0**64  # the squares passed float32


_SCALES = {
  "overflow": ols.FixedLossScale(2.0**15),  # scaled squares overflow
  "underflow": ols.DynamicLossScale(2.0**-70, min_loss_scale=2.0**-80),
  "scale-1000": ols.DynamicLossScale(1000.0),  # not a power of two
  "scale-2**127": ols.FixedLossScale(2.0**127),  # a subnormal reciprocal
}
_UNSCALED = [[3e15, 4e15], [60.0, 80.0], [3e-3, 4e-3], [3e-10, 4e-10]]


@pytest.mark.parametrize(
  ("loss_scale", "unscaled"),
  [  # the scaled gradients finite in float32
    pytest.param(ls, g, id=f"{name}-{g[0]:g}")
    for name, ls in _SCALES.items()
    for g in _UNSCALED
    if g[1] * float(ls()) < 3e38
  ],
)
def test_the_norm_and_the_clip_are_optax_s_at_every_scale(loss_scale, unscaled):
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), loss_scale, max_norm=1.0)
  params = {"w": jnp.zeros(2)}
  grads = {"w": jnp.array(unscaled) * loss_scale()}
  new, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
  want_updates, _ = optax.clip_by_global_norm(1.0).update(
    {"w": jnp.array(unscaled)}, optax.EmptyState()
  )
  np.testing.assert_allclose(new["w"], -want_updates["w"], rtol=2e-6)
  norm = float(optax.tree.norm({"w": jnp.array(unscaled)}))
  assert float(state.grad_norm) == pytest.approx(norm, rel=2e-6)
  assert bool(state.should_apply)


def test_a_nonfinite_step_below_scale_one_logs_an_infinite_norm():
  # `grad_norm` is inf on a skipped overflow, at any scale (the docs).
  ls = ols.DynamicLossScale(0.25, min_loss_scale=2.0**-10)
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ls, max_norm=1.0)
  params = {"w": jnp.zeros(2), "b": jnp.zeros(3)}
  step = jax.jit(tx.apply_gradients)
  for bad in (jnp.inf, jnp.nan):
    grads = {"w": jnp.array([bad, 1.0]), "b": jnp.ones(3)}
    new, state = step(grads, tx.init(params), params)
    assert not bool(state.should_apply)
    assert float(state.grad_norm) == np.inf
    chex.assert_trees_all_equal(new, params)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.complex64])
def test_below_scale_one_a_gradient_that_overflows_once_unscaled_skips(dtype):
  # Finite as given, twice the dtype's largest once divided by the scale.
  ls = ols.DynamicLossScale(2.0**-4, min_loss_scale=2.0**-10)
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ls)
  params = {"w": jnp.zeros(2, dtype)}
  step = jax.jit(tx.update)
  big = float(jnp.finfo(dtype).max) / 8
  for value, applies in ((big, False), (big / 4, True), (-big, False)):
    grads = {"w": jnp.array([value, 1.0], dtype)}
    _, state = step(grads, tx.init(params), params)
    assert bool(state.should_apply) == applies, value
    assert bool(state.last_skip.nonfinite[0]) != applies


@pytest.mark.parametrize("scale", [2.0**-4, 1000 / 2**16, 0.3])
def test_below_scale_one_the_verdict_is_the_unscaled_gradients_at_the_edge(
  scale,
):
  # At the edge of float32's range once unscaled, ulp by ulp: a step
  # applies exactly when `unscale` leaves the gradient finite.
  ls = ols.DynamicLossScale(scale, min_loss_scale=1e-6)
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ls)
  params = {"w": jnp.zeros(1)}
  step = jax.jit(tx.apply_gradients)
  edge = np.float32(np.finfo(np.float32).max * np.float32(ls()))
  seen = set()
  for ulps in range(-3, 4):
    x = edge
    for _ in range(abs(ulps)):
      x = np.nextafter(x, np.float32(np.inf if ulps > 0 else 0))
    grads = {"w": jnp.array([x])}
    finite = bool(jnp.isfinite(ls.unscale(grads)["w"][0]))
    new, state = step(grads, tx.init(params), params)
    assert bool(state.should_apply) == finite, (ulps, x)
    assert bool(jnp.all(jnp.isfinite(new["w"])))
    seen.add(finite)
  assert seen == {True, False}  # the edge is inside the range tried


def test_float64_gradients_are_normed_in_float64():
  with jax.enable_x64(True):
    tx = ols.LossScaleOptimizer(
      optax.sgd(1.0), ols.NoOpLossScale(), max_norm=1.0
    )
    params = {"w": jnp.zeros(2, jnp.float64)}
    grads = {"w": jnp.array([3e19, 4e19], jnp.float64)}
    new, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
    assert new["w"].dtype == jnp.float64
    np.testing.assert_allclose(new["w"], [-0.6, -0.8], rtol=1e-12)
    assert float(state.grad_norm) == pytest.approx(5e19, rel=1e-6)


def test_a_scale_grown_to_float32_s_largest_still_updates():
  # The default ceiling is TensorFlow's, float32's maximum: above 2**126 the
  # scale's reciprocal is subnormal, which XLA flushes to 0, so the
  # unscaling applies its power of two apart. Every update stays the
  # gradient's, not zero.
  tx = ols.LossScaleOptimizer(
    optax.sgd(1.0), ols.DynamicLossScale(2.0**124, increment_period=1)
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  step = jax.jit(tx.minimize, static_argnums=0)
  for i in range(5):
    _, params, state = step(lambda p: 1e-12 * jnp.sum(p["w"]), params, state)
    assert bool(state.should_apply)
    np.testing.assert_allclose(params["w"], -1e-12 * (i + 1), rtol=1e-6)
    assert float(state.grad_norm) == pytest.approx(np.sqrt(2) * 1e-12)
  assert float(state.loss_scale()) == 2.0**127


@pytest.mark.parametrize("spike_sigmas", [None, 6.0])
@pytest.mark.parametrize("entry", ["update", "apply_gradients", "minimize"])
def test_float64_steps_run_under_strict_promotion(entry, spike_sigmas):
  # The norm is float64 with float64 gradients; the state's is float32.
  with jax.numpy_dtype_promotion("strict"), jax.enable_x64(True):
    tx = ols.LossScaleOptimizer(
      optax.sgd(1.0),
      ols.NoOpLossScale(),
      max_norm=1.0,
      spike_sigmas=spike_sigmas,
    )
    params = {"w": jnp.zeros(2, jnp.float64)}
    state = tx.init(params)
    if entry == "minimize":
      loss = lambda p: jnp.sum(p["w"] * jnp.array([3.0, 4.0]))  # noqa: E731
      _, new, state = jax.jit(tx.minimize, static_argnums=0)(
        loss, params, state
      )
    else:
      grads = {"w": jnp.array([3.0, 4.0], jnp.float64)}
      new, state = jax.jit(getattr(tx, entry))(grads, state, params)
      if entry == "update":
        new = optax.apply_updates(params, new)
    assert new["w"].dtype == jnp.float64
    np.testing.assert_allclose(new["w"], [-0.6, -0.8], rtol=1e-12)
    assert state.grad_norm.dtype == jnp.float32
    assert float(state.grad_norm) == pytest.approx(5.0)


def test_a_loss_passed_as_loss_warns_with_the_name_to_use():
  # `loss=` reaches `inner` alone: no check reads it, so a NaN loss is
  # applied; the warning names `value=`. Given both, `inner` gets `loss=`.
  seen = []

  def update(updates, state, params=None, *, loss=None, **extra):
    seen.append(loss)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: (), update)
  tx = ols.LossScaleOptimizer(inner, ols.DynamicLossScale())
  params = _params()
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  for entry in (tx.update, tx.apply_gradients):
    with pytest.warns(UserWarning, match=r"loss=.*pass the loss as `value=`"):
      _, new = entry(grads, state, params, loss=jnp.float32(jnp.nan))
    assert bool(new.should_apply)
  _, state = tx.apply_gradients(
    grads, state, params, value=jnp.float32(jnp.nan), loss=jnp.float32(1.0)
  )
  assert int(state.nonfinite_loss_steps) == 1
  assert float(seen[-1]) == 1.0
