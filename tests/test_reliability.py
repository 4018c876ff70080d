"""Nothing lost under faults, hostile configs and long runs."""

from __future__ import annotations

import builtins
import importlib
import json
import sys

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from jax import lax

import optax_lossscale as ols

# --- fault injection -------------------------------------------------------------


@pytest.mark.usefixtures("standard_promotion")
def test_injected_faults_lose_nothing():
  # Gradients of every float dtype; a NaN, inf or -inf anywhere skips the
  # step, and nothing else changes but the loss scale and the counters.
  rng = np.random.default_rng(0)
  dtypes = [jnp.float16, jnp.bfloat16, jnp.float32]
  shapes = [tuple(rng.integers(1, 5, rng.integers(0, 3))) for _ in range(12)]
  params = {
    f"p{i}": jnp.asarray(rng.standard_normal(s), jnp.float32)
    for i, s in enumerate(shapes)
  }
  dtype_of = {k: dtypes[i % 3] for i, k in enumerate(params)}
  tx = ols.LossScaleOptimizer(
    optax.adam(1e-2), ols.DynamicLossScale(2.0**10, 3)
  )
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients)
  skipped = 0
  for _ in range(16):
    grads = {
      k: np.asarray(rng.standard_normal(v.shape) * 2.0**10, dtype_of[k])
      for k, v in params.items()
    }
    faulty = rng.random() < 0.4
    if faulty:
      key = rng.choice(list(grads))
      index = tuple(rng.integers(d) for d in grads[key].shape)
      grads[key][index] = rng.choice([np.nan, np.inf, -np.inf])
    new_params, new_state = step(grads, state, params)
    if faulty:
      skipped += 1
      chex.assert_trees_all_equal(new_params, params)
      chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
      assert float(new_state.loss_scale()) == max(
        float(state.loss_scale()) / 2, 1.0
      )
    else:
      count = lambda s: int(s.inner_state[0].count)  # noqa: E731
      assert count(new_state) == count(state) + 1
    chex.assert_trees_all_equal_dtypes(new_params, params)
    assert bool(new_state.should_apply) is not faulty
    assert int(new_state.skipped_steps) == skipped
    params, state = new_params, new_state
  assert 0 < skipped < 16


@pytest.mark.usefixtures("standard_promotion")
def test_float16_overflow_end_to_end():
  # The scaled loss may overflow float16 alone: its gradients do not, and the
  # step applies. Gradients that overflow skip the step, and the scale falls
  # until they fit.
  def loss_fn(params, x):
    w = params["w"].astype(jnp.float16)
    return jnp.sum(w * x) + jnp.float16(24)

  tx = ols.LossScaleOptimizer(optax.sgd(0.5), ols.DynamicLossScale())
  step = jax.jit(lambda p, s, x: tx.minimize(loss_fn, p, s, x))
  params = {"w": jnp.full((4,), 3.0)}
  state = tx.init(params)
  ones = jnp.ones(4, jnp.float16)
  assert bool(jnp.isinf(state.loss_scale.scale(loss_fn(params, ones))))
  # A float16 loss caps the scale at 2**15, as the warning says when traced.
  with pytest.warns(UserWarning, match="the loss is float16"):
    loss, params, state = step(params, state, ones)  # each gradient 2**15
  assert float(loss) == 36.0 and bool(state.should_apply)
  np.testing.assert_array_equal(params["w"], 2.5)
  sixes = jnp.full(4, 6.0, jnp.float16)  # each gradient 6 * 2**15: inf
  while True:
    before = params
    loss, params, state = step(params, state, sixes)
    if bool(state.should_apply):
      break
    chex.assert_trees_all_equal(params, before)
  assert int(state.skipped_steps) == 2
  assert float(state.loss_scale()) == 2.0**13  # 6 * 2**13 fits float16
  np.testing.assert_array_equal(params["w"], -0.5)


# --- long runs and resumes ---------------------------------------------------------


def _run(tx, params, state, flags):
  """`lax.scan` over steps whose gradients are finite where `flags` are."""

  def body(carry, finite):
    params, state = carry
    scale = state.loss_scale()
    grads = jax.tree.map(
      lambda p: jnp.where(finite, scale, jnp.inf) * jnp.ones_like(p), params
    )
    params, state = tx.apply_gradients(grads, state, params)
    return (params, state), state.loss_scale()

  return lax.scan(body, (params, state), flags)


def test_a_long_run_stays_bounded_and_exact():
  n = 20_000
  flags = jax.random.bernoulli(jax.random.key(0), 0.97, (n,))
  loss_scale = ols.DynamicLossScale(
    2.0**15, 50, 2.0, max_loss_scale=2.0**24, hysteresis=2
  )
  tx = ols.LossScaleOptimizer(optax.sgd(1e-6), loss_scale)
  params = {"w": jnp.zeros((3,)), "b": jnp.zeros(())}
  (params, state), scales = jax.jit(lambda p, f: _run(tx, p, tx.init(p), f))(
    params, flags
  )
  applied = int(jnp.sum(flags))
  assert int(state.skipped_steps) == n - applied
  assert 1.0 <= float(jnp.min(scales)) <= float(jnp.max(scales)) <= 2.0**24
  # Every applied step moved the parameters by the unscaled gradient, 1.
  np.testing.assert_allclose(params["w"], -1e-6 * applied, rtol=1e-3)
  ols.check_state(state)


def test_a_resume_through_host_memory_is_bit_identical():
  flags = jax.random.bernoulli(jax.random.key(1), 0.8, (2, 200))
  tx = ols.LossScaleOptimizer(
    optax.sgd(1e-3, momentum=0.9),
    ols.DynamicLossScale(2.0**8, 7, 3.0, hysteresis=2),
  )
  params = {"w": jnp.ones((5,))}
  run = jax.jit(lambda p, s, f: _run(tx, p, s, f)[0])
  halfway = run(params, tx.init(params), flags[0])
  leaves, treedef = jax.tree.flatten(halfway)
  host = jax.tree.unflatten(treedef, [np.array(x) for x in leaves])
  chex.assert_trees_all_equal(run(*host, flags[1]), run(*halfway, flags[1]))


def test_trees_without_gradients_are_finite_no_ops():
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ols.DynamicLossScale(8.0, 1))
  for tree in [{}, {"a": None, "b": [None]}]:
    updates, state = tx.update(tree, tx.init(tree))
    assert updates == tree and bool(state.should_apply)
    assert float(state.loss_scale()) == 16.0


# --- hostile configs -----------------------------------------------------------------

json_values = st.recursive(
  st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
  lambda children: (
    st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=8), children, max_size=3)
  ),
  max_leaves=10,
)
CLASS_NAMES = ["FixedLossScale", "DynamicLossScale", "NoOpLossScale"]
CLASS_NAMES += [
  "LossScaleOptimizer",
  "os.system",
  "builtins.eval",
  "__import__",
]
KEYS = ["loss_scale_value", "initial_loss_scale", "increment_period"]
KEYS += ["multiplier", "min_loss_scale", "max_loss_scale", "hysteresis"]
KEYS += ["consecutive_hysteresis", "dynamic", "initial_scale"]
KEYS += ["dynamic_growth_steps", "loss_scale"]
config_dicts = st.fixed_dictionaries(
  {
    "class_name": st.sampled_from(CLASS_NAMES) | st.text(max_size=12),
    "config": st.dictionaries(
      st.sampled_from(KEYS) | st.text(max_size=8), json_values, max_size=4
    )
    | json_values,
  },
  optional={"module": json_values, "registered_name": json_values},
)


@settings(max_examples=300, deadline=None)
@given(config=json_values | config_dicts)
def test_deserialize_fuzz_raises_only_value_or_type_errors(config):
  def refuse(*args, **kwargs):
    raise AssertionError("deserialize imported or evaluated something")

  ols.DynamicLossScale(3.0)  # JAX's own first-use work, done up front
  modules = set(sys.modules)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(importlib, "import_module", refuse)
    m.setattr(builtins, "eval", refuse)
    m.setattr(builtins, "exec", refuse)
    try:
      result = ols.deserialize(config)
    except (ValueError, TypeError):
      result = None
  assert set(sys.modules) == modules  # nothing was imported
  if result is not None:
    assert isinstance(result, ols.LossScale)
    assert ols.deserialize(json.loads(json.dumps(ols.serialize(result))))
