"""`all_finite` and the optimizer's check: every leaf, every element, no NaN made.

Small leaves (at most 4,096 elements) are checked in stacks of up to 64
leaves of one dtype, padded; larger ones in place. The trees below reach both
paths, their boundaries and the padding, with one compiled check each, then
move a bad element through every position that matters.
"""

from __future__ import annotations

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify

import optax_lossscale as ols

FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64]
# 0-d to 3-d, empty, trailing axes of size 1, both sides of the 4,096
# elements where a leaf is checked in place, and a large one.
SHAPES = [(), (1,), (0,), (0, 4), (5,), (3, 1), (1, 17), (2, 3, 5), (7, 1, 1)]
SHAPES += [(4096,), (4097,), (3, 2, 1000)]
BAD = [jnp.nan, jnp.inf, -jnp.inf]


def _bad(dtype, value, imaginary=False):
  """`value` in `dtype`; for complex, in the real or the imaginary part."""
  if np.issubdtype(dtype, np.complexfloating):
    return complex(*((0.0, value) if imaginary else (value, 0.0)))
  return value


def _broken(x, index, value):
  """A copy of `x` with its element `index` (flat) set to `value`, built on
  the host: no compilation per shape."""
  out = np.array(x)
  out.flat[index] = value
  return out


def _many_small_leaves():
  """Small leaves of mixed sizes and dtypes: several stacks of each dtype,
  full ones (64 leaves) and ones cut by size, beside two large leaves."""
  rng = np.random.default_rng(0)
  tiny = [np.ones((n % 4 + 1,), np.float32) for n in range(66)]  # 64 + 2
  sizes = rng.integers(1, 4097, 15)
  dtypes = [np.float32, np.float16, jnp.bfloat16]
  shapes = [(n,) if n % 3 else (1, n, 1) for n in sizes]
  leaves = tiny + [np.ones(s, dtypes[i % 3]) for i, s in enumerate(shapes)]
  leaves += [np.ones((5000,), np.float16), np.ones((70, 70), np.float32)]
  return [jnp.asarray(x) for x in leaves]


def _every_kind_of_leaf():
  """Every float dtype in every shape, many small leaves, and leaves that
  are not checked."""
  tree = {
    f"{np.dtype(d).name}{s}": jnp.asarray(np.full(s, 2.0, d))
    for d in FLOATS
    for s in SHAPES
  }
  float0 = jax.grad(lambda x, n: x, argnums=(0, 1), allow_int=True)(1.0, 3)[1]
  return (
    tree
    | {
      "int": jnp.arange(3),
      "bool": jnp.array([True, False]),
      "float0": float0,
      "none": None,
      # The largest finite values are finite.
      "f16max": jnp.array([65504.0, -65504.0], jnp.float16),
      "c64max": jnp.array([3e38 - 3e38j], jnp.complex64),
      "large": jnp.ones((100_000,)),
    }
    | {f"small{i}": x for i, x in enumerate(_many_small_leaves())}
  )


def _checked(tree):
  """The leaves that are checked, by name."""
  skip = ("int", "bool", "float0", "none")
  return {k: x for k, x in tree.items() if k not in skip}


def test_every_element_of_every_leaf_is_checked():
  traces = []

  @jax.jit
  def check(tree):
    traces.append(None)
    return ols.all_finite(tree)

  tree = _every_kind_of_leaf()
  out = check(tree)
  assert out.dtype == jnp.bool_ and out.shape == () and bool(out)
  for i, (name, x) in enumerate(_checked(tree).items()):
    # The first element, and the last (beside a stack's zero padding).
    positions = sorted({0, x.size // 2, x.size - 1}) if x.size else []
    for j, index in enumerate(positions):
      value = _bad(x.dtype, BAD[(i + j) % 3], imaginary=bool(j % 2))
      broken = tree | {name: _broken(x, index, value)}
      assert not bool(check(broken)), (name, index)
  assert len(traces) == 1


def test_every_dtype_eagerly():
  tree = {
    f"{np.dtype(d).name}{s}": jnp.asarray(np.full(s, 2.0, d))
    for d in FLOATS
    for s in [(2, 3, 1)]
  } | {"large": jnp.ones((5000,), jnp.float16)}
  assert bool(ols.all_finite(tree))
  for i, (name, x) in enumerate(tree.items()):
    broken = _broken(x, x.size - 1, _bad(x.dtype, BAD[i % 3], bool(i % 2)))
    assert not bool(ols.all_finite(tree | {name: broken})), name


@pytest.mark.parametrize(
  "min_loss_scale", [1.0, 0.25], ids=["scaled", "unscaled"]
)
def test_the_optimizer_flags_each_leaf_on_its_own(min_loss_scale):
  # Per leaf of the parameters, whether its gradient held a non-finite value
  # (read unscaled when the scale may fall below 1, which can overflow it):
  # each leaf its own flag, whatever stack it was checked in.
  leaves = _many_small_leaves()
  grads = dict(enumerate(leaves[::5] + leaves[-2:]))
  tx = ols.LossScaleOptimizer(
    optax.identity(),
    ols.DynamicLossScale(
      max(0.5, min_loss_scale), min_loss_scale=min_loss_scale
    ),
  )
  state = tx.init(grads)
  update = jax.jit(lambda g: tx.update(g, state)[1].last_skip.nonfinite)
  assert not update(grads).any()
  rng = np.random.default_rng(1)
  for _ in range(4):
    bad = set(rng.choice(len(grads), 4, replace=False).tolist())
    broken = dict(grads)
    for k in bad:
      x = grads[k]
      # The largest finite value overflows once divided by 0.5.
      value = jnp.finfo(x.dtype).max if min_loss_scale < 1 else BAD[k % 3]
      broken[k] = _broken(x, x.size - 1, value)
    flags = update(broken)
    assert flags.dtype == jnp.bool_
    assert set(np.flatnonzero(flags).tolist()) == bad


@pytest.mark.parametrize(
  "tree", [{}, [], None, [None, None], jnp.zeros((0,))], ids=repr
)
def test_empty_trees_are_finite(tree):
  out = ols.all_finite(tree)
  assert out.dtype == jnp.bool_ and out.shape == () and bool(out)


def test_replicas_agree_through_axis_name():
  x = {"a": _broken(np.ones((4, 3)), 7, np.inf), "b": np.ones((4, 5000))}
  nested = jax.tree.map(lambda v: v.reshape(2, 2, *v.shape[1:]), x)

  @jax.jit
  def verdicts(x, nested):
    alone = jax.vmap(ols.all_finite)(x)
    agreed = jax.vmap(
      lambda t: ols.all_finite(t, axis_name="i"), axis_name="i"
    )(x)
    # Several axes at once.
    both = jax.vmap(
      jax.vmap(
        lambda t: ols.all_finite(t, axis_name=("i", "j")), axis_name="j"
      ),
      axis_name="i",
    )(nested)
    return alone, agreed, both

  alone, agreed, both = verdicts(x, nested)
  assert alone.tolist() == [True, True, False, True]
  assert agreed.tolist() == [False] * 4
  assert both.tolist() == [[False, False], [False, False]]


# --- debuggable: no NaN is made -------------------------------------------------


def _overflowed():
  """Gradients that overflowed to inf (no NaN), on both checking paths."""
  return {
    "small": jnp.array([1.0, jnp.inf, -jnp.inf], jnp.float16),
    "stacked": jnp.ones((3, 4)),
    "large": _broken(np.ones((5000,)), 17, -np.inf),
    "complex": jnp.array([1 + 1j, complex(np.inf, 0)], jnp.complex64),
  }


def test_all_finite_on_inf_is_false_under_debug_nans():
  tree = _overflowed()
  with jax.debug_nans(True):
    assert not bool(ols.all_finite(tree))
    assert not bool(jax.jit(ols.all_finite)(tree))
    # A loss scale below 1 reads the gradients unscaled: still no NaN.
    loss_scale = ols.DynamicLossScale(0.5, min_loss_scale=0.25)
    for update in (loss_scale.update, jax.jit(loss_scale.update)):
      new, should_apply = update(tree)
      assert not bool(should_apply) and float(new()) == 0.25


def test_checkify_finds_no_nan_in_the_check():
  check = checkify.checkify(ols.all_finite, errors=checkify.nan_checks)
  error, out = check(_overflowed())
  assert error.get() is None and not bool(out)


# Primitives that can turn an inf (or a finite value) into a NaN.
NAN_MAKERS = {
  "add", "sub", "mul", "div", "rem", "pow", "integer_pow", "dot_general",
  "reduce_sum", "reduce_prod", "cumsum", "cumprod", "exp", "log", "log1p",
  "sqrt", "rsqrt", "sin", "cos", "tan", "atan2", "logistic",
}  # fmt: skip


def _arithmetic_on_floats(jaxpr) -> list[str]:
  found = []
  for eqn in jaxpr.eqns:
    floats = [
      v
      for v in eqn.invars
      if hasattr(v, "aval") and jnp.issubdtype(v.aval.dtype, jnp.inexact)
    ]
    if eqn.primitive.name in NAN_MAKERS and floats:
      found.append(str(eqn))
  for sub in jex.core.subjaxprs(jaxpr):
    found += _arithmetic_on_floats(sub)
  return found


def test_the_check_does_no_arithmetic_on_the_gradients():
  tree = _overflowed() | {"more": [np.ones((i,)) for i in range(1, 70)]}
  jaxpr = jax.make_jaxpr(ols.all_finite)(tree).jaxpr
  assert "is_finite" in str(jaxpr)
  assert _arithmetic_on_floats(jaxpr) == []


def test_float16_gradients_give_the_norm_of_every_value_exactly():
  # Every finite float16 value, first or second in a leaf of two, gives its
  # magnitude exactly; an inf or a NaN gives inf and skips the step.
  values = jax.lax.bitcast_convert_type(
    jnp.arange(2**16, dtype=jnp.uint32).astype(jnp.uint16), jnp.float16
  )
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.FixedLossScale(1.0))
  params = {"w": jnp.zeros((2,), jnp.float16)}
  state = tx.init(params)

  @jax.jit
  @jax.vmap
  def norm(pair):
    new = tx.update({"w": pair}, state, params)[1]
    return new.grad_norm, new.should_apply

  wide = np.asarray(values, np.float32)
  finite = np.isfinite(wide)
  zeros = jnp.zeros_like(values)
  for pair in (jnp.stack([values, zeros], 1), jnp.stack([zeros, values], 1)):
    got, applied = norm(pair)
    np.testing.assert_array_equal(got, np.where(finite, np.abs(wide), np.inf))
    np.testing.assert_array_equal(applied, finite)
  # Large leaves, read in place, and small ones, stacked; apart, one of 4M
  # elements, where a float32 sum in order would lose 2e-3 of the norm:
  # each norm to float32's rounding.
  rng = np.random.default_rng(0)
  every = rng.permutation(wide[finite])
  grads = {
    "even": every,
    "odd": every[:-1],
    **{f"small{n}": every[n : 2 * n + 1] for n in (0, 2, 4)},
  }
  for tree in (grads, {"large": rng.standard_normal(2**22)}):
    tree = {k: jnp.asarray(v, jnp.float16) for k, v in tree.items()}
    params = jax.tree.map(jnp.zeros_like, tree)
    new = jax.jit(tx.update)(tree, tx.init(params), params)[1]
    leaves = np.concatenate([np.asarray(g, np.float64) for g in tree.values()])
    expected = np.sqrt(np.sum(np.square(leaves)))
    np.testing.assert_allclose(float(new.grad_norm), expected, rtol=1e-6)


def test_float16_gradients_differentiate_through_the_norm_and_the_clip():
  # The step's read of float16 gradients is differentiated as the sum of
  # their squares (meta-learning through a clipped step), as for float32.
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.2), ols.FixedLossScale(1.0), max_norm=1.0
  )

  def through_the_step(grads):
    params = jax.tree.map(jnp.zeros_like, grads)
    updates, state = tx.update(grads, tx.init(params), params)
    return jnp.sum(updates["w"].astype(jnp.float32)) + state.grad_norm

  grads = np.array([3.0, 4.0, 0.0, 0.5, 1.5, 2.0])
  got = {}
  for dtype in (jnp.float16, jnp.float32):
    g = {"w": jnp.asarray(grads, dtype)}
    got[dtype] = jax.jit(jax.grad(through_the_step))(g)["w"]
  np.testing.assert_allclose(got[jnp.float16], got[jnp.float32], atol=2e-3)
  assert np.any(np.abs(np.asarray(got[jnp.float32])) > 0.1)
