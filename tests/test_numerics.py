"""all_finite: one verdict for a whole tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols


@pytest.mark.parametrize(
  "dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64]
)
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_all_finite_detects_one_bad_element(dtype, bad):
  tree = {"a": jnp.ones((4, 3), dtype), "b": [jnp.zeros(5, dtype), None]}
  assert bool(ols.all_finite(tree))
  assert bool(jax.jit(ols.all_finite)(tree))
  for position in [(0, 0), (3, 2), (1, 1)]:
    broken = dict(tree, a=tree["a"].at[position].set(jnp.asarray(bad, dtype)))
    assert not bool(ols.all_finite(broken))
    assert not bool(jax.jit(ols.all_finite)(broken))


def test_all_finite_complex_with_large_finite_parts_is_finite():
  big = jnp.float32(3e38)
  value = jax.lax.complex(big, big)
  assert bool(ols.all_finite(value[None]))


def test_all_finite_largest_float16_is_finite():
  assert bool(ols.all_finite(jnp.array([65504.0, -65504.0], jnp.float16)))


@pytest.mark.parametrize("tree", [{}, [], None, [None, None], jnp.zeros((0,))])
def test_empty_trees_are_finite(tree):
  out = ols.all_finite(tree)
  assert out.dtype == jnp.bool_ and out.shape == () and bool(out)


def test_integer_and_float0_leaves_are_ignored():
  grads = jax.grad(lambda x, n: jnp.sum(x), argnums=(0, 1), allow_int=True)(
    jnp.ones(2), 3
  )
  assert bool(ols.all_finite([grads, jnp.arange(3)]))


@pytest.mark.parametrize("size", [10_000, 1_000_000])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_large_leaves_nan_is_not_lost_in_library_reductions(size, bad):
  # XLA's CPU backend hands large max-reductions to a library that drops NaN;
  # the finiteness check must not depend on it.
  x = jnp.ones((size,)).at[size // 3].set(bad)
  assert not bool(ols.all_finite(x))
  assert not bool(jax.jit(ols.all_finite)({"a": jnp.ones(5), "b": x}))
  loss_scale = ols.DynamicLossScale(8.0)
  assert not bool(jax.jit(lambda g: loss_scale.update(g)[1])([x]))
  assert not bool(loss_scale.grads_finite([x]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
  "shape", [(70_001,), (16 * 4_096,), (301, 257), (300, 320), (3, 2, 40_000)]
)
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_large_low_precision_leaves_every_position_is_checked(
  dtype, shape, bad
):
  # Large float16 and bfloat16 leaves are summed in rows of 16 along the last
  # axis (a vector in rows plus a tail): a bad element at the start, inside, or
  # in the last position is found, with and without jit.
  x = jnp.full(shape, 65504.0 if dtype == jnp.float16 else 3e38, dtype)
  assert bool(ols.all_finite(x)) and bool(jax.jit(ols.all_finite)(x))
  flat = x.ravel()
  for index in [0, flat.size // 2 + 3, flat.size - 1]:
    broken = flat.at[index].set(jnp.asarray(bad, dtype)).reshape(shape)
    assert not bool(ols.all_finite(broken))
    assert not bool(jax.jit(ols.all_finite)([jnp.ones(3, dtype), broken]))


def test_many_small_leaves_every_leaf_is_checked():
  # Small leaves may be read together: a bad element in any leaf, whatever
  # its position among the leaves of its dtype, is found.
  dtypes = [jnp.float32, jnp.float16, jnp.bfloat16]
  tree = [jnp.ones((3, i % 5 + 1), dtypes[i % 3]) for i in range(400)]
  check = jax.jit(ols.all_finite)
  assert bool(check(tree))
  for index in [0, 1, 2, 191, 192, 194, 200, 383, 384, 399]:
    broken = list(tree)
    broken[index] = tree[index].at[-1, -1].set(jnp.nan)
    assert not bool(check(broken)), index


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
  "shape", [(1000, 1, 1), (2, 3, 5, 7), (), (0, 4), (1, 17)]
)
def test_every_shape_is_checked_whole(dtype, shape):
  # Trailing axes of size 1, odd sizes, scalars and empty leaves, next to a
  # large leaf of the same dtype: a bad element anywhere is found.
  x = jnp.full(shape, 2.0, dtype)
  big = jnp.ones((40_000, 1), dtype)
  check = jax.jit(lambda t: ols.all_finite(t))
  assert bool(check([x, big]))
  for index in {0, x.size // 2, x.size - 1} if x.size else set():
    broken = x.ravel().at[index].set(jnp.inf).reshape(shape)
    assert not bool(check([broken, big]))
  assert not bool(check([x, big.at[39_999, 0].set(jnp.nan)]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_skip_record_flags_each_leaf_once_unscaled(dtype):
  # Leaves of different sizes (small ones read together, a large one in
  # place) each get their own flag after unscaling by a scale below 1, which
  # overflows the largest finite values.
  largest = float(jnp.finfo(dtype).max)
  sizes = {"a": 3, "b": 700, "c": 5, "d": 70_001, "e": 0}
  grads = {k: jnp.ones((n,), dtype) for k, n in sizes.items()}
  grads["a"] = grads["a"].at[1].set(jnp.nan)
  grads["b"] = grads["b"].at[::100].set(largest)  # overflows once unscaled
  grads["d"] = grads["d"].at[-1].set(-jnp.inf).at[5].set(jnp.nan)
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(0.5, min_loss_scale=0.25)
  )
  params = jax.tree.map(jnp.zeros_like, grads)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  flags = state.last_skip.nonfinite
  assert flags.dtype == jnp.bool_
  assert flags.tolist() == [True, True, False, True, False]
