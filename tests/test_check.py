"""`check_state`: restored loss scales and counters, checked on the host."""

from __future__ import annotations

import dataclasses

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

PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(1)}
LOSS_SCALE_FIELDS = ("current_loss_scale", "num_good_steps", "num_bad_steps")
SCALE_RANGE = "must be in [1.17549e-38, 3.40282e+38]"
NAN_SCALE = f"{SCALE_RANGE}, got nan."


def _optimizer(inner=None, **kwargs) -> ols.LossScaleOptimizer:
  return ols.LossScaleOptimizer(
    optax.sgd(0.1) if inner is None else inner,
    ols.DynamicLossScale(**kwargs),
  )


def _state(**kwargs) -> ols.LossScaleOptimizerState:
  return _optimizer(**kwargs).init(PARAMS)


def _set(tree, field, fn):
  """`tree` with every leaf named `field` replaced by `fn(leaf)`."""

  def leaf(path, x):
    return fn(x) if jax.tree_util.keystr(path).endswith(f".{field}") else x

  return jax.tree_util.tree_map_with_path(leaf, tree)


def _at(x, index, value):
  """A copy of `x` with `x[index] = value`, on the host."""
  x = np.array(x)
  x[index] = value
  return x


def _record(state, **fields):
  return state._replace(
    last_skip=dataclasses.replace(state.last_skip, **fields)
  )


# --- where the states are -----------------------------------------------------


# Each tree, and the path `check_state` names for its loss scale.
CONTAINERS = {
  "a bare loss scale": (lambda: ols.DynamicLossScale(), "tree"),
  "unscale_gradients in a chain": (
    lambda: optax.chain(
      ols.unscale_gradients(ols.DynamicLossScale()), optax.sgd(0.1)
    ).init(PARAMS),
    "tree[0].loss_scale",
  ),
  "an optimizer state in a dict": (
    lambda: {"params": PARAMS, "opt_state": _state()},
    "tree['opt_state'].loss_scale",
  ),
  "a chain holding inject_hyperparams": (
    lambda: optax.chain(
      optax.identity(),
      _optimizer(
        optax.chain(
          optax.clip(1.0),
          optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        )
      ).gradient_transformation(),
    ).init(PARAMS),
    "tree[1].loss_scale",
  ),
  "MultiSteps around the optimizer": (
    lambda: optax.MultiSteps(_optimizer().gradient_transformation(), 2).init(
      PARAMS
    ),
    "tree.inner_opt_state.loss_scale",
  ),
  "an accumulating optimizer": (
    lambda: ols.LossScaleOptimizer(
      optax.sgd(0.1), ols.DynamicLossScale(), gradient_accumulation_steps=2
    ).init(PARAMS),
    "tree.loss_scale",
  ),
  "a linen TrainState": (
    lambda: train_state.TrainState.create(
      apply_fn=None, params=PARAMS, tx=_optimizer()
    ),
    "tree.opt_state.loss_scale",
  ),
}


@pytest.mark.parametrize("container", CONTAINERS)
def test_check_state_finds_the_loss_scale_and_names_its_path(container):
  build, path = CONTAINERS[container]
  tree = build()
  assert ols.check_state(tree) is tree
  bad = _set(tree, "current_loss_scale", lambda x: jnp.full_like(x, jnp.nan))
  with pytest.raises(ValueError) as error:
    ols.check_state(bad)
  assert str(error.value) == f"`{path}.current_loss_scale` {NAN_SCALE}"


def test_check_state_moves_nothing_to_a_device():
  # It reads the state on the host: under a transfer guard it still runs.
  tx = _optimizer()
  state = jax.device_get(tx.init({"w": jnp.zeros(2)}))
  with jax.transfer_guard("disallow"):
    assert ols.check_state(state) is state


def test_check_state_reads_through_a_flax_nnx_optimizer():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 1, rngs=rngs)

  optimizer = nnx.Optimizer(Model(nnx.Rngs(0)), _optimizer(), wrt=nnx.Param)
  assert ols.check_state(optimizer) is optimizer
  assert ols.check_state(optimizer.opt_state) is optimizer.opt_state
  # nnx wraps every leaf in a Variable; the check reads through it.
  optimizer.opt_state.skipped_steps[...] = -1
  with pytest.raises(ValueError, match=r"^`tree.opt_state.skipped_steps` mu"):
    ols.check_state(optimizer)
  optimizer.opt_state.skipped_steps[...] = 0
  optimizer.opt_state.loss_scale.num_good_steps[...] = 2000
  with pytest.warns(UserWarning, match="kept `tree.loss_scale.num_good_st"):
    ols.check_state(optimizer.opt_state)
  # `nnx.state` keeps the arrays but not the types: nothing to check.
  with pytest.raises(
    ValueError, match="(?s)found no loss scale.*nnx.Optimizer"
  ):
    ols.check_state(nnx.state(optimizer))


def test_check_state_needs_a_loss_scale():
  with pytest.raises(ValueError) as error:
    ols.check_state({"skipped_steps": jnp.int32(0)})
  assert str(error.value).startswith(
    "`check_state(tree)` found no loss scale in dict {'skipped_steps':"
  )
  # Loss scales without array state have nothing to check, and pass.
  for tree in [ols.FixedLossScale(8.0), [ols.NoOpLossScale(), None]]:
    assert ols.check_state(tree) is tree


# --- values -----------------------------------------------------------------------


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("current_loss_scale", jnp.nan, NAN_SCALE),
    ("current_loss_scale", jnp.inf, f"{SCALE_RANGE}, got inf."),
    ("current_loss_scale", -jnp.inf, f"{SCALE_RANGE}, got -inf."),
    ("current_loss_scale", 0.0, f"{SCALE_RANGE}, got 0.0."),
    ("current_loss_scale", -2.0, f"{SCALE_RANGE}, got -2.0."),
    ("num_good_steps", -1, "must be at least 0, got -1."),
    ("num_bad_steps", -3, "must be at least 0, got -3."),
  ],
)
def test_check_state_refuses_an_invalid_loss_scale(field, value, message):
  bad = _set(_state(), field, lambda x: jnp.full_like(x, value))
  with pytest.raises(ValueError) as error:
    ols.check_state(bad)
  assert str(error.value) == f"`tree.loss_scale.{field}` {message}"


@pytest.mark.parametrize(
  "field",
  ["skipped_steps", "consecutive_skipped_steps", "nonfinite_loss_steps"]
  + ["retries", "steps"],
)
def test_check_state_refuses_a_negative_counter(field):
  # Each counter on its own: consecutive skips are at most the skips.
  state = _state()._replace(skipped_steps=jnp.int32(5))
  with pytest.raises(ValueError) as error:
    ols.check_state(state._replace(**{field: jnp.int32(-2)}))
  assert str(error.value) == f"`tree.{field}` must be at least 0, got -2."


def test_check_state_refuses_more_consecutive_skips_than_skips():
  state = _state()._replace(
    skipped_steps=jnp.int32(3), consecutive_skipped_steps=jnp.int32(3)
  )
  ols.check_state(state)
  with pytest.raises(ValueError) as error:
    ols.check_state(state._replace(consecutive_skipped_steps=jnp.int32(4)))
  assert str(error.value) == (
    "`tree.consecutive_skipped_steps` must be at most `skipped_steps`,"
    " got 4 > 3."
  )


def test_check_state_checks_a_stacked_state_element_by_element():
  # Leading axes of `pmap` replicas or `vmap` members, one or several: a
  # bad value in the last member is found.
  for shape in [(4,), (2, 3)]:
    stacked = jax.tree.map(
      lambda x, s=shape: np.broadcast_to(x, s + x.shape), _state()
    )
    assert ols.check_state(stacked) is stacked
    last = tuple(n - 1 for n in shape)
    for field, value in [
      ("current_loss_scale", jnp.nan),
      ("num_bad_steps", -7),
      ("retries", -1),
    ]:
      bad = _set(stacked, field, lambda x, v=value, i=last: _at(x, i, v))
      with pytest.raises(ValueError) as error:
        ols.check_state(bad)
      assert str(error.value).endswith(f"got {value}.")
      assert f".{field}` must be" in str(error.value)


# --- the values a restore keeps ---------------------------------------------------


@pytest.mark.parametrize(
  "config, field, value, kept",
  [
    (
      dict(hysteresis=1),
      "num_bad_steps",
      3,
      "`tree.loss_scale.num_bad_steps` = 3, outside [0, 1] for these"
      " hyperparameters: the next non-finite step lowers the scale.",
    ),
    (
      dict(increment_period=10),
      "num_good_steps",
      15,
      "`tree.loss_scale.num_good_steps` = 15, outside [0, 9] for these"
      " hyperparameters: the next finite step grows the scale.",
    ),
    (
      dict(initial_loss_scale=4.0, min_loss_scale=2.0),
      "current_loss_scale",
      0.5,
      "`tree.loss_scale.current_loss_scale` = 0.5, outside [2, inf] for these"
      " hyperparameters: steps take the nearest bound.",
    ),
    (
      dict(initial_loss_scale=4.0, max_loss_scale=16.0),
      "current_loss_scale",
      64.0,
      "`tree.loss_scale.current_loss_scale` = 64.0, outside [1, 16] for these"
      " hyperparameters: steps take the nearest bound.",
    ),
  ],
  ids=["bad-steps", "good-steps", "below-min", "above-max"],
)
def test_check_state_says_what_it_keeps_outside_the_usual_range(
  config, field, value, kept
):
  state = _state(**config)
  edge = {"num_bad_steps": config.get("hysteresis"), "num_good_steps": 9}
  if field in edge:  # the usual range's bounds are kept silently
    ols.check_state(_set(state, field, lambda x: jnp.full_like(x, edge[field])))
  bad = _set(state, field, lambda x: jnp.full_like(x, value))
  with pytest.warns(UserWarning) as record:
    assert ols.check_state(bad) is bad
  (warning,) = record
  assert str(warning.message) == f"`check_state(tree)` kept {kept}"
  assert warning.filename == __file__  # the caller's line


def test_check_state_warns_at_the_caller_for_a_nested_loss_scale():
  inner = optax.chain(
    ols.unscale_gradients(ols.DynamicLossScale(increment_period=10)),
    optax.sgd(1.0),
  )
  tx = ols.LossScaleOptimizer(inner, ols.DynamicLossScale())
  state = tx.init({"w": jnp.zeros(2)})
  ls = state.inner_state[0].loss_scale
  ls = dataclasses.replace(ls, num_good_steps=jnp.int32(15))
  state = state._replace(
    inner_state=(state.inner_state[0]._replace(loss_scale=ls),)
    + state.inner_state[1:]
  )
  with pytest.warns(UserWarning, match=r"inner_state\[0\]") as record:
    ols.check_state(state)
  assert [w.filename for w in record] == [__file__]


# --- dtypes and shapes --------------------------------------------------------


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("skipped_steps", jnp.uint8(0), "must be int32, got uint8: the state was"),
    ("retries", np.zeros((), np.int64), "must be int32, got int64"),
    ("retries", np.int64(0), "must be an array of int32, got np.int64(0)."),
    ("consecutive_skipped_steps", 0, "must be an array of int32, got int 0."),
    ("should_apply", jnp.int32(1), "must be bool, got int32"),
    ("nonfinite_loss_steps", jnp.float32(0), "must be int32, got float32"),
  ],
)
def test_check_state_refuses_a_counter_of_the_wrong_dtype(
  field, value, message
):
  with pytest.raises(TypeError) as error:
    ols.check_state(_state()._replace(**{field: value}))
  assert str(error.value).startswith(f"`tree.{field}` {message}")


@pytest.mark.parametrize(
  "field, dtype, expected",
  [
    ("current_loss_scale", jnp.float16, "float32"),
    ("current_loss_scale", jnp.bfloat16, "float32"),
    ("current_loss_scale", jnp.float64, "float32"),
    ("num_good_steps", jnp.uint8, "int32"),
    ("num_bad_steps", jnp.int16, "int32"),
  ],
)
def test_check_state_refuses_a_loss_scale_of_the_wrong_dtype(
  field, dtype, expected
):
  # As an Orbax restore into a cast target gives it.
  with jax.numpy_dtype_promotion("standard"), jax.enable_x64(True):
    bad = _set(_state(), field, lambda x: x.astype(dtype))
  with pytest.raises(TypeError) as error:
    ols.check_state(bad)
  assert str(error.value).startswith(
    f"`tree.loss_scale.{field}` must be {expected}, got"
    f" {jnp.dtype(dtype).name}: the state was cast"
  )
  assert "`check_state`" in str(error.value)


@pytest.mark.parametrize(
  "field, dtype",
  [
    ("loss_scale", jnp.float16),
    ("next_loss_scale", jnp.bfloat16),
    ("consecutive_skipped_steps", jnp.uint32),
    ("loss_given", jnp.int32),
    ("loss_finite", jnp.uint8),
    ("at_floor", jnp.float32),
    ("nonfinite", jnp.uint8),
    ("leaf_names", jnp.int8),
  ],
)
def test_check_state_refuses_a_skip_record_field_of_the_wrong_dtype(
  field, dtype
):
  state = _state()
  bad = _record(state, **{field: getattr(state.last_skip, field).astype(dtype)})
  with pytest.raises(TypeError, match=rf"^`tree.last_skip.{field}` must be "):
    ols.check_state(bad)


def test_check_state_refuses_nonfinite_flags_that_do_not_match_the_names():
  state = _state()  # two leaves, two names
  assert state.last_skip.names() == ("['b']", "['w']")
  with pytest.raises(ValueError) as error:
    ols.check_state(_record(state, nonfinite=jnp.zeros(3, jnp.bool_)))
  assert str(error.value) == (
    "`tree.last_skip.nonfinite` must hold one flag per leaf name (2), got"
    " shape (3,)."
  )


def test_check_state_checks_the_write_record():
  state = _state()
  record = state.last_nonfinite_write
  wrong = [
    (dataclasses.replace(record, step=jnp.int32(-2)), ValueError, "step"),
    (dataclasses.replace(record, step=jnp.float32(1)), TypeError, "step"),
    (
      dataclasses.replace(record, nonfinite=jnp.zeros(3, bool)),
      ValueError,
      "2",
    ),
    (state.last_skip, TypeError, "WriteRecord"),
  ]
  for bad, error, part in wrong:
    with pytest.raises(error, match="last_nonfinite_write") as raised:
      ols.check_state(state._replace(last_nonfinite_write=bad))
    assert part in str(raised.value)


def test_check_state_refuses_stacked_flags_without_the_members_axis():
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 2), _state())
  ols.check_state(stacked)
  with pytest.raises(ValueError, match="last_skip.nonfinite"):
    ols.check_state(_record(stacked, nonfinite=jnp.zeros(2, jnp.bool_)))


@pytest.mark.parametrize(
  "field, shape",
  [
    ("current_loss_scale", (3,)),
    ("num_good_steps", (1,)),
    ("retries", (3,)),
    ("consecutive_skipped_steps", ()),
  ],
)
def test_check_state_refuses_a_field_of_another_leading_shape(field, shape):
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 2), _state())
  bad = _set(stacked, field, lambda x: jnp.broadcast_to(x[0], shape))
  with pytest.raises(ValueError) as error:
    ols.check_state(bad)
  where = "tree.loss_scale" if field in LOSS_SCALE_FIELDS else "tree"
  assert str(error.value) == (
    f"`{where}.{field}` must have the state's shape (2,), got {shape}."
  )


@pytest.mark.parametrize("field", ["current_loss_scale", "retries"])
def test_check_state_refuses_a_field_with_more_axes_than_the_state(field):
  bad = _set(_state(), field, lambda x: jnp.broadcast_to(x, (2,)))
  with pytest.raises(ValueError, match=f"{field}` must have"):
    ols.check_state(bad)


def test_check_state_refuses_a_bare_loss_scale_of_mixed_shapes():
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 4), ols.DynamicLossScale())
  ols.check_state(stacked)
  mixed = dataclasses.replace(stacked, num_good_steps=jnp.int32(0))
  with pytest.raises(ValueError, match="num_good_steps"):
    ols.check_state(mixed)


def test_check_state_checks_abstract_states_by_dtype_only():
  state = _state()
  negative = state._replace(skipped_steps=jnp.int32(-1))
  assert int(jax.jit(ols.check_state)(negative).skipped_steps) == -1
  ols.check_state(jax.eval_shape(lambda: negative))
  cast = _set(state, "num_good_steps", lambda x: x.astype(jnp.uint8))
  with pytest.raises(TypeError, match="num_good_steps` must be int32"):
    jax.jit(ols.check_state)(cast)


def test_check_state_names_a_missing_skip_record():
  with pytest.raises((TypeError, ValueError), match="last_skip"):
    ols.check_state(_state()._replace(last_skip=None))


# --- checkpoints ------------------------------------------------------------------


def _leaves(tree):
  """Each leaf's path, shape and dtype."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(k), x.shape, x.dtype) for k, x in flat]


def _save(path, tree):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)


def _restore(path, target=None):
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, target)


@pytest.mark.parametrize("written, read", [(1, 3), (3, 1)])
def test_a_checkpoint_restores_under_another_hysteresis(
  tmp_path, written, read
):
  params = {"w": jnp.ones(3)}
  bad = {"w": jnp.array([1.0, jnp.inf, 1.0])}
  writer = _optimizer(initial_loss_scale=64.0, hysteresis=written)
  loss_scale = writer.loss_scale
  for _ in range(2):  # two overflows: the budget is spent under either
    loss_scale, _ = loss_scale.adjust(jnp.array(False))
  state = writer.init(params)._replace(loss_scale=loss_scale)
  assert int(state.loss_scale.num_bad_steps) == min(2, written)
  _save(tmp_path / "ckpt", {"params": params, "opt_state": state})

  reader = _optimizer(initial_loss_scale=64.0, hysteresis=read)
  target = {"params": params, "opt_state": reader.init(params)}
  # The leaves are the same whatever the hyperparameters.
  assert _leaves(target) == _leaves({"params": params, "opt_state": state})
  restored = _restore(tmp_path / "ckpt", target)
  opt_state = restored["opt_state"]
  assert opt_state.loss_scale.hysteresis == read
  if read < int(state.loss_scale.num_bad_steps):
    with pytest.warns(UserWarning, match=r"kept .*num_bad_steps` = 2, outsi"):
      ols.check_state(restored)
  else:
    ols.check_state(restored)
  scale = float(state.loss_scale())
  assert float(opt_state.loss_scale()) == scale
  # The next overflows follow the rule from the restored count.
  step = jax.jit(reader.apply_gradients)
  scales = []
  for _ in range(2):
    params, opt_state = step(bad, opt_state, restored["params"])
    scales.append(float(opt_state.loss_scale()))
  if read == 1:  # no budget: each overflow halves the scale
    assert scales == [scale / 2, scale / 4]
  else:  # 1 of 3 spent when written: two more lower the scale
    assert scales == [scale, scale / 2]


def test_a_0_1_0_checkpoint_restores_through_the_documented_recipe(tmp_path):
  # 0.1.0's state: five fields, and a DynamicLossScale of two leaves.
  tx = _optimizer(optax.sgd(0.1, momentum=0.9), increment_period=4)
  params = {"w": jnp.ones(3)}
  fresh = tx.init(params)
  written = {
    "loss_scale": {
      "current_loss_scale": jnp.float32(1024.0),
      "num_good_steps": jnp.int32(3),
    },
    "inner_state": fresh.inner_state,
    "should_apply": jnp.array(False),
    "skipped_steps": jnp.int32(7),
    "consecutive_skipped_steps": jnp.int32(1),
  }
  _save(tmp_path / "ckpt", {"params": params, "opt_state": written})

  target = {
    **{k: getattr(fresh, k) for k in list(written)[1:]},
    "loss_scale": {
      "current_loss_scale": fresh.loss_scale.current_loss_scale,
      "num_good_steps": fresh.loss_scale.num_good_steps,
    },
  }
  restored = _restore(
    tmp_path / "ckpt", {"params": params, "opt_state": target}
  )
  old = restored["opt_state"]
  state = fresh._replace(
    **{k: v for k, v in old.items() if k != "loss_scale"},
    loss_scale=dataclasses.replace(fresh.loss_scale, **old["loss_scale"]),
  )
  assert ols.check_state(state) is state
  assert (int(state.skipped_steps), int(state.loss_scale.num_bad_steps)) == (
    7,
    0,
  )
  # The next finite step completes the period: the scale grows.
  _, state = jax.jit(tx.apply_gradients)({"w": jnp.ones(3)}, state, params)
  assert float(state.loss_scale()) == 2048.0
  assert int(state.loss_scale.num_good_steps) == 0
  assert int(state.consecutive_skipped_steps) == 0


@pytest.mark.parametrize(
  "array, value, message",
  [
    (
      "opt_state.loss_scale.current_loss_scale",
      np.float32(np.nan),
      f"`tree['opt_state'].loss_scale.current_loss_scale` {NAN_SCALE}",
    ),
    (
      "opt_state.loss_scale.num_bad_steps",
      np.int32(-5),
      "`tree['opt_state'].loss_scale.num_bad_steps` must be at least 0, got -5.",
    ),
    (
      "opt_state.skipped_steps",
      np.int32(-1),
      "`tree['opt_state'].skipped_steps` must be at least 0, got -1.",
    ),
  ],
  ids=["nan-scale", "negative-bad-steps", "negative-skipped-steps"],
)
def test_a_checkpoint_corrupted_on_disk_is_caught(
  tmp_path, array, value, message
):
  tx = _optimizer(initial_loss_scale=2.0**10)
  params = {"w": jnp.ones(3)}
  path = tmp_path / "ckpt"
  _save(path, {"params": params, "opt_state": tx.init(params)})
  # Orbax keeps each array as a zarr array in an OCDBT database.
  stored = ts.open(
    {
      "driver": "zarr",
      "kvstore": {"driver": "ocdbt", "base": f"file://{path}"},
      "path": array,
    }
  ).result()
  stored.write(value).result()
  # The restore notices nothing; the check does.
  restored = _restore(path, {"params": params, "opt_state": tx.init(params)})
  assert isinstance(restored["opt_state"].loss_scale, ols.DynamicLossScale)
  with pytest.raises(ValueError) as error:
    ols.check_state(restored)
  assert str(error.value) == message
  # Without a target, Orbax gives dicts: the loss scale has lost its type.
  with pytest.raises(ValueError, match="found no loss scale"):
    ols.check_state(_restore(path))


def test_check_state_refuses_an_impossible_accumulation_window():
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(), gradient_accumulation_steps=4
  )
  state = tx.init(PARAMS)
  ols.check_state(state)
  with pytest.raises(ValueError, match=r"`tree.accumulated` must be at most"):
    ols.check_state(state._replace(accumulated=jnp.int32(3)))
  nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), state.accumulator)
  with pytest.raises(ValueError, match=r"`tree.accumulator` must hold no NaN"):
    ols.check_state(state._replace(accumulator=nan))


def test_check_state_checks_grad_norm_as_the_step_writes_it():
  # inf after an overflow, never NaN (the step writes inf for a NaN), never
  # negative; float32 and of the state's shape.
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  state = tx.init(PARAMS)
  ols.check_state(state._replace(grad_norm=jnp.float32(jnp.inf)))
  for bad in (jnp.nan, -1.0):
    with pytest.raises(ValueError, match=r"`tree.grad_norm` must be at least"):
      ols.check_state(state._replace(grad_norm=jnp.float32(bad)))
  with pytest.raises(ValueError, match=r"`tree.grad_norm` must have the"):
    ols.check_state(state._replace(grad_norm=jnp.zeros(3, jnp.float32)))
  with pytest.raises(TypeError, match=r"`tree.grad_norm` must be float32"):
    ols.check_state(state._replace(grad_norm=jnp.float16(1.0)))
