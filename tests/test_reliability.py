"""Nothing lost under faults, bad input and long runs."""

from __future__ import annotations

import json

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from jax import lax

import optax_lossscale as ols
from tests.tf_reference import tf_dynamic_loss_scale

F32_MAX = float(np.finfo(np.float32).max)

# --- property-based: DynamicLossScale against TensorFlow's algorithm ---------


@st.composite
def dynamic_configs(draw):
  multiplier = draw(
    st.sampled_from([1.5, 2.0, 3.0, 10.0, 1.1, 4.0]) | st.floats(1.01, 16.0)
  )
  minimum = draw(st.sampled_from([1.0, 0.5, 2.0**-10]) | st.floats(1e-6, 1e3))
  initial = draw(st.floats(minimum, 1e30))
  maximum = draw(st.none() | st.floats(initial, F32_MAX))
  period = draw(st.integers(1, 6) | st.integers(1, 2**31 - 1))
  # Hyperparameters are float32 values, as TensorFlow stores them.
  as32 = lambda x: float(np.float32(x))  # noqa: E731
  minimum, initial = as32(minimum), max(as32(initial), as32(minimum))
  if maximum is not None:
    maximum = max(as32(maximum), initial)
  return dict(
    initial_loss_scale=initial,
    increment_period=period,
    multiplier=multiplier,
    min_loss_scale=minimum,
    max_loss_scale=maximum,
  )


def _check_invariants(loss_scale):
  scale = float(loss_scale())
  assert np.isfinite(scale)
  assert loss_scale.min_loss_scale <= scale
  assert scale <= (loss_scale.max_loss_scale or F32_MAX)
  assert 0 <= int(loss_scale.num_good_steps) < loss_scale.increment_period


_adjust = jax.jit(lambda ls, finite: ls.adjust(finite))


@jax.jit
def _scan(loss_scale, steps):
  def body(ls, finite):
    ls, apply = ls.adjust(finite)
    return ls, (ls(), ls.num_good_steps, apply)

  return lax.scan(body, loss_scale, steps)


@settings(
  max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(config=dynamic_configs(), steps=st.lists(st.booleans(), max_size=60))
def test_dynamic_matches_tensorflow_model_bit_for_bit(config, steps):
  ref = tf_dynamic_loss_scale(steps, **config)
  loss_scale = ols.DynamicLossScale(**config)
  eager = jitted = loss_scale
  for finite, (scale, good, apply) in zip(steps, ref, strict=True):
    grads = {"g": jnp.array([1.0 if finite else np.nan], jnp.float16)}
    eager, eager_apply = eager.update(grads)
    jitted, jitted_apply = _adjust(jitted, jnp.array(finite))
    for ls, ok in [(eager, eager_apply), (jitted, jitted_apply)]:
      assert np.float32(ls()) == scale
      assert int(ls.num_good_steps) == good
      assert bool(ok) == apply
      _check_invariants(ls)
  if steps:
    _, (scales, goods, applies) = _scan(loss_scale, jnp.array(steps))
    np.testing.assert_array_equal(scales, [s for s, _, _ in ref])
    np.testing.assert_array_equal(goods, [g for _, g, _ in ref])
    np.testing.assert_array_equal(applies, steps)


# --- fault injection -------------------------------------------------------------


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_injected_faults_lose_nothing(dtype):
  rng = np.random.RandomState(
    {"float16": 0, "bfloat16": 1, "float32": 2}[jnp.dtype(dtype).name]
  )
  shapes = [
    tuple(rng.randint(1, 5, size=rng.randint(0, 3))) for _ in range(100)
  ]
  params = {
    f"p{i}": jnp.asarray(rng.randn(*s), jnp.float32)
    for i, s in enumerate(shapes)
  }
  tx = ols.loss_scale_optimizer(
    optax.adamw(1e-2), ols.DynamicLossScale(2.0**10, 3)
  )
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  skipped = 0
  for _ in range(40):
    grads = {
      k: jnp.asarray(rng.randn(*v.shape) * 2.0**10, dtype)
      for k, v in params.items()
    }
    faulty = rng.rand() < 0.4
    if faulty:
      key = f"p{rng.randint(100)}"
      bad = rng.choice([np.nan, np.inf, -np.inf])
      index = tuple(rng.randint(d) for d in grads[key].shape)
      grads[key] = grads[key].at[index].set(jnp.asarray(bad, dtype))
    new_params, new_state = step(params, state, grads)
    if faulty:
      skipped += 1
      chex.assert_trees_all_equal(new_params, params)
      chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
      assert float(new_state.loss_scale()) == max(
        float(state.loss_scale()) / 2, 1.0
      )
    else:
      assert (
        int(new_state.inner_state[0].count)
        == int(state.inner_state[0].count) + 1
      )
    assert bool(new_state.should_apply) == (not faulty)
    assert int(new_state.skipped_steps) == skipped
    params, state = new_params, new_state


@pytest.mark.usefixtures("standard_promotion")
def test_float16_gradient_overflow_is_skipped_end_to_end():
  params = {"w": jnp.full((4,), 3.0)}

  def loss_fn(p):
    w = p["w"].astype(jnp.float16)
    # Gradients 2 * 3 * 2**15 overflow float16 (the scaled loss, 36 * 2**15,
    # does too, but that alone would skip nothing: see the next test).
    return jnp.sum(w * w)

  tx = ols.loss_scale_optimizer(optax.sgd(0.01), ols.DynamicLossScale())
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = ols.scaled_value_and_grad(loss_fn)(state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  new_params, state, loss = step(params, state)
  assert float(loss) == 36.0
  assert not bool(state.should_apply)
  chex.assert_trees_all_equal(new_params, params)
  assert float(ols.get_loss_scale(state)()) == 2.0**14
  while not bool(state.should_apply):
    new_params, state, _ = step(params, state)
  # The gradients (2 * 3 * scale) now fit in float16.
  assert float(ols.get_loss_scale(state)()) * 6 <= 65504
  assert not np.allclose(new_params["w"], params["w"])


@pytest.mark.usefixtures("standard_promotion")
def test_scaled_float16_loss_overflow_alone_is_applied_end_to_end():
  params = {"w": jnp.full((4,), 3.0)}

  def loss_fn(p):
    # 36: times 2**15 overflows float16, but each gradient is 2**15.
    return jnp.sum(p["w"].astype(jnp.float16)) + jnp.float16(24)

  tx = ols.loss_scale_optimizer(optax.sgd(0.5), ols.DynamicLossScale())
  state = tx.init(params)
  assert jnp.isinf(ols.get_loss_scale(state).scale(loss_fn(params)))

  @jax.jit
  def step(params, state):
    loss, grads = ols.scaled_value_and_grad(loss_fn)(state, params)
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state, loss

  new_params, state, loss = step(params, state)
  assert float(loss) == 36.0
  assert bool(state.should_apply) and int(state.skipped_steps) == 0
  assert float(ols.get_loss_scale(state)()) == 2.0**15
  np.testing.assert_array_equal(new_params["w"], 2.5)


# --- soak and resume -----------------------------------------------------------------


def _soak_run(state, flags, tx, params):
  def body(carry, finite):
    params, state = carry
    scale = state.loss_scale()
    grads = jax.tree.map(
      lambda p: jnp.where(finite, scale, jnp.inf) * jnp.ones_like(p), params
    )
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), state.loss_scale()

  return lax.scan(body, (params, state), flags)


def test_soak_100k_steps_stays_bounded_and_exact():
  n = 100_000
  flags = jax.random.bernoulli(jax.random.PRNGKey(0), 0.97, (n,))
  loss_scale = ols.DynamicLossScale(2.0**15, 50, 2.0, max_loss_scale=2.0**24)
  tx = ols.loss_scale_optimizer(optax.sgd(1e-6), loss_scale)
  params = {"w": jnp.zeros((3,)), "b": jnp.zeros(())}
  (params, state), scales = jax.jit(lambda s, f: _soak_run(s, f, tx, params))(
    tx.init(params), flags
  )
  assert int(state.skipped_steps) == n - int(jnp.sum(flags))
  assert float(jnp.min(scales)) >= 1.0
  assert float(jnp.max(scales)) <= 2.0**24
  assert bool(jnp.all(jnp.isfinite(scales)))
  # Every applied step moved the parameters by exactly the unscaled gradient.
  np.testing.assert_allclose(
    params["w"], -1e-6 * float(jnp.sum(flags)), rtol=1e-2
  )


def test_resume_from_host_numpy_is_bit_identical():
  flags = jax.random.bernoulli(jax.random.PRNGKey(1), 0.8, (400,))
  tx = ols.loss_scale_optimizer(
    optax.sgd(1e-3, momentum=0.9), ols.DynamicLossScale(2.0**8, 7, 3.0)
  )
  params = {"w": jnp.ones((5,))}
  run = jax.jit(lambda s, f: _soak_run(s, f, tx, params))
  (p_full, s_full), _ = run(tx.init(params), flags)

  (p_half, s_half), _ = run(tx.init(params), flags[:200])
  leaves, treedef = jax.tree.flatten((p_half, s_half))
  host = [np.array(x) for x in leaves]  # through host memory
  p_back, s_back = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in host])

  def run2(state, f):
    return _soak_run(state, f, tx, p_back)

  (p_res, s_res), _ = jax.jit(run2)(s_back, flags[200:])
  chex.assert_trees_all_equal((p_res, s_res), (p_full, s_full))


# --- bad input matrix (beyond the per-module tests) ----------------------------------


def test_complex_gradients_are_supported():
  loss_scale = ols.DynamicLossScale(4.0)
  grads = {"z": jax.lax.complex(jnp.ones(3), jnp.ones(3)) * 4}
  assert loss_scale.unscale(grads)["z"].dtype == jnp.complex64
  bad = {"z": grads["z"].at[1].set(jax.lax.complex(jnp.inf, 0.0))}
  assert not bool(loss_scale.update(bad)[1])


@pytest.mark.parametrize("tree", [{}, [None], {"a": None, "b": [None]}])
def test_empty_and_none_trees_are_finite_no_ops(tree):
  for loss_scale in [ols.DynamicLossScale(8.0, 1), ols.FixedLossScale(2)]:
    assert loss_scale.unscale(tree) == tree
    new, should_apply = loss_scale.update(tree)
    assert bool(should_apply)
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), ols.DynamicLossScale(8.0, 1))
  updates, state = tx.update(tree, tx.init(tree))
  assert updates == tree and bool(state.should_apply)


def test_float0_gradients_pass_through_the_optimizer():
  params = (jnp.ones(2), jnp.array(3))
  grads = jax.grad(lambda x, n: jnp.sum(x), argnums=(0, 1), allow_int=True)(
    *params
  )
  tx = ols.loss_scale_optimizer(optax.identity(), ols.FixedLossScale(2))
  updates, state = tx.update(grads, tx.init(params), params)
  assert updates[1].dtype == jax.dtypes.float0
  assert bool(state.should_apply)


@pytest.mark.parametrize(
  "call",
  [
    lambda: ols.all_finite(jnp.ones(2), axis_name=3.5j),
    lambda: ols.DynamicLossScale(2.0, 1, 2.0, min_loss_scale=jnp.nan),
    lambda: ols.FixedLossScale(jnp.array([1.0, 2.0])),
    lambda: ols.FixedLossScale("inf"),
  ],
)
def test_bad_input_raises_value_or_type_error(call):
  with pytest.raises((ValueError, TypeError, NameError)):
    call()


# --- deserialize fuzzing ------------------------------------------------------------

json_values = st.recursive(
  st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
  lambda children: (
    st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=8), children, max_size=3)
  ),
  max_leaves=10,
)
config_dicts = st.fixed_dictionaries(
  {
    "class_name": st.sampled_from(
      [
        "FixedLossScale",
        "DynamicLossScale",
        "NoOpLossScale",
        "LossScaleOptimizer",
        "os.system",
        "builtins.eval",
        "__import__",
      ]
    )
    | st.text(max_size=12),
    "config": st.dictionaries(
      st.sampled_from(
        [
          "loss_scale_value",
          "initial_loss_scale",
          "increment_period",
          "multiplier",
          "min_loss_scale",
          "max_loss_scale",
          "dynamic",
          "initial_scale",
          "dynamic_growth_steps",
          "loss_scale",
        ]
      )
      | st.text(max_size=8),
      json_values,
      max_size=4,
    )
    | json_values,
  },
  optional={"module": json_values, "registered_name": json_values},
)


@settings(max_examples=400, deadline=None)
@given(config=json_values | config_dicts)
def test_deserialize_fuzz_raises_only_value_or_type_errors(config):
  import builtins
  import importlib
  import sys

  def refuse(*args, **kwargs):
    raise AssertionError("deserialize imported or evaluated something")

  ols.DynamicLossScale(3.0)  # JAX's own first-use compilation, done up front
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
    json.dumps(ols.serialize(result))
