"""The LossScale family as data: the rule, hyperparameters, pytrees, dtypes.

TensorFlow's own traces are replayed in `test_tf_traces.py`; here the rule
beyond them (hysteresis, bounds, other multipliers, any starting state) is
checked against `tests/tf_reference.py`'s independent model.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from jax import lax

import optax_lossscale as ols
from tests.tf_reference import hysteresis_loss_scale, tf_dynamic_loss_scale

F32_MAX = float(np.finfo(np.float32).max)
STATE = ("current_loss_scale", "num_good_steps", "num_bad_steps")


def _state(ls: ols.DynamicLossScale) -> tuple:
  return tuple(np.asarray(getattr(ls, name)).tolist() for name in STATE)


def _leaves(tree) -> list[tuple[str, tuple, np.dtype]]:
  """Each leaf's path, shape and dtype."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(k), np.shape(x), x.dtype) for k, x in flat]


# --- FixedLossScale --------------------------------------------------------


@pytest.mark.parametrize(
  "value",
  [1, 1.0, 2**15, 12345.678, np.float32(8), np.int64(4), jnp.float32(16.0)]
  + [jnp.bfloat16(8), np.float16(2), np.uint8(4), jnp.array(3, jnp.int32)],
  ids=repr,
)
def test_fixed_accepts_python_and_array_scalars(value):
  loss_scale = ols.FixedLossScale(value)
  assert loss_scale.loss_scale_value == float(value)
  assert type(loss_scale.loss_scale_value) is float
  assert loss_scale().dtype == jnp.float32 and loss_scale().shape == ()


BAD_VALUES = [
  (0.5, ValueError, "must be at least 1, got 0.5."),
  (0, ValueError, "must be at least 1, got 0."),
  (-3, ValueError, "must be at least 1, got -3."),
  (float("nan"), ValueError, "must be finite in float32, got float nan."),
  (float("inf"), ValueError, "must be finite in float32, got float inf."),
  (1e39, ValueError, "must be finite in float32, got float 1e+39."),
  (True, TypeError, "must be a real number, got bool True."),
  ("128", TypeError, "must be a real number, got str '128'."),
  (None, TypeError, "must be a real number, got NoneType None."),
  ([2.0], TypeError, "must be a real number, got list [2.0]."),
  (np.array([2.0, 4.0]), TypeError, "got an array of float64 and shape (2,)."),
  (np.array(True), TypeError, "got ndarray array(True)."),
  (np.complex64(2), TypeError, "got np.complex64(2+0j)."),
]


@pytest.mark.parametrize(
  "value, error, message", BAD_VALUES, ids=[repr(c[0]) for c in BAD_VALUES]
)
def test_fixed_rejects_bad_values_naming_the_argument_and_value(
  value, error, message
):
  with pytest.raises(error) as raised:
    ols.FixedLossScale(value)
  assert str(raised.value).startswith("`FixedLossScale(loss_scale_value=...)`")
  assert str(raised.value).endswith(message)


def test_fixed_refuses_a_traced_value():
  with pytest.raises(
    TypeError,
    match=r"loss_scale_value=...\)` must be a Python number, not a traced",
  ):
    jax.jit(lambda v: ols.FixedLossScale(v)())(jnp.float32(2.0))


# --- DynamicLossScale: hyperparameters --------------------------------------


def test_dynamic_defaults_are_tensorflow_s():
  loss_scale = ols.DynamicLossScale()
  assert loss_scale.get_config() == {
    "initial_loss_scale": 2.0**15,
    "increment_period": 2000,
    "multiplier": 2.0,
  }
  assert (loss_scale.min_loss_scale, loss_scale.max_loss_scale) == (1.0, None)
  assert (loss_scale.hysteresis, loss_scale.consecutive_hysteresis) == (
    1,
    False,
  )
  assert _leaves(loss_scale) == [
    (".current_loss_scale", (), jnp.float32),
    (".num_good_steps", (), jnp.int32),
    (".num_bad_steps", (), jnp.int32),
  ]
  assert _state(loss_scale) == (2.0**15, 0, 0)


BAD_HYPERPARAMETERS = [
  (dict(increment_period=0), ValueError, "int in [1, 2147483647], got 0."),
  (dict(increment_period=2**31), ValueError, "got 2147483648."),
  (dict(increment_period=1.0), TypeError, "must be an int, got float 1.0."),
  (dict(increment_period=True), TypeError, "must be an int, got bool True."),
  (dict(multiplier=1.0), ValueError, "and backs off by it), got 1.0."),
  (dict(multiplier=0.5), ValueError, "and backs off by it), got 0.5."),
  (dict(multiplier=float("nan")), ValueError, "in float32, got float nan."),
  (dict(multiplier=float("inf")), ValueError, "in float32, got float inf."),
  (dict(multiplier="2"), TypeError, "a real number, got str '2'."),
  (
    dict(initial_loss_scale=0.5),
    ValueError,
    "must be at least min_loss_scale (1), got 0.5.",
  ),
  (dict(initial_loss_scale=None), TypeError, "got NoneType None."),
  (dict(initial_loss_scale=[2.0]), TypeError, "got list [2.0]."),
  (dict(min_loss_scale=0.0), ValueError, "normal number, got 0.0."),
  (dict(min_loss_scale=-1.0), ValueError, "normal number, got -1.0."),
  # A subnormal floor flushes to 0: every step would skip.
  (dict(min_loss_scale=1e-39), ValueError, "normal number, got 1e-39."),
  (
    dict(max_loss_scale=2.0**14),
    ValueError,
    "must be at least initial_loss_scale, got 16384.0.",
  ),
  (dict(max_loss_scale=1e39), ValueError, "in float32, got float 1e+39."),
  (dict(max_loss_scale=False), TypeError, "got bool False."),
  (dict(hysteresis=0), ValueError, "int in [1, 2147483647], got 0."),
  (dict(hysteresis=2.0), TypeError, "must be an int, got float 2.0."),
  (dict(consecutive_hysteresis=1), TypeError, "must be a bool, got int 1."),
  (dict(consecutive_hysteresis=None), TypeError, "got NoneType None."),
]


@pytest.mark.parametrize(
  "kwargs, error, message",
  BAD_HYPERPARAMETERS,
  ids=[repr(c[0]) for c in BAD_HYPERPARAMETERS],
)
def test_dynamic_rejects_bad_hyperparameters_naming_argument_and_value(
  kwargs, error, message
):
  ((name, _),) = kwargs.items()
  with pytest.raises(error) as raised:
    ols.DynamicLossScale(**kwargs)
  assert str(raised.value).startswith(f"`DynamicLossScale({name}=...)` must")
  assert str(raised.value).endswith(message)
  # The same check when a hyperparameter changes on a running loss scale.
  running, _ = ols.DynamicLossScale().adjust(jnp.array(False))
  with pytest.raises(error, match=rf"`DynamicLossScale\({name}=...\)`"):
    dataclasses.replace(running, **kwargs)


def test_a_subclass_is_named_by_its_own_class():
  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class Mine(ols.DynamicLossScale):
    pass

  with pytest.raises(ValueError, match=r"^`Mine\(hysteresis=...\)` must"):
    Mine(hysteresis=0)


def test_dynamic_keeps_numpy_hyperparameters_as_python_values():
  loss_scale = ols.DynamicLossScale(
    np.float32(8),
    np.int32(5),
    jnp.float32(1.5),
    hysteresis=np.int64(3),
    consecutive_hysteresis=np.bool_(True),
  )
  config = loss_scale.get_config()
  assert config == {
    "initial_loss_scale": 8.0,
    "increment_period": 5,
    "multiplier": 1.5,
    "hysteresis": 3,
    "consecutive_hysteresis": True,
  }
  assert [type(v) for v in config.values()] == [float, int, float, int, bool]


# --- DynamicLossScale: the rule ---------------------------------------------


def _as32(x: float) -> float:
  return float(np.float32(x))


@st.composite
def _configs(draw):
  multiplier = draw(
    st.sampled_from([1.1, 1.5, 2.0, 3.0, 7.0, 10.0]) | st.floats(1.01, 16.0)
  )
  minimum = _as32(draw(st.sampled_from([1.0, 0.25]) | st.floats(1e-6, 1e3)))
  initial = max(_as32(draw(st.floats(minimum, 1e30))), minimum)
  maximum = draw(st.none() | st.floats(initial, F32_MAX))
  return dict(
    initial_loss_scale=initial,
    increment_period=draw(st.integers(1, 6) | st.just(2**31 - 1)),
    multiplier=multiplier,
    min_loss_scale=minimum,
    max_loss_scale=None if maximum is None else max(_as32(maximum), initial),
    hysteresis=draw(st.integers(1, 4)),
    consecutive_hysteresis=draw(st.booleans()),
  )


@settings(max_examples=40, deadline=None)
@given(
  config=_configs(),
  start=st.none()
  | st.tuples(
    st.floats(1e-3, 1e36).map(_as32),
    st.integers(0, 8),
    st.integers(0, 6),
  ),
  steps=st.lists(st.booleans(), max_size=40),
)
def test_dynamic_follows_the_rule_from_any_state(config, start, steps):
  # From a fresh state, or from any valid state a restore or a changed
  # hyperparameter may leave (counters past their usual range included).
  loss_scale = ols.DynamicLossScale(**config)
  if start is not None:
    loss_scale = dataclasses.replace(
      loss_scale,
      current_loss_scale=jnp.float32(start[0]),
      num_good_steps=jnp.int32(start[1]),
      num_bad_steps=jnp.int32(start[2]),
    )
  rule = {k: v for k, v in config.items() if k != "initial_loss_scale"}
  scale, good, bad = _state(loss_scale)
  want = hysteresis_loss_scale(
    steps, scale=scale, num_good_steps=good, num_bad_steps=bad, **rule
  )
  for finite, expected in zip(steps, want, strict=True):
    loss_scale, should_apply = loss_scale.adjust(jnp.array(finite))
    assert _state(loss_scale) == expected
    assert bool(should_apply) is finite
  assert loss_scale.get_config() == ols.DynamicLossScale(**config).get_config()
  if start is None and config["hysteresis"] == 1:  # TensorFlow's rule
    tf = tf_dynamic_loss_scale(
      steps,
      **{k: v for k, v in config.items() if "hysteresis" not in k},
    )
    assert [s for s, _, _ in want] == [s for s, _, _ in tf]


@pytest.mark.parametrize(
  "config",
  [
    dict(increment_period=3, multiplier=1.5, hysteresis=3),
    dict(
      increment_period=2,
      multiplier=10.0,
      hysteresis=2,
      consecutive_hysteresis=True,
    ),
  ],
  ids=["hysteresis", "consecutive"],
)
def test_hysteresis_holds_in_scan_under_vmap(config):
  # Members with their own state and steps, one compiled scan.
  rng = np.random.default_rng(len(config))
  members, length = 8, 120
  finite = rng.random((members, length)) < rng.uniform(0.3, 0.9, (members, 1))
  start = {
    "current_loss_scale": np.float32(2.0) ** rng.integers(0, 30, members),
    "num_good_steps": rng.integers(0, 3, members, dtype=np.int32),
    "num_bad_steps": rng.integers(0, 3, members, dtype=np.int32),
  }
  loss_scale = ols.DynamicLossScale(**config, **start)

  def step(ls, ok):
    ls, should_apply = ls.adjust(ok)
    return ls, (*(getattr(ls, n) for n in STATE), should_apply)

  run = jax.jit(jax.vmap(lambda ls, f: lax.scan(step, ls, f)))
  last, outs = run(loss_scale, finite)
  assert _leaves(last) == [
    (f".{n}", (members,), d)
    for n, d in zip(STATE, [jnp.float32, jnp.int32, jnp.int32], strict=True)
  ]
  for i in range(members):
    want = hysteresis_loss_scale(
      finite[i],
      scale=start["current_loss_scale"][i],
      num_good_steps=int(start["num_good_steps"][i]),
      num_bad_steps=int(start["num_bad_steps"][i]),
      **config,
    )
    got = list(zip(*(np.asarray(o[i]).tolist() for o in outs[:3]), strict=True))
    assert got == [tuple(np.asarray(w).tolist() for w in x) for x in want]
    assert np.asarray(outs[3][i]).tolist() == finite[i].tolist()


def test_dynamic_update_reads_only_float_leaves():
  loss_scale = ols.DynamicLossScale(2.0, 1)
  float0 = jax.grad(lambda x, n: x, argnums=(0, 1), allow_int=True)(1.0, 3)[1]
  grads = {
    "none": None,
    "int": jnp.arange(3),
    "bool": jnp.array([True]),
    "float0": float0,
    "bfloat16": jnp.ones(2, jnp.bfloat16),
    "float16": jnp.ones(2, jnp.float16),
    "complex64": jnp.array([1 + 2j, 3j], jnp.complex64),
  }
  for name, bad in [
    (None, None),
    ("float16", np.array([1.0, np.inf], np.float16)),
    ("complex64", np.array([1 + 2j, complex(0, np.inf)], np.complex64)),
  ]:
    new, should_apply = loss_scale.update(grads | ({name: bad} if name else {}))
    assert bool(should_apply) is (name is None)
    assert float(new()) == (4.0 if name is None else 1.0)
  assert bool(loss_scale.update([None])[1])


def test_lowered_divides_the_scale_floored_and_restarts_the_good_steps():
  loss_scale, _ = ols.DynamicLossScale(3.0, 5, 1.5, min_loss_scale=1.5).adjust(
    jnp.array(True)
  )
  assert _state(loss_scale.lowered()) == (2.0, 0, 0)
  assert float(loss_scale.lowered().lowered()()) == 1.5  # the floor
  assert ols.FixedLossScale(8.0).lowered() is None
  assert ols.NoOpLossScale().lowered() is None


# --- dataclasses.replace ----------------------------------------------------


def test_replace_changes_a_hyperparameter_of_a_fresh_loss_scale():
  fresh = ols.DynamicLossScale()
  changed = dataclasses.replace(
    fresh, hysteresis=2, consecutive_hysteresis=True
  )
  assert (changed.hysteresis, changed.consecutive_hysteresis) == (2, True)
  assert _leaves(changed) == _leaves(fresh)
  assert _state(changed) == (2.0**15, 0, 0)
  # The state is kept, as on a running loss scale: a new initial scale is
  # its config (what `serialize` restarts from), not its scale now.
  restart = dataclasses.replace(fresh, initial_loss_scale=8.0)
  assert float(restart()) == 2.0**15
  assert float(ols.deserialize(ols.serialize(restart))()) == 8.0
  fixed = dataclasses.replace(ols.FixedLossScale(2), loss_scale_value=4)
  assert fixed.loss_scale_value == 4.0 and float(fixed()) == 4.0


def test_replace_on_a_running_loss_scale_keeps_its_state_and_the_rule():
  # Issue 36's case: 15 good steps, then a period of 10.
  loss_scale = ols.DynamicLossScale(8.0, 2000, hysteresis=3)
  step = jax.jit(lambda ls, ok: ls.adjust(ok)[0])
  for finite in [False, False] + [True] * 15:
    loss_scale = step(loss_scale, jnp.array(finite))
  assert _state(loss_scale) == (8.0, 15, 2)
  shorter = dataclasses.replace(loss_scale, increment_period=10)
  assert _state(shorter) == (8.0, 15, 2)
  grown = step(shorter, jnp.array(True))
  assert _state(grown) == (16.0, 0, 0)
  # A smaller hysteresis: the budget already spent lowers at the next
  # overflow; a larger one waits.
  assert _state(step(dataclasses.replace(loss_scale, hysteresis=1), False)) == (
    4.0,
    0,
    1,
  )
  assert _state(step(dataclasses.replace(loss_scale, hysteresis=4), False)) == (
    8.0,
    0,
    3,
  )


# --- pytrees ----------------------------------------------------------------

ALL = [
  ols.FixedLossScale(7.0),
  ols.DynamicLossScale(
    3.0,
    5,
    1.5,
    min_loss_scale=0.25,
    max_loss_scale=1e6,
    hysteresis=3,
    consecutive_hysteresis=True,
  ),
  ols.NoOpLossScale(),
]


def _assert_same(a, b):
  assert type(a) is type(b)
  for field in dataclasses.fields(a):
    x, y = getattr(a, field.name), getattr(b, field.name)
    if field.metadata.get("static"):
      assert x == y and type(x) is type(y), field.name
    else:
      assert (x.dtype, x.shape) == (y.dtype, y.shape), field.name
      np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("loss_scale", ALL, ids=lambda x: type(x).__name__)
def test_every_field_survives_jit_scan_cond_and_unflatten(loss_scale):
  _assert_same(jax.jit(lambda x: x)(loss_scale), loss_scale)
  leaves, treedef = jax.tree.flatten(loss_scale)
  _assert_same(jax.tree.unflatten(treedef, leaves), loss_scale)
  _assert_same(jax.tree.map(lambda x: x, loss_scale), loss_scale)
  _, scanned = lax.scan(lambda c, _: (c, c), loss_scale, None, length=2)
  _assert_same(jax.tree.map(lambda x: x[1], scanned), loss_scale)
  same = lax.cond(True, lambda x: x, lambda x: x, loss_scale)
  _assert_same(same, loss_scale)
  if jax.tree.leaves(loss_scale):  # replicated over `pmap`'s devices
    stacked = jax.tree.map(lambda x: x[None], loss_scale)
    _assert_same(jax.pmap(lambda x: x)(stacked), stacked)


def test_the_floor_survives_jit_unlike_jmp_s():
  # jmp's hand-written flatten drops min_loss_scale, so after `jit` the
  # floor silently becomes 1.
  step = jax.jit(lambda ls: ls.adjust(jnp.array(False))[0])
  loss_scale = ols.DynamicLossScale(1.0, 1, 2.0, min_loss_scale=0.25)
  for _ in range(3):
    loss_scale = step(loss_scale)
  assert loss_scale.min_loss_scale == 0.25 and float(loss_scale()) == 0.25


@pytest.mark.parametrize(
  "config",
  [
    dict(),
    dict(hysteresis=3),
    dict(hysteresis=2, consecutive_hysteresis=True),
    dict(initial_loss_scale=4.0, min_loss_scale=0.5, max_loss_scale=64.0),
    dict(increment_period=1, multiplier=1.5),
  ],
  ids=repr,
)
def test_the_leaves_do_not_depend_on_the_hyperparameters(config):
  assert _leaves(ols.DynamicLossScale(**config)) == _leaves(
    ols.DynamicLossScale()
  )
  params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}

  def init(loss_scale):
    tx = ols.LossScaleOptimizer(optax.sgd(0.1), loss_scale)
    return _leaves(jax.eval_shape(tx.init, params))

  assert init(ols.DynamicLossScale(**config)) == init(ols.DynamicLossScale())
  assert _leaves(ols.FixedLossScale(2.0)) == _leaves(ols.NoOpLossScale()) == []


def test_loss_scales_are_immutable_and_compare_by_identity():
  loss_scale = ols.DynamicLossScale()
  with pytest.raises(dataclasses.FrozenInstanceError):
    loss_scale.multiplier = 3.0  # type: ignore[misc]
  new, _ = loss_scale.update({"g": jnp.array(jnp.inf)})
  assert float(loss_scale()) == 2.0**15 and float(new()) == 2.0**14
  # As in 0.1.0: by identity, stacked or not, and hashable.
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 2), loss_scale)
  for ls in [loss_scale, stacked, ols.FixedLossScale(2), ols.NoOpLossScale()]:
    assert ls == ls and ls != jax.tree.map(lambda x: x, ls)
    assert {ls: 1}[ls] == 1


def test_a_loss_scale_rebuilds_from_saved_arrays():
  loss_scale = ols.DynamicLossScale(64.0, 10, hysteresis=2)
  for finite in [True, True, False, True]:
    loss_scale, _ = loss_scale.adjust(jnp.array(finite))
  saved = {name: np.asarray(getattr(loss_scale, name)) for name in STATE}
  restored = ols.DynamicLossScale(**loss_scale.get_config(), **saved)
  assert _state(restored) == _state(loss_scale) == (64.0, 1, 1)
  assert _state(restored.adjust(jnp.array(False))[0]) == (32.0, 0, 2)


def test_construction_and_unflattening_never_read_or_check_the_state():
  ls = ols.DynamicLossScale(4.0, 5, hysteresis=2)
  # Out of range, not a number, abstract: unflattening takes any leaves.
  for leaf in [-1, np.float32(np.nan), None, jax.ShapeDtypeStruct((), int)]:
    out = jax.tree.map(lambda x, leaf=leaf: leaf, ls)
    assert isinstance(out, ols.DynamicLossScale) and out.hysteresis == 2
    assert out.num_bad_steps is leaf
  leaves, treedef = jax.tree.flatten(ls)
  negative = [-leaf for leaf in leaves]
  with jax.transfer_guard("disallow"):
    jax.tree.unflatten(treedef, negative)
  with jax.transfer_guard_device_to_host("disallow"):
    ols.DynamicLossScale(current_loss_scale=negative[0])
  # A state built from tracers under `jit` is not checked either; a scale
  # below the floor (or NaN) counts as the floor.
  build = jax.jit(lambda s: ols.DynamicLossScale(current_loss_scale=s)())
  assert float(build(jnp.float32(-1.0))) == 1.0
  assert float(build(jnp.float32(jnp.nan))) == 1.0


def test_steps_build_their_state_without_reading_it():
  ls = ols.DynamicLossScale(4.0, 1, hysteresis=2)
  with jax.transfer_guard_device_to_host("disallow"):
    for grad in [1.0, jnp.nan, jnp.nan]:
      ls, _ = ls.update({"g": jnp.array(grad)})
    ls = ls.lowered()
  assert float(ls()) == 2.0


# --- scale and unscale ------------------------------------------------------


def _tree():
  """One leaf of every kind a gradient tree holds."""
  floats = {
    d.__name__: (jnp.arange(4.0) / 8).astype(d)
    for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64)
  }
  float0 = jax.grad(lambda x, n: x, argnums=(0, 1), allow_int=True)(1.0, 3)[1]
  return floats | {
    "int": jnp.arange(3),
    "bool": jnp.array([True, False]),
    "float0": float0,
    "none": None,
  }


@pytest.mark.parametrize(
  "loss_scale",
  [ols.FixedLossScale(1024), ols.DynamicLossScale(), ols.NoOpLossScale()],
  ids=["fixed", "dynamic", "noop"],
)
def test_scale_and_unscale_keep_every_leaf_s_dtype(loss_scale):
  tree = _tree()
  for fn in (loss_scale.scale, loss_scale.unscale):
    for out in (fn(tree), jax.jit(fn)(tree)):
      assert out["none"] is None
      assert jax.tree.map(lambda x: (x.dtype, x.shape), out) == jax.tree.map(
        lambda x: (x.dtype, x.shape), tree
      )
      for kind in ("int", "bool"):  # passed through unchanged
        np.testing.assert_array_equal(out[kind], tree[kind])
  # A power-of-two scale round-trips exactly.
  round_trip = loss_scale.unscale(loss_scale.scale(tree))
  for kind in ("float16", "bfloat16", "float32", "complex64"):
    np.testing.assert_array_equal(round_trip[kind], tree[kind])
  _, should_apply = loss_scale.update(tree)
  assert bool(should_apply)


def test_unscale_float16_with_a_scale_beyond_float16():
  loss_scale = ols.FixedLossScale(2.0**20)
  grads = jnp.array([2.0**10, 2.0**-4], jnp.float16)
  out = loss_scale.unscale(grads)
  assert out.dtype == jnp.float16
  np.testing.assert_array_equal(out, [2.0**-10, 2.0**-24])


def test_unscale_is_the_same_with_and_without_jit():
  loss_scale = ols.FixedLossScale(3.0)
  x = jax.random.normal(jax.random.key(0), (1000,))
  np.testing.assert_array_equal(
    loss_scale.unscale(x), jax.jit(loss_scale.unscale)(x)
  )
  np.testing.assert_allclose(loss_scale.unscale(x), x / 3.0, rtol=2e-7)


def test_a_scaled_float16_loss_overflows_but_its_gradients_need_not():
  # As in TensorFlow, 42 * 2**15 overflows float16. `scale` is linear: its
  # VJP multiplies the cotangent by the scale, so the backward pass never
  # sees the inf scaled loss.
  loss_scale = ols.FixedLossScale(2**15)

  def scaled_loss(w, ls=loss_scale):
    return ls.scale(jnp.sum(w.astype(jnp.float16)) + jnp.float16(40))

  value, grads = jax.value_and_grad(scaled_loss)(jnp.ones(2))
  assert value.dtype == jnp.float16 and bool(jnp.isinf(value))
  np.testing.assert_array_equal(grads, [2.0**15, 2.0**15])
  assert bool(ols.all_finite(grads))
  # A scale beyond float16's largest value overflows the cotangent itself.
  grads = jax.grad(scaled_loss)(jnp.ones(2), ols.FixedLossScale(2**16))
  assert not bool(ols.all_finite(grads))


def test_a_stored_infinite_scale_counts_as_the_default_ceiling():
  # max_loss_scale=None is float32's maximum: +inf is clamped to it, so that
  # the next overflow lowers the scale (inf / 2 would stay inf for ever).
  ls = ols.DynamicLossScale(current_loss_scale=jnp.float32(np.inf))
  top = np.finfo(np.float32).max
  assert float(jax.jit(lambda ls: ls())(ls)) == top
  lowered, should_apply = jax.jit(lambda ls: ls.adjust(jnp.array(False)))(ls)
  assert not bool(should_apply) and float(lowered()) == top / 2


@pytest.mark.parametrize(
  "loss_scale",
  [ols.DynamicLossScale(), ols.FixedLossScale(8.0), ols.NoOpLossScale()],
)
def test_float_of_a_loss_scale_says_to_call_it(loss_scale):
  with pytest.raises(TypeError, match=r"float\(loss_scale\(\)\)"):
    float(loss_scale)
  assert float(loss_scale()) >= 1.0
