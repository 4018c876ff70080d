"""`check_state`: restored loss scales and counters are checked on the host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from flax import nnx
from flax.training import train_state

import optax_lossscale as ols

PARAMS = {"w": jnp.zeros(3)}


def _set(tree, field, value):
  """`tree` with every leaf named `field` set to `value` (unflattened as is)."""

  def leaf(path, x):
    if jax.tree_util.keystr(path).endswith(f".{field}"):
      return jnp.full_like(x, value)
    return x

  return jax.tree_util.tree_map_with_path(leaf, tree)


def _optimizer_state(**kwargs):
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(**kwargs))
  return tx.init(PARAMS)


# Each tree, and the path `check_state` names for its scale.
CONTAINERS = {
  "a bare loss scale": (lambda: ols.DynamicLossScale(), "tree"),
  "unscale_gradients in a chain": (
    lambda: optax.chain(
      ols.unscale_gradients(ols.DynamicLossScale()), optax.sgd(0.1)
    ).init(PARAMS),
    "tree[0].loss_scale",
  ),
  "an optimizer state in a dict": (
    lambda: {"params": PARAMS, "opt_state": _optimizer_state()},
    "tree['opt_state'].loss_scale",
  ),
  "loss_scale_optimizer in inject_hyperparams": (
    lambda: optax.chain(
      optax.identity(),
      ols.loss_scale_optimizer(
        optax.chain(
          optax.clip(1.0),
          optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        ),
        ols.DynamicLossScale(),
      ),
    ).init(PARAMS),
    "tree[1].loss_scale",
  ),
  "a linen TrainState": (
    lambda: train_state.TrainState.create(
      apply_fn=None,
      params=PARAMS,
      tx=ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale()),
    ),
    "tree.opt_state.loss_scale",
  ),
}


@pytest.mark.parametrize("container", CONTAINERS)
def test_check_state_finds_the_loss_scale_and_names_its_path(container):
  build, path = CONTAINERS[container]
  tree = build()
  assert ols.check_state(tree) is tree
  bad = _set(tree, "current_loss_scale", jnp.nan)
  with pytest.raises(ValueError) as error:
    ols.check_state(bad)
  assert str(error.value) == (
    f"`check_state(tree)`: `{path}.current_loss_scale` must be finite and in"
    " [min_loss_scale=1.0, float32's maximum], got nan."
  )


def test_check_state_with_a_flax_nnx_optimizer():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 1, rngs=rngs)

  tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale())
  optimizer = nnx.Optimizer(Model(nnx.Rngs(0)), tx, wrt=nnx.Param)
  assert ols.check_state(optimizer) is optimizer
  assert ols.check_state(optimizer.opt_state) is optimizer.opt_state
  # nnx wraps every leaf in a Variable; the check reads through it.
  optimizer.opt_state.skipped_steps[...] = -1
  with pytest.raises(ValueError, match=r"`tree.opt_state.skipped_steps` must"):
    ols.check_state(optimizer)
  optimizer.opt_state.skipped_steps[...] = 0
  optimizer.opt_state.loss_scale.num_good_steps[...] = 2000
  with pytest.raises(ValueError, match=r"`tree.loss_scale.num_good_steps`"):
    ols.check_state(optimizer.opt_state)
  # `nnx.state` keeps the arrays but not the types: nothing to check.
  with pytest.raises(ValueError, match="found no loss scale.*nnx.Optimizer"):
    ols.check_state(nnx.state(optimizer))


@pytest.mark.parametrize(
  "field",
  ["skipped_steps", "consecutive_skipped_steps", "nonfinite_loss_steps"]
  + ["retries"],
)
def test_check_state_refuses_a_negative_counter(field):
  state = _optimizer_state()
  with pytest.raises(ValueError) as error:
    ols.check_state(state._replace(**{field: jnp.int32(-2)}))
  assert str(error.value) == (
    f"`check_state(tree)`: `tree.{field}` must be non-negative, got -2."
  )


def test_check_state_refuses_more_consecutive_skips_than_skips():
  state = _optimizer_state()._replace(
    skipped_steps=jnp.int32(3), consecutive_skipped_steps=jnp.int32(3)
  )
  ols.check_state(state)
  with pytest.raises(ValueError, match=r"at most `skipped_steps`, got 4, with"):
    ols.check_state(state._replace(consecutive_skipped_steps=jnp.int32(4)))


def test_check_state_accepts_a_0_1_0_state_without_the_new_counters():
  state = _optimizer_state()._replace(nonfinite_loss_steps=None, retries=None)
  assert ols.check_state(state) is state


@pytest.mark.parametrize(
  "kwargs, field, value, message",
  [
    ({}, "current_loss_scale", 0.5, r"\[min_loss_scale=1.0, .*got 0.5\."),
    ({}, "current_loss_scale", -jnp.inf, "got -inf"),
    (
      dict(max_loss_scale=2.0**16),
      "current_loss_scale",
      2.0**17,
      r"max_loss_scale=65536.0\], got 131072.0\.",
    ),
    ({}, "num_good_steps", -1, r"in \[0, increment_period=2000\), got -1\."),
    ({}, "num_good_steps", 2000, "got 2000"),
    (dict(hysteresis=2), "hysteresis_budget", 3, r"hysteresis=2\], got 3\."),
    (dict(hysteresis=2), "hysteresis_budget", -1, "got -1"),
  ],
)
def test_check_state_refuses_a_loss_scale_out_of_range(
  kwargs, field, value, message
):
  state = _optimizer_state(**kwargs)
  ols.check_state(state)
  with pytest.raises(
    ValueError, match=rf"`tree.loss_scale.{field}` .*{message}"
  ):
    ols.check_state(_set(state, field, value))


def test_check_state_checks_a_stacked_state_element_by_element():
  state = _optimizer_state(hysteresis=2)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 4), state)
  ols.check_state(stacked)

  def at_replica_2(field, value):
    def leaf(path, x):
      if jax.tree_util.keystr(path).endswith(f".{field}"):
        return x.at[2].set(value)
      return x

    return jax.tree_util.tree_map_with_path(leaf, stacked)

  for field, value, got in [
    ("current_loss_scale", jnp.nan, "nan"),
    ("hysteresis_budget", 7, "7"),
    ("retries", -1, "-1"),
  ]:
    with pytest.raises(ValueError, match=rf"{field}` .* {got} at index \(2,\)"):
      ols.check_state(at_replica_2(field, value))


def test_check_state_passes_abstract_values_and_needs_a_loss_scale():
  state = _optimizer_state()
  bad = state._replace(skipped_steps=jnp.int32(-1))
  out = jax.jit(ols.check_state)(bad)  # tracers: nothing to read
  assert int(out.skipped_steps) == -1
  ols.check_state(jax.eval_shape(lambda: bad))  # shapes: nothing to read
  ols.check_state(ols.FixedLossScale(8.0))  # no array state
  ols.check_state([ols.NoOpLossScale(), None])
  with pytest.raises(ValueError, match="found no loss scale in `tree` \\(a"):
    ols.check_state({"skipped_steps": jnp.int32(0)})


# --- a checkpoint corrupted on disk -----------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
  "array, value, message",
  [
    (
      "opt_state.loss_scale.current_loss_scale",
      np.float32(np.nan),
      "`tree['opt_state'].loss_scale.current_loss_scale` must be finite",
    ),
    (
      "opt_state.loss_scale.num_good_steps",
      np.int32(-5),
      "`tree['opt_state'].loss_scale.num_good_steps` must be an integer in",
    ),
    (
      "opt_state.skipped_steps",
      np.int32(-1),
      "`tree['opt_state'].skipped_steps` must be non-negative, got -1.",
    ),
  ],
  ids=["nan_scale", "negative_good_steps", "negative_skipped_steps"],
)
def test_orbax_checkpoint_corrupted_on_disk_is_caught(
  tmp_path, array, value, message
):
  # The frameworks guide's Orbax recipe: save, restore into a target, check.
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**10))
  params = {"w": jnp.ones(3)}
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, {"params": params, "opt_state": tx.init(params)})
  # Orbax keeps each array as a zarr array in an OCDBT database.
  stored = ts.open(
    {
      "driver": "zarr",
      "kvstore": {"driver": "ocdbt", "base": f"file://{path}"},
      "path": array,
    }
  ).result()
  stored.write(value).result()

  target = {"params": params, "opt_state": tx.init(params)}
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(path, target)  # the restore notices nothing
    untyped = checkpointer.restore(path)
  assert isinstance(restored["opt_state"].loss_scale, ols.DynamicLossScale)
  with pytest.raises(ValueError) as error:
    ols.check_state(restored)
  assert message in str(error.value)
  # Without a target, Orbax gives dicts: the loss scale has lost its type.
  with pytest.raises(ValueError, match="found no loss scale"):
    ols.check_state(untyped)


def test_check_state_checks_the_skip_record_counters():
  import dataclasses

  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  state = tx.init({"w": jnp.zeros(2), "b": jnp.zeros(1)})
  record = state.last_skip
  for name, value in [
    ("skipped_steps", jnp.int32(-1)),
    ("consecutive_skipped_steps", jnp.int32(-3)),
  ]:
    bad = state._replace(last_skip=dataclasses.replace(record, **{name: value}))
    with pytest.raises(ValueError, match=f"last_skip.{name}` must be non-neg"):
      ols.check_state(bad)
  # The per-leaf flags are bools: a count (0.2.0's development layout) is
  # refused by dtype.
  bad = state._replace(
    last_skip=dataclasses.replace(record, nonfinite=jnp.array([0, 2]))
  )
  with pytest.raises(TypeError, match="last_skip.nonfinite` must be bool"):
    ols.check_state(bad)
  assert ols.check_state(state._replace(last_skip=None)) is not None


# --- dtypes and shapes ------------------------------------------------------


def _with_leaf(tree, field, fn):
  """`tree` with every leaf named `field` replaced by `fn(leaf)`."""

  def leaf(path, x):
    return fn(x) if jax.tree_util.keystr(path).endswith(f".{field}") else x

  return jax.tree_util.tree_map_with_path(leaf, tree)


@pytest.mark.parametrize(
  "field, value, expected, got",
  [
    ("skipped_steps", jnp.uint8(0), "int32", "Array(0, dtype=uint8)"),
    ("retries", np.int64(0), "int32", "np.int64(0)"),
    ("consecutive_skipped_steps", 0, "int32", "the Python int 0"),
    ("should_apply", jnp.int32(1), "bool", "Array(1, dtype=int32)"),
  ],
)
def test_check_state_refuses_a_counter_of_the_wrong_dtype(
  field, value, expected, got
):
  state = _optimizer_state()
  with pytest.raises(TypeError) as error:
    ols.check_state(state._replace(**{field: value}))
  assert str(error.value) == (
    f"`check_state(tree)`: `tree.{field}` must be {expected}, got {got}."
  )


@pytest.mark.parametrize(
  "field, dtype, expected",
  [
    ("current_loss_scale", jnp.float16, "float32"),
    ("current_loss_scale", jnp.bfloat16, "float32"),
    ("num_good_steps", jnp.uint8, "int32"),
    ("hysteresis_budget", jnp.int16, "int32"),
  ],
)
def test_check_state_refuses_a_loss_scale_of_the_wrong_dtype(
  field, dtype, expected
):
  state = _optimizer_state(hysteresis=2)
  bad = _with_leaf(state, field, lambda x: x.astype(dtype))
  with pytest.raises(
    TypeError, match=rf"^`check_state\(tree\)`: `tree.loss_scale.{field}`"
  ) as error:
    ols.check_state(bad)
  assert f"must be {expected}, got" in str(error.value)
  # The same under `jit`, where the values are abstract but the dtype is not.
  with pytest.raises(TypeError, match=f"{field}` must be {expected}, got a tr"):
    jax.jit(ols.check_state)(bad)


@pytest.mark.parametrize(
  "field, dtype",
  [
    ("loss_scale", jnp.float16),
    ("next_loss_scale", jnp.bfloat16),
    ("skipped_steps", jnp.uint32),
    ("loss_given", jnp.int32),
    ("at_floor", jnp.float32),
    ("nonfinite", jnp.uint8),
    ("leaf_names", jnp.int8),
  ],
)
def test_check_state_refuses_a_skip_record_field_of_the_wrong_dtype(
  field, dtype
):
  import dataclasses

  state = _optimizer_state()
  record = state.last_skip
  value = getattr(record, field).astype(dtype)
  bad = state._replace(last_skip=dataclasses.replace(record, **{field: value}))
  with pytest.raises(TypeError, match=rf"`tree.last_skip.{field}` must be "):
    ols.check_state(bad)


def test_check_state_refuses_nonfinite_flags_that_do_not_match_the_names():
  import dataclasses

  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  state = tx.init({"w": jnp.zeros(2), "b": jnp.zeros(1)})
  record = state.last_skip
  bad = state._replace(
    last_skip=dataclasses.replace(record, nonfinite=jnp.zeros(3, jnp.bool_))
  )
  with pytest.raises(ValueError) as error:
    ols.check_state(bad)
  assert str(error.value) == (
    "`check_state(tree)`: `tree.last_skip.nonfinite` must hold one flag per"
    " name in `tree.last_skip.leaf_names`, 2, got shape (3,)."
  )
  # 0.1.0's check accepted it; the step then failed inside `update`.
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 2), state)
  ols.check_state(stacked)
  bad = stacked._replace(
    last_skip=dataclasses.replace(
      stacked.last_skip, nonfinite=jnp.zeros((2,), jnp.bool_)
    )
  )
  with pytest.raises(
    ValueError,
    match=r"`tree.last_skip.nonfinite` must have the shape of"
    r" `tree.should_apply`, \(2,\), plus one axis, got \(2,\)\.$",
  ):
    ols.check_state(bad)


@pytest.mark.parametrize(
  "field, shape",
  [
    ("current_loss_scale", (1,)),
    ("num_good_steps", (2,)),
    ("retries", (1,)),
    ("consecutive_skipped_steps", (4, 1)),
  ],
)
def test_check_state_refuses_a_field_of_another_shape_than_the_state(
  field, shape
):
  state = _optimizer_state()
  bad = _with_leaf(state, field, lambda x: jnp.broadcast_to(x, shape))
  with pytest.raises(ValueError) as error:
    ols.check_state(bad)
  where = (
    "tree.loss_scale"
    if field in ("current_loss_scale", "num_good_steps")
    else "tree"
  )
  assert str(error.value) == (
    f"`check_state(tree)`: `{where}.{field}` must have the shape of"
    f" `tree.should_apply`, () (a leading replica axis included), got {shape}."
  )


def test_check_state_refuses_a_bare_loss_scale_of_mixed_shapes():
  ls = ols.DynamicLossScale()
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 4), ls)
  ols.check_state(stacked)
  mixed = jax.tree.unflatten(
    jax.tree.structure(ls),
    [stacked.current_loss_scale, ls.num_good_steps],
  )
  with pytest.raises(
    ValueError,
    match=r"`tree.num_good_steps` must have the"
    r" shape of `tree.current_loss_scale`, \(4,\)",
  ):
    ols.check_state(mixed)
