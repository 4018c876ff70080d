"""`optax_lossscale.jmp`: jmp 0.0.4's API and results, with its bugs fixed.

Where jmp is installed (the `bench` extra), results are compared with it; the
rest holds without it. jmp's own algorithm is TensorFlow's, so
`tf_dynamic_loss_scale` is the plain-Python float32 reference.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import pathlib
import pickle
import subprocess
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_lossscale as ols
from optax_lossscale import jmp
from tests.tf_reference import tf_dynamic_loss_scale

F32_MAX = float(np.finfo(np.float32).max)
JMP_NAMES = [
  "all_finite",
  "DynamicLossScale",
  "LossScale",
  "NoOpLossScale",
  "select_tree",
  "StaticLossScale",
  "cast_to_full",
  "cast_to_half",
  "get_policy",
  "half_dtype",
  "Policy",
]


@pytest.fixture
def real_jmp(standard_promotion):
  """DeepMind's jmp (its arithmetic needs JAX's standard promotion)."""
  del standard_promotion
  return pytest.importorskip("jmp")


def _bits(x) -> np.ndarray:
  return np.asarray(x, np.float32).view(np.uint32)


def _steps(seed: int, n: int, p_finite: float = 0.8) -> list[bool]:
  return list(np.random.default_rng(seed).random(n) < p_finite)


def _trace(loss_scale, finite_steps, adjust=None):
  adjust = adjust or (lambda ls, f: ls.adjust(f))
  out = []
  for finite in finite_steps:
    loss_scale = adjust(loss_scale, jnp.bool_(finite))
    out.append((_bits(loss_scale.loss_scale), int(loss_scale.counter)))
  return out, loss_scale


# --- the same API ------------------------------------------------------------


def test_every_public_name_of_jmp_is_here():
  assert set(JMP_NAMES) <= set(jmp.__all__)
  assert all(hasattr(jmp, name) for name in jmp.__all__)
  assert set(jmp.__all__) - set(JMP_NAMES) == {"to_loss_scale"}


def test_signatures_and_defaults_are_jmps():
  params = inspect.signature(jmp.DynamicLossScale).parameters
  assert list(params) == [
    "loss_scale",
    "counter",
    "period",
    "factor",
    "min_loss_scale",
  ]
  assert params["period"].default == 2000 and params["factor"].default == 2
  ls = jmp.DynamicLossScale(jnp.float32(4.0))
  assert ls.counter.dtype == np.int32 and int(ls.counter) == 0
  assert ls.min_loss_scale.dtype == np.float32 and ls.min_loss_scale == 1
  assert list(inspect.signature(jmp.Policy).parameters) == [
    "param_dtype",
    "compute_dtype",
    "output_dtype",
  ]
  assert list(inspect.signature(jmp.StaticLossScale).parameters) == [
    "loss_scale"
  ]


def test_signatures_match_the_installed_jmp(real_jmp):
  assert set(real_jmp.__all__) == set(JMP_NAMES)
  for name in ["DynamicLossScale", "StaticLossScale", "Policy", "get_policy"]:
    ours = inspect.signature(getattr(jmp, name)).parameters
    theirs = inspect.signature(getattr(real_jmp, name)).parameters
    assert list(ours) == list(theirs), name
    for key, param in theirs.items():
      if param.default is not inspect.Parameter.empty:
        assert ours[key].default == param.default, (name, key)


@pytest.mark.slow  # run by `.ci/run` beside the suite
def test_jmps_own_tests_pass_against_this_module(real_jmp, tmp_path):
  # jmp's 97 tests, with only their import line changed, under their own
  # (standard) promotion rather than this suite's strict one.
  source = pathlib.Path(real_jmp.__file__).parent / "_src"
  for module in ["loss_scale", "policy"]:
    text = (source / f"{module}_test.py").read_text()
    line = f"from jmp._src import {module} as jmp\n"
    assert line in text
    ours = text.replace(line, "from optax_lossscale import jmp\n")
    (tmp_path / f"{module}_test.py").write_text(ours)
  root = pathlib.Path(__file__).resolve().parent.parent
  result = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."],
    cwd=tmp_path,
    env=dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  assert "97 passed" in result.stdout.splitlines()[-1], result.stdout


def test_the_module_does_not_import_jmp():
  package = pathlib.Path(ols.__file__).parent
  for path in package.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        assert all(a.name.split(".")[0] != "jmp" for a in node.names), path
      if isinstance(node, ast.ImportFrom):
        assert (node.module or "").split(".")[0] != "jmp", path


# --- results: jmp's, bit for bit ----------------------------------------------


@pytest.mark.parametrize("period, factor", [(1, 2), (3, 2), (4, 3), (5, 1.5)])
def test_scales_and_counters_follow_jmps_algorithm_bit_for_bit(period, factor):
  steps = _steps(period, 60)
  ref = tf_dynamic_loss_scale(steps, 1000.0, period, factor, 1.0)
  expected = [(_bits(s), good) for s, good, _ in ref]
  start = jmp.DynamicLossScale(
    jnp.float32(1000.0), period=period, factor=factor
  )
  eager, _ = _trace(start, steps)
  jitted, _ = _trace(start, steps, jax.jit(lambda ls, f: ls.adjust(f)))
  assert eager == expected
  assert jitted == expected

  def body(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.counter)

  _, (scales, counters) = lax.scan(body, start, jnp.array(steps))
  assert [
    (_bits(s), int(c)) for s, c in zip(scales, counters, strict=True)
  ] == expected


@pytest.mark.parametrize("factor", [2, 3, 10])
def test_scales_equal_the_installed_jmps_eager_ones(real_jmp, factor):
  steps = _steps(factor, 40, 0.6)
  kwargs = dict(period=3, factor=factor, min_loss_scale=np.float32(0.5))
  theirs, _ = _trace(
    real_jmp.DynamicLossScale(jnp.float32(77.0), **kwargs), steps
  )
  ours, _ = _trace(jmp.DynamicLossScale(jnp.float32(77.0), **kwargs), steps)
  jitted, _ = _trace(
    jmp.DynamicLossScale(jnp.float32(77.0), **kwargs),
    steps,
    jax.jit(lambda ls, f: ls.adjust(f)),
  )
  assert ours == theirs and jitted == theirs


@pytest.mark.parametrize("factor", [3, 10])
def test_backoff_is_exact_under_jit_where_jmps_is_not(real_jmp, factor):
  # XLA turns jmp's division by a constant into a multiply by its reciprocal.
  start = np.float32(40974.484)
  theirs = real_jmp.DynamicLossScale(jnp.asarray(start), factor=factor)
  eager = theirs.adjust(jnp.bool_(False)).loss_scale
  jitted = jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))(theirs).loss_scale
  assert _bits(eager) != _bits(jitted)  # jmp's bug
  ours = jmp.DynamicLossScale(jnp.asarray(start), factor=factor)
  ours_jit = jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))(ours).loss_scale
  assert _bits(ours_jit) == _bits(eager) == _bits(start / np.float32(factor))


@pytest.mark.parametrize(
  "loss_scale, counter, period, factor, min_loss_scale",
  [
    (2.0**15, np.zeros([], np.int32), 2000, 2, np.ones([], np.float32)),
    (jnp.asarray(10.0), jnp.int32(0), 5.0, 2.0, jnp.asarray(0.0)),
    (jnp.float32(10.0), jnp.int32(2), 3, 3, 0.5),
    (np.float32(10.0), np.int32(0), 2, 2, np.float32(1.0)),
  ],
)
def test_dtypes_and_weak_types_are_jmps(
  real_jmp, loss_scale, counter, period, factor, min_loss_scale
):
  args = (loss_scale, counter, period, factor, min_loss_scale)
  for finite in [True, False]:
    theirs = real_jmp.DynamicLossScale(*args).adjust(jnp.bool_(finite))
    ours = jmp.DynamicLossScale(*args).adjust(jnp.bool_(finite))
    for a, b in [
      (ours.loss_scale, theirs.loss_scale),
      (ours.counter, theirs.counter),
    ]:
      assert jax.typeof(a) == jax.typeof(b)
      assert _bits(a) == _bits(b)


def test_growth_stops_below_infinity():
  big = np.float32(2.0**126)
  ls = jmp.DynamicLossScale(jnp.asarray(big), period=1, factor=3)
  ls = ls.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))  # 9 * 2**126: inf
  assert float(ls.loss_scale) == 3 * 2.0**126 and int(ls.counter) == 0
  ls = jmp.DynamicLossScale(jnp.asarray(big), period=1)
  ls = ls.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
  assert float(ls.loss_scale) == 2.0**127


def test_float16_scale_adjusts_and_stays_float16():
  # jmp's float32 default floor makes its `lax.select` fail on float16.
  ls = jmp.DynamicLossScale(jnp.float16(10.0), period=2)
  for finite in [False, True, True]:
    ls = ls.adjust(jnp.bool_(finite))
    assert ls.loss_scale.dtype == jnp.float16
  assert float(ls.loss_scale) == 10.0


def test_adjust_works_under_strict_dtype_promotion():
  # tests/conftest.py sets "strict"; jmp raises on `counter * grads_finite`.
  assert jax.config.jax_numpy_dtype_promotion == "strict"
  ls = jmp.DynamicLossScale(jnp.float32(8.0), period=1).adjust(jnp.bool_(True))
  assert float(ls.loss_scale) == 16.0 and ls.counter.dtype == jnp.int32


def test_adjust_is_one_trace_per_structure():
  traces = []

  @jax.jit
  def step(ls, finite):
    traces.append(1)
    return ls.adjust(finite)

  ls = jmp.DynamicLossScale(jnp.float32(8.0), min_loss_scale=np.float32(0.5))
  for finite in [True, False, True]:
    ls = step(ls, jnp.bool_(finite))
  assert len(traces) == 1


# --- pytrees ------------------------------------------------------------------


def test_pytree_layout_is_jmps():
  scale, counter = jnp.float32(4.0), jnp.int32(3)
  ls = jmp.DynamicLossScale(scale, counter, 10, 3, np.float32(0.5))
  assert jax.tree.leaves(ls) == [scale, counter]
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
  assert paths == [
    (jax.tree_util.FlattenedIndexKey(0),),
    (jax.tree_util.FlattenedIndexKey(1),),
  ]
  assert jax.tree.leaves(jmp.NoOpLossScale()) == []
  assert jax.tree.leaves(jmp.StaticLossScale(2.0)) == []
  assert jax.tree.map(lambda x: x, ls) == ls


def test_key_paths_match_the_installed_jmp(real_jmp):
  args = (jnp.float32(4.0), jnp.int32(3))
  ours = jax.tree_util.tree_flatten_with_path(jmp.DynamicLossScale(*args))
  theirs = jax.tree_util.tree_flatten_with_path(
    real_jmp.DynamicLossScale(*args)
  )
  assert [p for p, _ in ours[0]] == [p for p, _ in theirs[0]]


def _hyperparameters(ls):
  return ls.period, ls.factor, float(ls.min_loss_scale)


def test_every_field_survives_tree_map_jit_scan_and_unflatten():
  ls = jmp.DynamicLossScale(
    jnp.float32(4.0), jnp.int32(1), 7, 3, np.float32(0.25)
  )
  expected = (7, 3, 0.25)
  assert _hyperparameters(jax.tree.map(lambda x: x, ls)) == expected
  leaves, treedef = jax.tree.flatten(ls)
  assert _hyperparameters(jax.tree.unflatten(treedef, leaves)) == expected
  assert _hyperparameters(jax.jit(lambda x: x)(ls)) == expected
  carried, _ = lax.scan(
    lambda c, _: (c.adjust(jnp.bool_(False)), None), ls, None, length=3
  )
  assert _hyperparameters(carried) == expected
  assert (
    _hyperparameters(jax.vmap(lambda x: x)(jax.tree.map(lambda x: x[None], ls)))
    == expected
  )


def test_a_floor_below_one_is_kept_under_jit_and_scan():
  ls = jmp.DynamicLossScale(jnp.float32(2.0), min_loss_scale=np.float32(0.25))

  def body(ls, finite):
    ls = ls.adjust(finite)
    return ls, ls.loss_scale

  _, scales = jax.jit(lambda ls: lax.scan(body, ls, jnp.zeros(4, bool)))(ls)
  np.testing.assert_array_equal(scales, [1.0, 0.5, 0.25, 0.25])
  step = jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))
  for _ in range(4):
    ls = step(ls)
  assert float(ls.loss_scale) == 0.25


def test_jmp_itself_loses_the_floor_under_scan(real_jmp):
  ls = real_jmp.DynamicLossScale(
    jnp.float32(2.0), min_loss_scale=np.float32(0.25)
  )
  _, scales = lax.scan(
    lambda ls, f: (ls.adjust(f), ls.adjust(f).loss_scale),
    ls,
    jnp.zeros(3, bool),
  )
  np.testing.assert_array_equal(scales, [1.0, 1.0, 1.0])  # jmp #44


def test_lowers_ahead_of_time_and_maps_to_placeholders():
  # jmp's `__post_init__` fails on `lower`'s placeholders and on None leaves.
  ls = jmp.DynamicLossScale(jnp.float32(8.0))
  step = jax.jit(lambda ls, g: ls.adjust(jmp.all_finite(g)))
  compiled = step.lower(ls, jnp.ones(3)).compile()
  assert float(compiled(ls, jnp.ones(3)).counter) == 1
  assert jax.tree.map(lambda x: None, ls).loss_scale is None
  shapes = jax.eval_shape(lambda ls: ls.adjust(jnp.bool_(True)), ls)
  assert shapes.loss_scale.dtype == jnp.float32


def _floor_under_jit(jmp, scale):
  return jax.jit(lambda x: jmp.DynamicLossScale(x, min_loss_scale=x / 2))(scale)


def test_a_floor_built_under_jit_is_a_leaf_and_is_kept(real_jmp):
  ls = _floor_under_jit(jmp, jnp.float32(8.0))
  assert jax.tree.leaves(ls) == [8.0, 0, 4.0]
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
  assert paths == [(jax.tree_util.FlattenedIndexKey(i),) for i in range(3)]
  step = jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))
  theirs = _floor_under_jit(real_jmp, jnp.float32(8.0))  # jmp accepts it ...
  for _ in range(3):
    ls, theirs = step(ls), step(theirs)
  assert float(ls.loss_scale) == 4.0 and float(ls.min_loss_scale) == 4.0
  assert float(theirs.loss_scale) == 1.0  # ... and loses it
  carried, scales = lax.scan(
    lambda c, f: (c.adjust(f), c.adjust(f).loss_scale),
    _floor_under_jit(jmp, jnp.float32(16.0)),
    jnp.zeros(3, bool),
  )
  np.testing.assert_array_equal(scales, [8.0, 8.0, 8.0])
  assert jax.tree.structure(carried) == jax.tree.structure(ls)


def test_a_floor_built_under_pmap_is_replicated_with_the_state():
  # Haiku's ImageNet example builds its train state with `pmap(initial_state)`.
  n = jax.local_device_count()
  ls = jax.pmap(lambda x: jmp.DynamicLossScale(x, min_loss_scale=x / 4))(
    jnp.full((n,), 8.0, jnp.float32)
  )
  assert ls.min_loss_scale.shape == (n,)
  step = jax.pmap(lambda ls: ls.adjust(jnp.bool_(False)))
  for _ in range(4):
    ls = step(ls)
  np.testing.assert_array_equal(ls.loss_scale, np.full(n, 2.0, np.float32))
  np.testing.assert_array_equal(ls.min_loss_scale, np.full(n, 2.0, np.float32))
  new = jmp.to_loss_scale(jax.tree.map(lambda x: x[0], ls))
  assert float(new()) == 2.0 and new.min_loss_scale == 2.0


def test_a_numpy_or_python_floor_keeps_jmps_two_leaves():
  for floor in [np.float32(0.5), 0.5, np.ones([], np.float32)]:
    ls = jmp.DynamicLossScale(jnp.float32(2.0), min_loss_scale=floor)
    assert len(jax.tree.leaves(ls)) == 2
  array_floor = jmp.DynamicLossScale(
    jnp.float32(2.0), min_loss_scale=jnp.float32(0.5)
  )
  assert len(jax.tree.leaves(array_floor)) == 3


def test_a_floor_leaf_stays_a_leaf_whatever_it_holds():
  # Placeholders, restored NumPy arrays and abstract targets keep the layout.
  ls = _floor_under_jit(jmp, jnp.float32(8.0))
  for mapped in [
    jax.tree.map(lambda x: None, ls),
    jax.tree.map(np.asarray, ls),
    jax.tree.map(lambda x: object(), ls),
    jax.eval_shape(lambda: ls),
  ]:
    structure = jax.tree.structure(mapped, is_leaf=lambda x: x is None)
    assert structure == jax.tree.structure(ls)
  abstract = jax.eval_shape(lambda: ls)
  step = jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))
  assert float(step.lower(abstract).compile()(ls).min_loss_scale) == 4.0


def test_orbax_saves_and_restores_every_field(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  ls = jmp.DynamicLossScale(
    jnp.float32(2.0**13), jnp.int32(5), 10, 2, np.float32(0.5)
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "ckpt", {"loss_scale": ls})
    target = {
      "loss_scale": jmp.DynamicLossScale(
        jnp.float32(1.0), jnp.int32(0), 10, 2, np.float32(0.5)
      )
    }
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(tmp_path / "ckpt", target)["loss_scale"]
  assert float(restored.loss_scale) == 2.0**13 and int(restored.counter) == 5
  assert _hyperparameters(restored) == (10, 2, 0.5)


def test_orbax_restores_a_floor_leaf_into_an_abstract_target(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  ls = _floor_under_jit(jmp, jnp.float32(2.0**13)).adjust(jnp.bool_(False))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "ckpt", ls)
    # The target built as the state was, abstractly.
    target = jax.eval_shape(lambda: _floor_under_jit(jmp, jnp.float32(1.0)))
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(tmp_path / "ckpt", target)
  assert jax.tree.structure(restored) == jax.tree.structure(ls)
  assert float(restored.loss_scale) == 2.0**12
  assert float(restored.min_loss_scale) == 2.0**12


def test_static_hyperparameters_must_be_concrete():
  for name in ["period", "factor"]:
    with pytest.raises(TypeError, match=rf"DynamicLossScale\({name}=...\)"):
      jax.jit(
        lambda v, name=name: jmp.DynamicLossScale(jnp.float32(2.0), **{name: v})
      )(jnp.float32(2.0))
  with pytest.raises(
    ValueError, match=r"period=...\)` must be positive, got 0"
  ):
    jmp.DynamicLossScale(jnp.float32(2.0), period=0)
  with pytest.raises(ValueError, match="factor"):
    jmp.DynamicLossScale(jnp.float32(2.0), factor=-2)


# --- warnings and errors ------------------------------------------------------


def test_non_floating_scales_warn_as_in_jmp():
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
    jmp.DynamicLossScale(jnp.asarray(1, jnp.int32))
  with pytest.warns(
    UserWarning, match="Expected floating type for min_loss_scale"
  ):
    jmp.DynamicLossScale(
      jnp.float32(1.0), min_loss_scale=jnp.asarray(1, jnp.int32)
    )
  with pytest.warns(UserWarning, match="got int32"):
    jmp.DynamicLossScale(2)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jmp.DynamicLossScale(2.0**15)
    jmp.DynamicLossScale(None)
    jmp.DynamicLossScale(object())


def test_adjust_refuses_a_non_scalar():
  with pytest.raises(AssertionError, match="Expected boolean scalar"):
    jmp.DynamicLossScale(jnp.float32(2.0)).adjust(jnp.ones(2, bool))


@pytest.mark.parametrize(
  "pred", [jnp.ones([1], bool), jnp.float32(1.0), jnp.int32(1), 1, "yes"]
)
def test_select_tree_refuses_what_is_not_a_boolean_scalar(pred):
  with pytest.raises(AssertionError, match="expected boolean scalar"):
    jmp.select_tree(pred, None, None)


# --- select_tree ----------------------------------------------------------------


def test_select_tree_gives_jmps_values():
  a = {"a": jnp.ones([]), "b": jnp.zeros([3], jnp.float16), "c": np.arange(2)}
  b = {
    "a": jnp.zeros([]),
    "b": jnp.ones([3], jnp.float16),
    "c": np.arange(2) + 5,
  }
  assert jmp.select_tree(jnp.bool_(True), None, None) is None
  chex.assert_trees_all_equal(jmp.select_tree(jnp.bool_(True), a, b), a)
  chex.assert_trees_all_equal(jmp.select_tree(False, a, b), b)
  chex.assert_trees_all_equal(
    jax.jit(jmp.select_tree)(jnp.bool_(False), a, b), b
  )


def test_select_tree_matches_the_installed_jmp_in_dtype_and_weak_type(real_jmp):
  cases = [(jnp.float32(1.0), 2.0), (1.0, 2.0), (np.float32(1.0), 2.0), (1, 2)]
  cases += [(np.ones(2, np.float16), np.zeros(2, np.float16))]
  for pred in [True, False]:
    for a, b in cases:
      theirs = real_jmp.select_tree(jnp.bool_(pred), a, b)
      ours = jmp.select_tree(jnp.bool_(pred), a, b)
      assert jax.typeof(ours) == jax.typeof(theirs)
      np.testing.assert_array_equal(ours, theirs)


def test_select_tree_needs_no_more_memory_than_jmps_donated(real_jmp):
  # jmp's README step: the update, then `select_tree(all_finite(grads), new,
  # old)`, parameters and state donated. Ours takes no more temporary memory
  # than jmp's (a `lax.cond` over two materialised trees took more).
  params = {f"w{i}": jnp.ones((128, 128)) for i in range(4)}
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  for tx in [optax.sgd(0.1), optax.adam(1e-3)]:
    temp = []
    for select_tree in [jmp.select_tree, real_jmp.select_tree]:

      def step(params, opt_state, grads, select_tree=select_tree, tx=tx):
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jmp.all_finite(grads)
        return select_tree(
          finite, (new_params, new_opt_state), (params, opt_state)
        )

      lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, tx.init(params), grads
      )
      temp.append(lowered.compile().memory_analysis().temp_size_in_bytes)
    assert temp[0] <= temp[1], temp


def test_select_tree_under_a_batched_predicate_selects():
  pred = jnp.array([True, False, True])
  a, b = {"w": jnp.ones((3, 2))}, {"w": jnp.zeros((3, 2))}
  out = jax.vmap(jmp.select_tree)(pred, a, b)
  np.testing.assert_array_equal(out["w"], [[1, 1], [0, 0], [1, 1]])
  out = jax.vmap(jmp.select_tree, in_axes=(0, None, None))(
    pred, a["w"][0], b["w"][0]
  )
  np.testing.assert_array_equal(out, [[1, 1], [0, 0], [1, 1]])


def test_select_tree_differentiates_like_a_select():
  grad = jax.grad(
    lambda a, b: jnp.sum(jmp.select_tree(jnp.bool_(False), a, b) * 3.0),
    argnums=(0, 1),
  )
  ga, gb = grad(jnp.ones(2), jnp.ones(2))
  np.testing.assert_array_equal(ga, [0, 0])
  np.testing.assert_array_equal(gb, [3, 3])


# --- all_finite -------------------------------------------------------------------


@pytest.mark.parametrize("non_finite", [jnp.inf, -jnp.inf, jnp.nan])
def test_all_finite_gives_jmps_results(non_finite):
  assert bool(jmp.all_finite(None)) and bool(jmp.all_finite({}))
  assert not bool(jmp.all_finite({"a": jnp.array(non_finite)}))
  assert not bool(
    jmp.all_finite({"a": jnp.ones([]), "b": jnp.array(non_finite)})
  )
  assert not bool(jmp.all_finite([jnp.ones(3, jnp.float16), non_finite]))
  assert bool(jmp.all_finite({"a": jnp.ones([]), "i": jnp.arange(3)}))
  assert (
    jmp.all_finite({}).dtype == jnp.bool_ and jmp.all_finite({}).shape == ()
  )


def test_all_finite_agrees_with_the_installed_jmp(real_jmp):
  trees = [None, {}, [jnp.ones(3)], [jnp.ones(3), jnp.float16(jnp.inf)]]
  trees += [{"a": jnp.array([1.0, jnp.nan]), "i": jnp.arange(2)}, [2.0, 3]]
  for tree in trees:
    assert bool(jmp.all_finite(tree)) == bool(real_jmp.all_finite(tree))


# --- the loss scales' scale and unscale -------------------------------------------


def test_scale_and_unscale_are_jmps(real_jmp):
  tree = {"a": jnp.array([3.0, 0.1]), "h": jnp.array([2.0], jnp.float16)}
  for cls, scale in [
    ("StaticLossScale", 3),
    ("DynamicLossScale", jnp.float32(3.0)),
  ]:
    for method in ["scale", "unscale"]:
      theirs = getattr(getattr(real_jmp, cls)(scale), method)(tree)
      ours = getattr(getattr(jmp, cls)(scale), method)(tree)
      chex.assert_trees_all_equal(ours, theirs)
      chex.assert_trees_all_equal_dtypes(ours, theirs)
  assert jmp.NoOpLossScale().scale(tree) is tree
  assert jmp.NoOpLossScale().unscale(tree) is tree
  assert jmp.NoOpLossScale().adjust(jnp.bool_(False)) == jmp.NoOpLossScale()
  static = jmp.StaticLossScale(2.0)
  assert static.adjust(jnp.bool_(False)) is static
  assert isinstance(static, jmp.LossScale)


# --- policies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "name, expected",
  [
    ("p=f32,c=f16,o=f32", "p=full,c=f16,o=full"),
    ("params=float32,compute=bfloat16,output=full", "p=full,c=bf16,o=full"),
    ("half", "p=f16,c=f16,o=f16"),
    ("c=bf16", "p=full,c=bf16,o=bf16"),
    ("p=f16", "p=f16,c=f16,o=f16"),
    ("p=bf16,c=f32", "p=bf16,c=full,o=full"),
    ("c=f16,o=full", "p=full,c=f16,o=full"),
    ("float64", "p=f64,c=f64,o=f64"),
    ("f32", "p=full,c=full,o=full"),
  ],
)
def test_get_policy_grammar_and_str(name, expected):
  policy = jmp.get_policy(name)
  assert str(policy) == expected
  assert jmp.get_policy(str(policy)) == policy


def test_get_policy_returns_jmps_dtype_objects(real_jmp):
  for name in ["p=f32,c=f16,o=f32", "half", "c=bf16", "o=f64", "full"]:
    ours, theirs = jmp.get_policy(name), real_jmp.get_policy(name)
    assert ours.param_dtype is theirs.param_dtype
    assert ours.compute_dtype is theirs.compute_dtype
    assert ours.output_dtype is theirs.output_dtype
    assert str(ours) == str(theirs)


@pytest.mark.parametrize(
  "name, error, match",
  [
    ("compute_float16", ValueError, "Unknown dtype 'compute_float16'"),
    ("p=f32,x=f16", ValueError, "Unknown key 'x'"),
    ("p=f32=f16", ValueError, "one key=dtype pair"),
    ("p=f32,f16", ValueError, "'f16' in 'p=f32,f16'"),
    ("c=f8", ValueError, "Unknown dtype 'f8'"),
    (None, TypeError, "policy_name"),
  ],
)
def test_get_policy_errors(name, error, match):
  with pytest.raises(error, match=match):
    jmp.get_policy(name)


def test_str_takes_dtype_objects_and_any_dtype():
  policy = jmp.Policy(
    jnp.dtype("float32"), jnp.zeros(1, jnp.float16).dtype, np.dtype("float32")
  )
  assert str(policy) == "p=full,c=f16,o=full"  # a KeyError in jmp
  assert (
    str(jmp.Policy(jnp.float32, jnp.int8, jnp.float32))
    == "p=full,c=int8,o=full"
  )


def test_only_floating_numpy_and_jax_arrays_are_cast():
  policy = jmp.get_policy("p=f32,c=f16,o=bf16")
  marker = object()
  tree = {
    "jax": jnp.ones(2),
    "np": np.ones(2, np.float64),
    "half": jnp.ones(2, jnp.bfloat16),
    "int": jnp.arange(2),
    "np_int": np.arange(2),
    "py": 1.5,
    "np_scalar": np.float32(1.5),
    "obj": marker,
    "none": None,
  }
  out = policy.cast_to_compute(tree)
  assert out["jax"].dtype == out["np"].dtype == out["half"].dtype == jnp.float16
  assert isinstance(out["np"], np.ndarray)
  assert out["int"] is tree["int"] and out["np_int"] is tree["np_int"]
  assert out["py"] is tree["py"] and out["np_scalar"] is tree["np_scalar"]
  assert out["obj"] is marker and out["none"] is None
  assert policy.cast_to_output(tree)["jax"].dtype == jnp.bfloat16
  assert policy.cast_to_param(out)["half"].dtype == jnp.float32
  traced = jax.jit(policy.cast_to_compute)(jnp.ones(2))
  assert traced.dtype == jnp.float16


def test_with_output_dtype_and_the_half_helpers():
  policy = jmp.get_policy("p=f32,c=f16,o=f16").with_output_dtype(jnp.float32)
  assert str(policy) == "p=full,c=f16,o=full"
  assert jmp.half_dtype() is (
    jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16
  )
  tree = [jnp.ones(1, jmp.half_dtype()), jnp.ones(1), jnp.arange(1)]
  assert [x.dtype for x in jmp.cast_to_full(tree)] == [
    "float32",
    "float32",
    "int32",
  ]
  half = jnp.dtype(jmp.half_dtype())
  assert [x.dtype for x in jmp.cast_to_half(tree)] == [half, half, "int32"]


def test_policy_is_hashable_and_frozen():
  policy = jmp.get_policy("c=f16")
  assert {policy: 1}[jmp.Policy(jnp.float32, jnp.float16, jnp.float16)] == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.param_dtype = jnp.float16  # type: ignore[misc]


# --- to_loss_scale --------------------------------------------------------------------


def _ols_trace(loss_scale, finite_steps):
  out = []
  for finite in finite_steps:
    loss_scale, _ = loss_scale.adjust(jnp.bool_(finite))
    out.append((_bits(loss_scale()), int(loss_scale.num_good_steps)))
  return out


@pytest.mark.parametrize(
  "start, counter, period, factor, floor",
  [
    (2.0**15, 0, 4, 2, 1.0),
    (1000.0, 2, 3, 3, 0.5),
    (2.0**125, 1, 2, 2, 1.0),  # at the top: growth stops below infinity
    (7.0, 0, 1, 10, 0.01),
    (3.0, 4, 5, 1.5, 3.0),
  ],
)
def test_to_loss_scale_continues_with_the_same_scales(
  start, counter, period, factor, floor
):
  old = jmp.DynamicLossScale(
    jnp.float32(start), jnp.int32(counter), period, factor, np.float32(floor)
  )
  new = jmp.to_loss_scale(old)
  assert isinstance(new, ols.DynamicLossScale)
  assert _bits(new()) == _bits(start)
  assert int(new.num_good_steps) == counter
  assert new.increment_period == period and new.multiplier == factor
  assert new.min_loss_scale == np.float32(floor) and new.max_loss_scale is None
  steps = _steps(int(start) % 97 + period, 80, 0.7)
  expected, _ = _trace(old, steps)
  assert _ols_trace(new, steps) == expected


def test_to_loss_scale_reads_restored_arrays_and_jmps_own_classes(real_jmp):
  restored = jmp.DynamicLossScale(
    np.asarray(64.0, np.float32), np.asarray(3), 5.0, 2.0
  )
  new = jmp.to_loss_scale(restored)
  assert float(new()) == 64.0 and int(new.num_good_steps) == 3
  assert new.increment_period == 5 and new.num_good_steps.dtype == jnp.int32
  # A float period makes jmp's counter a float.
  counted = jmp.DynamicLossScale(jnp.float32(2.0), jnp.int32(0), 5.0).adjust(
    jnp.bool_(True)
  )
  assert counted.counter.dtype == jnp.float32
  assert int(jmp.to_loss_scale(counted).num_good_steps) == 1
  theirs = real_jmp.DynamicLossScale(jnp.float32(32.0), jnp.int32(4), 6, 3)
  new = jmp.to_loss_scale(theirs)
  assert float(new()) == 32.0 and int(new.num_good_steps) == 4
  assert new.increment_period == 6 and new.multiplier == 3
  assert isinstance(
    jmp.to_loss_scale(real_jmp.StaticLossScale(8)), ols.FixedLossScale
  )
  assert isinstance(
    jmp.to_loss_scale(real_jmp.NoOpLossScale()), ols.NoOpLossScale
  )


def test_to_loss_scale_reads_half_precision_scales_exactly():
  for dtype in [jnp.float16, jnp.bfloat16]:
    old = jmp.DynamicLossScale(jnp.asarray(1.5 * 2**10, dtype), jnp.int32(1))
    assert float(jmp.to_loss_scale(old)()) == 1.5 * 2**10


def test_to_loss_scale_of_static_and_no_op():
  fixed = jmp.to_loss_scale(jmp.StaticLossScale(jnp.float32(128.0)))
  assert isinstance(fixed, ols.FixedLossScale) and fixed.loss_scale_value == 128
  assert isinstance(jmp.to_loss_scale(jmp.NoOpLossScale()), ols.NoOpLossScale)


@pytest.mark.parametrize(
  "loss_scale, match",
  [
    (jmp.DynamicLossScale(jnp.float32(0.5)), "below its min_loss_scale"),
    (
      jmp.DynamicLossScale(jnp.float32(4.0), jnp.int32(5), 5),
      r"counter .* \[0, period=5\)",
    ),
    (jmp.DynamicLossScale(jnp.float32(4.0), jnp.int32(-1)), "counter"),
    (jmp.DynamicLossScale(jnp.float32(4.0), period=2.5), "period"),
    (
      jmp.DynamicLossScale(jnp.float32(4.0), factor=1),
      "factor must be greater than 1",
    ),
    (
      jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=np.float32(0)),
      "min_loss_scale must be greater than 0",
    ),
    (jmp.DynamicLossScale(jnp.float32(jnp.inf)), "loss_scale.loss_scale"),
    (jmp.DynamicLossScale(jnp.float32(jnp.nan)), "loss_scale.loss_scale"),
    (jmp.StaticLossScale(0.5), "at least 1"),
  ],
)
def test_to_loss_scale_refuses_states_without_an_equivalent(loss_scale, match):
  with pytest.raises(ValueError, match=match):
    jmp.to_loss_scale(loss_scale)


def test_to_loss_scale_refuses_other_types_naming_the_argument():
  for bad in [ols.DynamicLossScale(), {"loss_scale": 1.0}, None, 2.0]:
    with pytest.raises(TypeError, match=r"to_loss_scale\(loss_scale=...\)"):
      jmp.to_loss_scale(bad)
  with pytest.raises(TypeError, match="loss_scale.counter"):
    jmp.to_loss_scale(jmp.DynamicLossScale(jnp.float32(2.0), "0"))
  with pytest.raises(TypeError, match="traced"):
    jax.jit(jmp.to_loss_scale)(jmp.DynamicLossScale(jnp.float32(2.0)))


def test_to_loss_scale_takes_one_replica_of_a_pmap_state(real_jmp):
  n = jax.local_device_count()
  for module in [jmp, real_jmp]:
    replicated = jax.pmap(
      lambda s, module=module: module.DynamicLossScale(s, period=10).adjust(
        jnp.bool_(True)
      )
    )(jnp.full((n,), 2.0**12, jnp.float32))
    with pytest.raises(ValueError, match=r"jax.tree.map\(lambda x: x\[0\]"):
      jmp.to_loss_scale(replicated)
    new = jmp.to_loss_scale(jax.tree.map(lambda x: x[0], replicated))
    assert float(new()) == 2.0**12 and int(new.num_good_steps) == 1
    assert new.increment_period == 10


def test_a_pickled_jmp_state_carries_over_by_unflattening(real_jmp):
  # A training state pickled with jmp (unpickling needs jmp installed): its
  # leaves go into a template built with this module, in jmp's leaf order.
  old = real_jmp.DynamicLossScale(jnp.float32(2.0**10), jnp.int32(0), 3, 2)
  for finite in [True, True, False, True]:
    old = old.adjust(jnp.bool_(finite))
  pickled = pickle.dumps({"step": np.int32(4), "loss_scale": old})
  restored = pickle.loads(pickled)
  assert type(restored["loss_scale"]) is real_jmp.DynamicLossScale
  template = {
    "step": np.int32(0),
    "loss_scale": jmp.DynamicLossScale(jnp.float32(1.0), period=3, factor=2),
  }
  state = jax.tree.unflatten(
    jax.tree.structure(template), jax.tree.leaves(restored)
  )
  ours = state["loss_scale"]
  assert type(ours) is jmp.DynamicLossScale and int(state["step"]) == 4
  assert _bits(ours.loss_scale) == _bits(old.loss_scale)
  assert int(ours.counter) == int(old.counter) == 1
  steps = _steps(5, 30)
  assert _trace(ours, steps)[0] == _trace(old, steps)[0]


# --- a jmp training program, swapped and ported -------------------------------------------

X = jax.random.normal(jax.random.key(0), (64, 8))
Y = jnp.sin(X @ jnp.linspace(-1.0, 1.0, 8)[:, None])
STEPS = 40


def _init_params():
  k1, k2 = jax.random.split(jax.random.key(1))
  return {
    "w1": jax.random.normal(k1, (8, 32)) * 0.5,
    "b1": jnp.zeros(32),
    "w2": jax.random.normal(k2, (32, 1)) * 0.5,
    "b2": jnp.zeros(1),
  }


def _loss_fn(policy, params, x, y):
  p, x = policy.cast_to_compute((params, x))
  h = jnp.tanh(x @ p["w1"] + p["b1"][None, :])
  out = policy.cast_to_output(h @ p["w2"] + p["b2"][None, :])
  return jnp.mean((out - y) ** 2)


def _optimizer():
  return optax.sgd(0.05, momentum=0.9)


@functools.cache
def _jmp_train_step(jmp):
  """jmp's README train step, compiled once per module for these tests."""
  policy = jmp.get_policy("p=f32,c=f16,o=f32")
  opt = _optimizer()

  @jax.jit
  def train_step(params, opt_state, loss_scale, x, y):
    def scaled_loss(params):
      return loss_scale.scale(_loss_fn(policy, params, x, y))

    grads = jax.grad(scaled_loss)(params)
    grads = policy.cast_to_param(grads)
    grads = loss_scale.unscale(grads)
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    updates, new_opt_state = opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = jmp.select_tree(grads_finite, new_params, params)
    opt_state = jmp.select_tree(grads_finite, new_opt_state, opt_state)
    return params, opt_state, loss_scale

  return train_step


def _jmp_run(jmp, steps, params=None, opt_state=None, loss_scale=None):
  """A complete jmp training program, as jmp's README writes it."""
  if params is None:
    params = jmp.get_policy("p=f32,c=f16,o=f32").cast_to_param(_init_params())
    opt_state = _optimizer().init(params)
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**24), period=5)
  train_step = _jmp_train_step(jmp)
  scales = []
  for _ in range(steps):
    params, opt_state, loss_scale = train_step(
      params, opt_state, loss_scale, X, Y
    )
    scales.append(float(loss_scale.loss_scale))
  return params, opt_state, loss_scale, scales


def _ported_run(tx, params, opt_state, steps):
  """The same program on `LossScaleOptimizer`."""
  policy = jmp.get_policy("p=f32,c=f16,o=f32")

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss_fn = lambda p: _loss_fn(policy, p, x, y)  # noqa: E731
    _, grads = ols.scaled_value_and_grad(loss_fn)(opt_state, params)
    return tx.apply_gradients(grads, opt_state, params)

  scales = []
  for _ in range(steps):
    params, opt_state = train_step(params, opt_state, X, Y)
    scales.append(float(opt_state.loss_scale()))
  return params, opt_state, scales


@pytest.mark.slow  # run by `.ci/run` beside the suite
def test_a_jmp_program_reaches_the_same_parameters_swapped_and_ported(
  standard_promotion,
):
  del standard_promotion  # optax's momentum
  params, _, _, scales = _jmp_run(jmp, STEPS)
  tx = ols.LossScaleOptimizer(_optimizer(), ols.DynamicLossScale(2.0**24, 5))
  start = _init_params()
  ported, state, ported_scales = _ported_run(tx, start, tx.init(start), STEPS)
  assert int(state.skipped_steps) > 0 and scales == ported_scales
  assert scales[-1] < 2.0**24
  chex.assert_trees_all_close(params, ported, rtol=1e-6, atol=1e-7)
  full = jmp.get_policy("full")
  assert _loss_fn(full, params, X, Y) < _loss_fn(full, start, X, Y)


def test_a_jmp_run_resumes_under_loss_scale_optimizer(standard_promotion):
  del standard_promotion
  params, opt_state, loss_scale, scales = _jmp_run(jmp, STEPS // 2)
  # The checkpoint: jmp's arrays, as a restore gives them back.
  loss_scale = jax.tree.map(np.asarray, loss_scale)
  tx = ols.LossScaleOptimizer(_optimizer(), jmp.to_loss_scale(loss_scale))
  state = tx.init(params)._replace(inner_state=opt_state)
  resumed, state, more = _ported_run(tx, params, state, STEPS - STEPS // 2)
  expected, _, _, all_scales = _jmp_run(jmp, STEPS)
  assert scales + more == all_scales
  assert len(set(more)) > 1  # the scale moves after the resume
  chex.assert_trees_all_close(resumed, expected, rtol=1e-6, atol=1e-7)


def test_the_program_matches_the_installed_jmp(real_jmp):
  params, _, _, scales = _jmp_run(jmp, STEPS)
  theirs, _, _, their_scales = _jmp_run(real_jmp, STEPS)
  assert scales == their_scales
  chex.assert_trees_all_close(params, theirs, rtol=1e-6, atol=1e-7)


# --- Haiku ----------------------------------------------------------------------------


def test_haiku_takes_the_policy(standard_promotion):
  del standard_promotion
  hk = pytest.importorskip("haiku")
  policy = jmp.get_policy("p=f32,c=f16,o=f32")
  seen = []

  class Probe(hk.Module):
    def __call__(self, x):
      seen.append(x.dtype)
      w = hk.get_parameter("w", (x.shape[-1], 3), init=jnp.ones)
      seen.append(w.dtype)
      return x @ w

  hk.mixed_precision.set_policy(Probe, policy)
  try:
    f = hk.transform(lambda x: Probe()(x))
    params = f.init(jax.random.key(0), jnp.ones((2, 4)))
    out = f.apply(params, None, jnp.ones((2, 4)))
  finally:
    hk.mixed_precision.clear_policy(Probe)
  assert params["probe"]["w"].dtype == jnp.float32
  assert seen[-2:] == [jnp.float16, jnp.float16]
  assert out.dtype == jnp.float32


def _haiku_batch_norm_model(hk):
  def forward(x, is_training):
    x = hk.Linear(16)(x)
    x = hk.BatchNorm(True, True, decay_rate=0.9)(x, is_training)
    return hk.Linear(1)(jax.nn.relu(x))

  return hk.transform_with_state(forward)


@pytest.mark.slow  # run by `.ci/run` beside the suite
def test_haiku_state_is_kept_on_a_skipped_step_as_the_docs_write_it(
  standard_promotion,
):
  # docs/jmp.md: Haiku's state (BatchNorm statistics) is not the optimizer's,
  # so the step keeps it with the optimizer state's `should_apply`.
  del standard_promotion
  hk = pytest.importorskip("haiku")
  model = _haiku_batch_norm_model(hk)
  tx = ols.LossScaleOptimizer(optax.adam(1e-3), ols.DynamicLossScale(2.0**15))

  def loss_fn(params, state, x, y):
    out, state = model.apply(params, state, None, x, is_training=True)
    return jnp.mean((out - y) ** 2), state

  @jax.jit
  def train_step(params, state, opt_state, x, y):
    grad_fn = ols.scaled_value_and_grad(loss_fn, has_aux=True)
    (loss, new_state), grads = grad_fn(opt_state, params, state, x, y)
    params, opt_state = tx.apply_gradients(grads, opt_state, params, value=loss)
    state = jmp.select_tree(opt_state.should_apply, new_state, state)
    return params, state, opt_state

  hk.mixed_precision.set_policy(hk.Linear, jmp.get_policy("p=f32,c=f16,o=f32"))
  try:
    x = jax.random.normal(jax.random.key(0), (32, 8))
    y = jnp.sum(x, axis=1, keepdims=True)
    params, state = model.init(jax.random.key(1), x, True)
    opt_state = tx.init(params)
    params, state, opt_state = train_step(params, state, opt_state, x, y)
    assert bool(opt_state.should_apply)
    # A float16 overflow in the forward pass: the batch's statistics are not
    # finite, and so are not the moving averages that step computes.
    overflow = x.at[0, 0].set(1e6)
    _, new_state = loss_fn(params, state, overflow, y)
    assert not all(jax.tree.leaves(jax.tree.map(ols.all_finite, new_state)))
    skipped = train_step(params, state, opt_state, overflow, y)
  finally:
    hk.mixed_precision.clear_policy(hk.Linear)
  assert not bool(skipped[2].should_apply)
  assert int(skipped[2].skipped_steps) == 1
  chex.assert_trees_all_equal(skipped[1], state)
  assert all(jax.tree.leaves(jax.tree.map(ols.all_finite, skipped[1])))
  chex.assert_trees_all_equal(skipped[0], params)


def test_dtype_to_names_is_jmps_table_and_str_uses_its_first_names():
  from optax_lossscale import jmp as ours

  assert "dtype_to_names" not in ours.__all__
  for t in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64):
    names = ours.dtype_to_names[t]
    assert str(ours.Policy(t, t, t)) == ",".join(
      f"{k}={names[0]}" for k in "pco"
    )
  assert ours.dtype_to_names[jnp.float32] == ("full", "f32", "float32")


def test_a_floor_leaf_restored_as_numpy_stays_a_leaf_after_adjust():
  ls = jmp.DynamicLossScale(jnp.float32(8), min_loss_scale=jnp.float32(2))
  structure = jax.tree.structure(ls)
  restored = jax.tree.unflatten(
    structure, [np.asarray(x) for x in jax.tree.leaves(ls)]
  )  # as a checkpoint restore or `jax.device_get` gives it back
  for finite in (False, True):
    adjusted = restored.adjust(jnp.array(finite))
    assert jax.tree.structure(adjusted) == structure
  assert float(restored.adjust(jnp.array(False)).loss_scale) == 4.0
