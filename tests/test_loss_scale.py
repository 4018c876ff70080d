"""The LossScale family: TensorFlow's behaviour, pytree handling, dtypes."""

from __future__ import annotations

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import optax_lossscale as ols
from tests.tf_reference import tf_dynamic_loss_scale

F32_MAX = float(np.finfo(np.float32).max)


def _grads(finite: bool) -> dict[str, jax.Array]:
  value = 1.0 if finite else float("nan")
  return {"a": jnp.full((3,), value), "b": jnp.ones((2, 2))}


def _run(loss_scale, finite_steps, update=None):
  update = update or (lambda ls, g: ls.update(g))
  scales, applies = [], []
  for finite in finite_steps:
    loss_scale, should_apply = update(loss_scale, _grads(finite))
    scales.append(float(loss_scale()))
    applies.append(bool(should_apply))
  return scales, applies


# --- FixedLossScale --------------------------------------------------------


def test_fixed_returns_its_value_as_float32_scalar():
  loss_scale = ols.FixedLossScale(123)
  value = loss_scale()
  assert value.dtype == jnp.float32 and value.shape == ()
  assert float(value) == 123.0


def test_fixed_update_never_changes_and_always_applies():
  loss_scale = ols.FixedLossScale(10.0)
  for finite in [True, False, True]:
    new, should_apply = loss_scale.update(_grads(finite))
    assert float(new()) == 10.0
    assert should_apply.dtype == jnp.bool_ and bool(should_apply)


@pytest.mark.parametrize(
  "value",
  [1, 1.0, 2**15, np.float32(8), np.int64(4), jnp.float32(16.0)]
  + [jnp.bfloat16(8), np.float16(2), np.uint8(4), jnp.array(3, jnp.int32)],
)
def test_fixed_accepts_python_and_array_scalars(value):
  assert ols.FixedLossScale(value).loss_scale_value == float(value)


@pytest.mark.parametrize(
  "value, error",
  [
    (0.5, ValueError),
    (0, ValueError),
    (-3, ValueError),
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    (1e39, ValueError),
    (True, TypeError),
    ("128", TypeError),
    (None, TypeError),
    ([2.0], TypeError),
    ((2.0, 4.0), TypeError),
    (np.array([2.0, 4.0]), ValueError),
    (jnp.ones((1,)), ValueError),
    (np.array(True), TypeError),
    (np.complex64(2), TypeError),
  ],
)
def test_fixed_rejects_bad_values_naming_the_argument(value, error):
  with pytest.raises(error, match="loss_scale_value"):
    ols.FixedLossScale(value)


def test_fixed_refuses_a_traced_value():
  with pytest.raises(TypeError, match=r"loss_scale_value=...\)` .* traced"):
    jax.jit(lambda v: ols.FixedLossScale(v)())(jnp.float32(2.0))


# --- DynamicLossScale: TensorFlow's test vectors ---------------------------


def test_dynamic_defaults_are_tensorflows():
  loss_scale = ols.DynamicLossScale()
  assert loss_scale.initial_loss_scale == 2.0**15
  assert loss_scale.increment_period == 2000
  assert loss_scale.multiplier == 2.0
  assert loss_scale.min_loss_scale == 1.0
  assert loss_scale.max_loss_scale is None
  assert loss_scale.current_loss_scale.dtype == jnp.float32
  assert loss_scale.num_good_steps.dtype == jnp.int32
  assert float(loss_scale()) == 2.0**15


def test_dynamic_increase():
  scales, applies = _run(ols.DynamicLossScale(1, 2, 2), [True] * 6)
  assert scales == [1, 2, 2, 4, 4, 8]
  assert all(applies)


def test_dynamic_keeps_increasing_until_capped_at_float32_max():
  loss_scale = ols.DynamicLossScale(F32_MAX / 4, 1, 2)
  scales, _ = _run(loss_scale, [True] * 4)
  assert scales == [F32_MAX / 2, F32_MAX, F32_MAX, F32_MAX]


def test_dynamic_decreases_every_nonfinite_step():
  scales, applies = _run(ols.DynamicLossScale(1024, 2, 2), [False] * 12)
  assert scales == [512, 256, 128, 64, 32, 16, 8, 4, 2, 1, 1, 1]
  assert not any(applies)


def test_dynamic_keeps_decreasing_until_one():
  scales, _ = _run(ols.DynamicLossScale(16, 2, 2), [False] * 5)
  assert scales == [8, 4, 2, 1, 1]


def test_dynamic_nan_clears_good_steps():
  loss_scale = ols.DynamicLossScale(1, 2, 2)
  scales, applies = _run(loss_scale, [True, False, True, True])
  assert scales == [1, 1, 1, 2]
  assert applies == [True, False, True, True]


def test_dynamic_increases_every_step_with_period_one():
  scales, _ = _run(ols.DynamicLossScale(1, 1, 2), [True] * 5)
  assert scales == [2, 4, 8, 16, 32]


def test_dynamic_alternating_finite_and_nonfinite():
  scales, applies = _run(ols.DynamicLossScale(2, 1, 2), [True, False] * 3)
  assert scales == [4, 2, 4, 2, 4, 2]
  assert applies == [True, False] * 3


def test_dynamic_non_default_multiplier():
  scales, _ = _run(ols.DynamicLossScale(1, 1, 3), [True, True, False, True])
  assert scales == [3, 9, 3, 9]


def test_dynamic_random_mix_matches_tensorflow():
  rng = np.random.RandomState(1234)
  steps = list(rng.rand(500) < 0.8)
  loss_scale = ols.DynamicLossScale(2**10, 3, 2)
  scales, applies = _run(loss_scale, steps, jax.jit(lambda ls, g: ls.update(g)))
  ref = tf_dynamic_loss_scale(steps, 2**10, 3, 2)
  assert scales == [float(s) for s, _, _ in ref]
  assert applies == [a for _, _, a in ref]


def test_dynamic_update_ignores_none_gradients():
  loss_scale = ols.DynamicLossScale(2, 1, 2)
  new, should_apply = loss_scale.update([None, jnp.ones(2), None])
  assert bool(should_apply) and float(new()) == 4.0
  new, should_apply = loss_scale.update([None])
  assert bool(should_apply) and float(new()) == 4.0


@pytest.mark.parametrize("multiplier", [1.5, 3.0, 10.0, 1.1, 7.0, 2.0])
def test_dynamic_bit_exact_with_non_power_of_two_multipliers(multiplier):
  rng = np.random.RandomState(int(multiplier * 10))
  steps = list(rng.rand(400) < 0.55)
  initial = float(np.float32(rng.uniform(1, 1e6)))
  ref = tf_dynamic_loss_scale(steps, initial, 2, multiplier)
  expected = np.array([s for s, _, _ in ref], np.float32)

  loss_scale = ols.DynamicLossScale(initial, 2, multiplier)
  eager, _ = _run(loss_scale, steps)
  jitted, _ = _run(loss_scale, steps, jax.jit(lambda ls, g: ls.update(g)))

  def body(ls, finite):
    ls, _ = ls.adjust(finite)
    return ls, ls()

  _, scanned = jax.jit(lambda ls, f: lax.scan(body, ls, f))(
    loss_scale, jnp.array(steps)
  )
  np.testing.assert_array_equal(np.array(eager, np.float32), expected)
  np.testing.assert_array_equal(np.array(jitted, np.float32), expected)
  np.testing.assert_array_equal(np.asarray(scanned), expected)


def test_dynamic_min_and_max_bounds():
  loss_scale = ols.DynamicLossScale(
    8.0, 1, 2.0, min_loss_scale=2.0, max_loss_scale=32.0
  )
  scales, _ = _run(loss_scale, [True] * 4 + [False] * 5)
  assert scales == [16, 32, 32, 32, 16, 8, 4, 2, 2]
  ref = tf_dynamic_loss_scale([True] * 4 + [False] * 5, 8.0, 1, 2.0, 2.0, 32.0)
  assert scales == [float(s) for s, _, _ in ref]


def test_dynamic_counter_resets_even_when_increase_is_refused():
  loss_scale = ols.DynamicLossScale(16.0, 2, 2.0, max_loss_scale=16.0)
  for _ in range(2):
    loss_scale, _ = loss_scale.update(_grads(True))
  assert int(loss_scale.num_good_steps) == 0 and float(loss_scale()) == 16.0


@pytest.mark.parametrize(
  "kwargs, name, error",
  [
    (dict(increment_period=0), "increment_period", ValueError),
    (dict(increment_period=1.0), "increment_period", TypeError),
    (dict(increment_period=True), "increment_period", TypeError),
    (dict(increment_period=2**31), "increment_period", ValueError),
    (dict(multiplier=1.0), "multiplier", ValueError),
    (dict(multiplier=0.5), "multiplier", ValueError),
    (dict(multiplier=float("nan")), "multiplier", ValueError),
    (dict(multiplier=float("inf")), "multiplier", ValueError),
    (dict(multiplier="2"), "multiplier", TypeError),
    (dict(initial_loss_scale=0.5), "initial_loss_scale", ValueError),
    (dict(initial_loss_scale=float("inf")), "initial_loss_scale", ValueError),
    (dict(initial_loss_scale=None), "initial_loss_scale", TypeError),
    (dict(initial_loss_scale=[2.0]), "initial_loss_scale", TypeError),
    (dict(min_loss_scale=0.0), "min_loss_scale", ValueError),
    (dict(min_loss_scale=-1.0), "min_loss_scale", ValueError),
    (dict(min_loss_scale=2.0**16), "initial_loss_scale", ValueError),
    (dict(max_loss_scale=2.0**14), "max_loss_scale", ValueError),
    (dict(max_loss_scale=float("nan")), "max_loss_scale", ValueError),
    (dict(max_loss_scale=1e39), "max_loss_scale", ValueError),
    (dict(max_loss_scale=False), "max_loss_scale", TypeError),
  ],
)
def test_dynamic_rejects_bad_hyperparameters(kwargs, name, error):
  with pytest.raises(error, match=name):
    ols.DynamicLossScale(**kwargs)


def test_dynamic_min_below_one_is_allowed():
  loss_scale = ols.DynamicLossScale(1.0, 1, 2.0, min_loss_scale=0.25)
  scales, _ = _run(loss_scale, [False] * 4)
  assert scales == [0.5, 0.25, 0.25, 0.25]


# --- NoOpLossScale ----------------------------------------------------------


def test_noop_is_identity_and_always_applies():
  loss_scale = ols.NoOpLossScale()
  tree = {"a": jnp.array([1.0, jnp.nan], jnp.bfloat16), "b": None}
  assert loss_scale.scale(tree)["a"] is not None
  chex.assert_trees_all_equal(loss_scale.unscale(tree), tree)
  new, should_apply = loss_scale.update(tree)
  assert bool(should_apply) and float(new()) == 1.0


# --- scale and unscale ------------------------------------------------------


@pytest.mark.parametrize(
  "dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64]
)
@pytest.mark.parametrize(
  "loss_scale",
  [ols.FixedLossScale(1024), ols.DynamicLossScale(), ols.NoOpLossScale()],
  ids=["fixed", "dynamic", "noop"],
)
def test_scale_and_unscale_keep_dtypes_and_none(dtype, loss_scale):
  tree = {"w": jnp.arange(4).astype(dtype) / jnp.asarray(8, dtype), "n": None}
  for fn in (loss_scale.scale, loss_scale.unscale, jax.jit(loss_scale.unscale)):
    out = fn(tree)
    assert out["n"] is None
    assert out["w"].dtype == dtype and out["w"].shape == (4,)
  round_trip = loss_scale.unscale(loss_scale.scale(tree))
  chex.assert_trees_all_equal(round_trip, tree)


def test_unscale_float16_does_not_overflow_for_scales_beyond_float16():
  loss_scale = ols.FixedLossScale(2.0**20)
  grads = jnp.array([2.0**10, 2.0**-4], jnp.float16)
  np.testing.assert_array_equal(
    loss_scale.unscale(grads), jnp.array([2.0**-10, 2.0**-24], jnp.float16)
  )


def test_scaled_float16_loss_overflows_to_inf_as_in_tensorflow():
  loss = jnp.array(4.0, jnp.float16)
  assert jnp.isinf(ols.FixedLossScale(2**15).scale(loss))


def test_scaled_float16_loss_overflow_alone_leaves_the_gradients_finite():
  # `scale` is linear: its VJP multiplies the cotangent by the scale, so the
  # backward pass never sees the inf scaled loss.
  loss_scale = ols.FixedLossScale(2**15)

  def scaled_loss(w):  # 42, times 2**15, overflows float16
    return loss_scale.scale(jnp.sum(w.astype(jnp.float16)) + jnp.float16(40))

  value, grads = jax.value_and_grad(scaled_loss)(jnp.ones(2))
  assert value.dtype == jnp.float16 and jnp.isinf(value)
  np.testing.assert_array_equal(grads, [2.0**15, 2.0**15])
  assert bool(loss_scale.grads_finite(grads))
  # A scale beyond float16's largest value overflows the cotangent itself.
  too_large = ols.FixedLossScale(2**16)
  grads = jax.grad(lambda w: too_large.scale(jnp.sum(w.astype(jnp.float16))))(
    jnp.ones(2)
  )
  assert not bool(too_large.grads_finite(grads))


def test_unscale_is_the_same_with_and_without_jit():
  loss_scale = ols.FixedLossScale(3.0)
  x = jax.random.normal(jax.random.PRNGKey(0), (1000,))
  np.testing.assert_array_equal(
    loss_scale.unscale(x), jax.jit(loss_scale.unscale)(x)
  )
  np.testing.assert_allclose(loss_scale.unscale(x), x / 3.0, rtol=2e-7)


@pytest.mark.parametrize(
  "loss_scale",
  [ols.FixedLossScale(2), ols.DynamicLossScale(8.0), ols.NoOpLossScale()],
)
def test_integer_and_bool_leaves_pass_through_scale_and_unscale(loss_scale):
  tree = {
    "a": jnp.arange(3),
    "m": jnp.array([True, False]),
    "x": jnp.ones(2, jnp.float16),
  }
  for method in ("scale", "unscale"):
    out = jax.jit(getattr(loss_scale, method))(tree)
    chex.assert_trees_all_equal_dtypes(out, tree)
    np.testing.assert_array_equal(out["a"], tree["a"])
    np.testing.assert_array_equal(out["m"], tree["m"])
  np.testing.assert_array_equal(
    loss_scale.unscale(tree)["x"], 1.0 / loss_scale()
  )
  assert bool(jax.jit(loss_scale.grads_finite)(tree))


def test_float0_leaves_pass_through():
  def f(x, n):
    return jnp.sum(x) * 2.0

  grads = jax.grad(f, argnums=(0, 1), allow_int=True)(jnp.ones(2), 3)
  loss_scale = ols.DynamicLossScale(4.0)
  out = loss_scale.unscale(grads)
  assert out[1].dtype == jax.dtypes.float0
  new, should_apply = loss_scale.update(out)
  assert bool(should_apply)


# --- pytree behaviour -------------------------------------------------------

ALL = [
  ols.FixedLossScale(7.0),
  ols.DynamicLossScale(3.0, 5, 1.5, min_loss_scale=0.5, max_loss_scale=1e6),
  ols.NoOpLossScale(),
]


def _fields(loss_scale):
  return {
    f.name: getattr(loss_scale, f.name) for f in dataclasses.fields(loss_scale)
  }


def _assert_same(a, b):
  assert type(a) is type(b)
  fa, fb = _fields(a), _fields(b)
  assert fa.keys() == fb.keys()
  for k in fa:
    if isinstance(fa[k], jax.Array):
      assert fa[k].dtype == fb[k].dtype
      np.testing.assert_array_equal(fa[k], fb[k])
    else:
      assert fa[k] == fb[k] and type(fa[k]) is type(fb[k]), k


@pytest.mark.parametrize("loss_scale", ALL, ids=lambda x: type(x).__name__)
def test_every_field_survives_jit_scan_cond_and_unflatten(loss_scale):
  _assert_same(jax.jit(lambda x: x)(loss_scale), loss_scale)
  leaves, treedef = jax.tree.flatten(loss_scale)
  _assert_same(jax.tree.unflatten(treedef, leaves), loss_scale)
  _, scanned = lax.scan(lambda c, _: (c, c), loss_scale, None, length=2)
  _assert_same(jax.tree.map(lambda x: x[0], scanned), loss_scale)
  _assert_same(lax.cond(True, lambda x: x, lambda x: x, loss_scale), loss_scale)
  _assert_same(
    jax.pmap(lambda x: x)(jax.tree.map(lambda x: x[None], loss_scale)),
    jax.tree.map(lambda x: x[None], loss_scale),
  ) if jax.tree.leaves(loss_scale) else None


def test_min_loss_scale_survives_jit_unlike_jmp():
  # jmp's hand-written flatten drops min_loss_scale, so after `jit` the floor
  # silently becomes 1. Here it must stay 0.25 and be used.
  loss_scale = ols.DynamicLossScale(1.0, 1, 2.0, min_loss_scale=0.25)

  @jax.jit
  def step(ls):
    return ls.update({"g": jnp.array(jnp.nan)})[0]

  for _ in range(3):
    loss_scale = step(loss_scale)
  assert loss_scale.min_loss_scale == 0.25
  assert float(loss_scale()) == 0.25


def test_hyperparameters_are_static_and_state_are_leaves():
  # As `LossScale` and the README describe the registration: keyed leaves,
  # the budget a third one only with hysteresis.
  def leaves(loss_scale):
    flat = jax.tree_util.tree_flatten_with_path(loss_scale)[0]
    return {jax.tree_util.keystr(path): x.dtype for path, x in flat}

  int32, float32 = jnp.dtype("int32"), jnp.dtype("float32")
  two = {".current_loss_scale": float32, ".num_good_steps": int32}
  assert leaves(ols.DynamicLossScale()) == two
  assert leaves(ols.DynamicLossScale(hysteresis=2)) == two | {
    ".hysteresis_budget": int32
  }
  assert leaves(ols.FixedLossScale(2.0)) == leaves(ols.NoOpLossScale()) == {}


def test_no_retrace_when_only_array_state_changes():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(ls, grads):
    return ls.update(grads)

  loss_scale = ols.DynamicLossScale(2.0, 2, 2.0)
  for finite in [True, False, True, True]:
    loss_scale, _ = step(loss_scale, _grads(finite))
  assert float(loss_scale()) == 2.0


@pytest.mark.parametrize("loss_scale", ALL, ids=lambda x: type(x).__name__)
def test_should_apply_and_scale_identical_with_and_without_jit(loss_scale):
  rng = np.random.RandomState(0)
  a, b = loss_scale, loss_scale
  step = jax.jit(lambda ls, g: ls.update(g))
  for finite in rng.rand(50) < 0.6:
    a, apply_a = a.update(_grads(finite))
    b, apply_b = step(b, _grads(finite))
    assert bool(apply_a) == bool(apply_b)
    assert float(a()) == float(b())
    assert apply_a.dtype == jnp.bool_ and apply_a.shape == ()


def test_loss_scales_are_immutable():
  loss_scale = ols.DynamicLossScale()
  with pytest.raises(dataclasses.FrozenInstanceError):
    loss_scale.multiplier = 3.0  # type: ignore[misc]
  new, _ = loss_scale.update(_grads(False))
  assert float(loss_scale()) == 2.0**15 and float(new()) == 2.0**14


def test_restore_from_saved_arrays():
  loss_scale = ols.DynamicLossScale(64.0, 10)
  for _ in range(3):
    loss_scale, _ = loss_scale.update(_grads(True))
  restored = ols.DynamicLossScale(
    **loss_scale.get_config(),
    current_loss_scale=np.asarray(loss_scale.current_loss_scale),
    num_good_steps=np.asarray(loss_scale.num_good_steps),
  )
  assert int(restored.num_good_steps) == 3
  assert math.isclose(float(restored()), 64.0)


# --- state passed to the constructor ----------------------------------------


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(current_loss_scale=float("nan")), "current_loss_scale.*got nan"),
    (dict(current_loss_scale=np.float32(np.inf)), "current_loss_scale.*inf"),
    (dict(current_loss_scale=jnp.float32(0.5)), "min_loss_scale=1.0.*0.5"),
    (
      dict(initial_loss_scale=4.0, max_loss_scale=64.0, current_loss_scale=128),
      r"max_loss_scale=64.0\], got 128\.",
    ),
    (dict(current_loss_scale=1e39), "float32's maximum.*1e\\+39"),
    (dict(num_good_steps=-3), r"num_good_steps=...\)` must be .*got -3\."),
    (
      dict(num_good_steps=jnp.int32(2000)),
      r"in \[0, increment_period=2000\), got 2000",
    ),
    (
      dict(hysteresis=2, hysteresis_budget=np.int32(3)),
      r"hysteresis_budget.*\[0, hysteresis=2\], got 3",
    ),
    (dict(hysteresis=2, hysteresis_budget=-1), "hysteresis_budget.*got -1"),
    (dict(hysteresis=2, hysteresis_budget=None), "hysteresis_budget.*None"),
    (dict(hysteresis_budget=jnp.int32(1)), "None when hysteresis=1"),
  ],
)
def test_constructor_refuses_concrete_state_out_of_range(kwargs, message):
  with pytest.raises(ValueError, match=r"`DynamicLossScale\(.*" + message):
    ols.DynamicLossScale(**kwargs)


@pytest.mark.parametrize(
  "kwargs, name",
  [
    (dict(num_good_steps=2.5), "num_good_steps"),
    (dict(num_good_steps=np.float32(2)), "num_good_steps"),
    (dict(current_loss_scale=True), "current_loss_scale"),
    (dict(hysteresis=2, hysteresis_budget=jnp.float32(1)), "hysteresis_budget"),
  ],
)
def test_constructor_refuses_state_of_the_wrong_dtype(kwargs, name):
  with pytest.raises(TypeError, match=f"`DynamicLossScale\\({name}=...\\)`"):
    ols.DynamicLossScale(**kwargs)


def test_constructor_checks_a_stacked_state_element_by_element():
  scales = jnp.array([4.0, 8.0, jnp.nan, 0.5])
  with pytest.raises(ValueError, match=r"got nan at index \(2,\)"):
    ols.DynamicLossScale(4.0, current_loss_scale=scales)
  steps = np.array([[0, 1], [4, 5]], np.int32)
  with pytest.raises(ValueError, match=r"got 5 at index \(1, 1\)"):
    ols.DynamicLossScale(4.0, 5, num_good_steps=steps)
  stacked = ols.DynamicLossScale(
    4.0, 5, current_loss_scale=scales[:2], num_good_steps=steps[0]
  )
  assert stacked.num_good_steps.shape == (2,)


@pytest.mark.parametrize(
  "state",
  [
    dict(current_loss_scale=1, num_good_steps=0),
    dict(current_loss_scale=np.float32(8), num_good_steps=np.int32(4)),
    dict(current_loss_scale=jnp.float32(1), num_good_steps=jnp.int32(4)),
    dict(current_loss_scale=np.float64(8.0), num_good_steps=np.int64(0)),
  ],
)
def test_constructor_accepts_the_bounds(state):
  ls = ols.DynamicLossScale(4.0, 5, max_loss_scale=8.0, **state)
  assert ls.current_loss_scale.dtype == np.float32
  assert ls.num_good_steps.dtype == np.int32
  for budget in (0, 3, np.int32(3), jnp.int32(0)):
    ols.DynamicLossScale(4.0, hysteresis=3, hysteresis_budget=budget)
  # min_loss_scale is compared as float32, as the state holds it.
  floor = ols.DynamicLossScale(
    1.0, min_loss_scale=0.1, current_loss_scale=np.float32(0.1)
  )
  floored, _ = floor.update({"g": jnp.array(jnp.nan)})
  assert float(floored()) == float(np.float32(0.1))


def _steps_in_scan(loss_scale):
  """The scales of four steps (finite, inf, finite, finite) in `lax.scan`."""

  def step(ls, finite):
    ls, _ = ls.update({"g": jnp.where(finite, 1.0, jnp.inf)})
    return ls, ls()

  finite = jnp.array([True, False, True, True])
  return jax.jit(lambda ls: lax.scan(step, ls, finite))(loss_scale)


@pytest.mark.parametrize(
  "scale",
  [8, 8.0, np.float16(8), jnp.bfloat16(8), np.float64(8), np.int32(8)]
  + [np.uint8(8), np.array(8, np.int64), jnp.array([8.0], jnp.float16)],
  ids=repr,
)
@pytest.mark.parametrize(
  "steps", [1, np.int64(1), np.uint8(1), np.int16(1), jnp.uint8(1)], ids=repr
)
def test_constructor_converts_state_values_exact_in_float32_and_int32(
  scale, steps
):
  shape = np.shape(scale)
  ls = ols.DynamicLossScale(
    8.0,
    2,
    current_loss_scale=scale,
    num_good_steps=np.broadcast_to(steps, shape) if shape else steps,
  )
  assert ls.current_loss_scale.dtype == jnp.float32
  assert ls.num_good_steps.dtype == jnp.int32
  # A JAX array stays one (converted where it lives).
  assert isinstance(ls.current_loss_scale, jax.Array) == isinstance(
    scale, jax.Array
  )
  # 0.1.0 kept the dtype given, and the step below failed in `lax.scan`
  # (the carry's dtype changed).
  out, scales = _steps_in_scan(ls)
  expected = np.broadcast_to([16.0, 8.0, 8.0, 16.0], (*shape, 4)).T
  np.testing.assert_array_equal(scales, expected)
  assert out.current_loss_scale.dtype == jnp.float32


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(current_loss_scale=np.float64(1 / 3)), r"got 0.333\d* \(float64\)"),
    (dict(current_loss_scale=0.1), "got 0.1 \\(float64\\)"),
    (dict(current_loss_scale=2**24 + 1), "got 16777217 \\(int64\\)"),
    (
      dict(current_loss_scale=np.array([4.0, 1 / 3])),
      r"got 0.333\d* at index \(1,\) \(float64\)",
    ),
  ],
)
def test_constructor_refuses_state_values_not_exact_in_float32(kwargs, message):
  with pytest.raises(ValueError, match=message) as error:
    ols.DynamicLossScale(min_loss_scale=0.0625, **kwargs)
  assert str(error.value).startswith(
    "`DynamicLossScale(current_loss_scale=...)` must be exact in float32"
  )


@pytest.mark.parametrize(
  "kwargs, got",
  [
    (dict(current_loss_scale=np.complex64(8)), "np.complex64"),
    (dict(current_loss_scale=np.bool_(True)), "np.True_"),
    (dict(current_loss_scale=jnp.array([True])), "dtype bool"),
    (dict(num_good_steps=np.float16(3)), "np.float16"),
    (dict(num_good_steps=jnp.bfloat16(3)), "bfloat16"),
    (dict(hysteresis=2, hysteresis_budget=np.float64(1)), "np.float64"),
  ],
)
def test_constructor_refuses_state_of_a_dtype_that_does_not_convert(
  kwargs, got
):
  (name,) = (k for k in kwargs if k != "hysteresis")
  with pytest.raises(TypeError, match=f"got .*{got}") as error:
    ols.DynamicLossScale(**kwargs)
  assert str(error.value).startswith(f"`DynamicLossScale({name}=...)` must be")


def test_constructor_converts_traced_state_only_of_an_exact_dtype():
  @jax.jit
  def build(scale, steps):
    ls = ols.DynamicLossScale(current_loss_scale=scale, num_good_steps=steps)
    return ls.update({"g": jnp.ones(())})[0]

  out = build(jnp.float16(4), jnp.int8(3))
  assert out.current_loss_scale.dtype == jnp.float32
  assert out.num_good_steps.dtype == jnp.int32
  assert int(out.num_good_steps) == 4
  # Its values unknown, an int32 may not be exact in float32.
  with pytest.raises(TypeError, match=r"current_loss_scale=...\)` .*traced"):
    build(jnp.int32(4), jnp.int32(3))


def test_constructor_refuses_state_fields_of_different_shapes():
  with pytest.raises(ValueError) as error:
    ols.DynamicLossScale(
      current_loss_scale=jnp.full((2,), 8.0), num_good_steps=jnp.zeros(3, int)
    )
  assert str(error.value) == (
    "`DynamicLossScale(num_good_steps=...)` must have the shape of"
    " current_loss_scale, (2,) (a leading replica axis included), got (3,)."
  )
  with pytest.raises(ValueError, match=r"shape \(2,\): pass num_good_steps"):
    ols.DynamicLossScale(current_loss_scale=jnp.full((2,), 8.0))
  stacked = ols.DynamicLossScale(
    hysteresis=2,
    current_loss_scale=np.full((1, 2), 8.0),
    num_good_steps=np.zeros((1, 2), np.int32),
    hysteresis_budget=np.ones((1, 2), np.int64),
  )
  assert stacked.hysteresis_budget.dtype == np.int32


def test_unflattening_neither_checks_nor_reads_the_state():
  ls = ols.DynamicLossScale(4.0, 5, hysteresis=2)
  # Out of range, not a number, abstract: unflattening takes any leaves.
  for leaf in [-1, np.float32(np.nan), None, jax.ShapeDtypeStruct((), int)]:
    out = jax.tree.map(lambda x, leaf=leaf: leaf, ls)
    assert isinstance(out, ols.DynamicLossScale) and out.hysteresis == 2
  leaves, treedef = jax.tree.flatten(ls)
  with jax.transfer_guard("disallow"):
    jax.tree.unflatten(treedef, [-leaf for leaf in leaves])
  # A state built from tracers under `jit` is not checked either.
  build = jax.jit(lambda s: ols.DynamicLossScale(current_loss_scale=s)())
  assert float(build(jnp.float32(-1.0))) == -1.0


def test_steps_build_their_state_without_reading_it():
  ls = ols.DynamicLossScale(4.0, 1, hysteresis=2)
  with jax.transfer_guard_device_to_host("disallow"):
    for grad in [1.0, jnp.nan, jnp.nan]:
      ls, _ = ls.update({"g": jnp.array(grad)})
    ls = ls.lowered()
  assert float(ls()) == 2.0


# --- a loss scale is not a number -------------------------------------------


LOSS = jnp.float32(0.5)
# What is written, and how the message names it.
NOT_A_NUMBER = [
  ("loss * ls", lambda ls: LOSS * ls, "x * loss_scale"),
  ("ls * loss", lambda ls: ls * LOSS, "loss_scale * x"),
  ("0.5 * ls", lambda ls: 0.5 * ls, "x * loss_scale"),
  ("np.float32 * ls", lambda ls: np.float32(0.5) * ls, "x * loss_scale"),
  ("np.ones / ls", lambda ls: np.ones(2) / ls, "x / loss_scale"),
  ("ls / 2", lambda ls: ls / 2, "loss_scale / x"),
  ("loss + ls", lambda ls: LOSS + ls, "x + loss_scale"),
  ("ls - loss", lambda ls: ls - LOSS, "loss_scale - x"),
  ("2 ** ls", lambda ls: 2**ls, "x ** loss_scale"),
  ("-ls", lambda ls: -ls, "-loss_scale"),
  ("ls > 1", lambda ls: ls > 1, "loss_scale > x"),
  ("float", float, "float(loss_scale)"),
  ("int", int, "int(loss_scale)"),
  ("np.asarray", np.asarray, "asarray(loss_scale)"),
  ("jnp.asarray", jnp.asarray, "asarray(loss_scale)"),
]


@pytest.mark.parametrize("loss_scale", ALL, ids=lambda x: type(x).__name__)
@pytest.mark.parametrize(
  "use, operation",
  [case[1:] for case in NOT_A_NUMBER],
  ids=[case[0] for case in NOT_A_NUMBER],
)
def test_a_loss_scale_used_as_a_number_says_what_to_call(
  loss_scale, use, operation
):
  with pytest.raises(TypeError) as error:
    use(loss_scale)
  assert str(error.value) == (
    f"`{operation}` with a {type(loss_scale).__name__}: a loss scale"
    " is not a number. Call `loss_scale.scale(loss)` to scale a loss (and"
    " `loss_scale.unscale(grads)` to unscale gradients), or `loss_scale()`"
    " for the scale itself, a float32 array."
  )


def test_a_loss_scale_is_still_a_pytree_and_compares_by_identity():
  ls = ols.DynamicLossScale(8.0)
  assert ls == ls and ls != ols.DynamicLossScale(8.0)
  out = jax.jit(lambda ls: ls.scale(LOSS))(ls)
  assert out.dtype == jnp.float32 and float(out) == 4.0
  same = jax.tree.map(lambda x: x, ls)
  assert float(same()) == 8.0
