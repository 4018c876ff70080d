"""Model state on a skipped step, and flax's `DynamicScale` reproduced.

The recipes of `docs/guides/frameworks.md` (linen `batch_stats`, Flax NNX
stateful and functional, Haiku `state`), each on a model with BatchNorm: an
overflow and a NaN batch skip the step and leave every variable of the model
and the optimizer's inner state bit for bit; a normal step changes them.
These compile four steps, so they are `slow`; in the default run, the
page's section "Check that a skipped step keeps the model" runs the same
three checks on its own recipes.

`DynamicLossScale` configured as `docs/guides/from_others.md` says gives
`DynamicScale`'s scales and skips bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training.dynamic_scale import DynamicScale
from flax.training.train_state import TrainState

import optax_lossscale as ols
from optax_lossscale import jmp

pytestmark = [
  pytest.mark.usefixtures("standard_promotion"),
  pytest.mark.filterwarnings("ignore::DeprecationWarning:flax.*"),
]

X = jax.random.normal(jax.random.key(0), (16, 4))
Y = jnp.sum(X, axis=1, keepdims=True) / 4
NAN_X = X.at[0, 0].set(jnp.nan)
# With float16 compute, scaled gradients overflow at this scale.
HUGE = 2.0**40


def optimizer() -> ols.LossScaleOptimizer:
  return ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale())


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def with_scale(opt_state: Any, scale: float) -> Any:
  loss_scale = dataclasses.replace(
    opt_state.loss_scale, current_loss_scale=jnp.float32(scale)
  )
  return opt_state._replace(loss_scale=loss_scale)


@dataclasses.dataclass
class Recipe:
  """One documented step, compiled once, and how to read what it writes."""

  init: Callable[[], Any]  # a fresh training state
  step: Callable[[Any, jax.Array, jax.Array], Any]  # the new training state
  opt_state: Callable[[Any], Any]  # its LossScaleOptimizerState, as arrays
  with_scale: Callable[[Any, float], Any]  # its loss scale set to `scale`
  variables: Callable[[Any], Any]  # every variable of the model
  statistics: Callable[[Any], Any]  # the BatchNorm statistics


# --- Flax linen, `batch_stats` -----------------------------------------------


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    h = nn.Dense(8, dtype=jnp.float16)(x)
    h = nn.BatchNorm(use_running_average=not train, dtype=jnp.float16)(h)
    return nn.Dense(1, dtype=jnp.float16)(jnp.tanh(h))


class BatchNormState(TrainState):
  batch_stats: Any


def linen_recipe() -> Recipe:
  model = LinenNet()
  variables = jax.jit(model.init, static_argnames="train")(
    jax.random.key(1), X, train=False
  )
  state = BatchNormState.create(
    apply_fn=model.apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=optimizer(),
  )

  @jax.jit
  def step(state, x, y):
    def loss_fn(params):
      variables = {"params": params, "batch_stats": state.batch_stats}
      pred, updated = state.apply_fn(
        variables, x, train=True, mutable=["batch_stats"]
      )
      return mse(pred, y), updated["batch_stats"]

    (_, new_stats), params, opt_state = state.tx.minimize(
      loss_fn, state.params, state.opt_state, has_aux=True
    )
    stats = optax.tree.where(
      opt_state.should_apply, new_stats, state.batch_stats
    )
    return state.replace(
      step=state.step + 1, params=params, opt_state=opt_state, batch_stats=stats
    )

  return Recipe(
    init=lambda: state,
    step=step,
    opt_state=lambda s: s.opt_state,
    with_scale=lambda s, scale: s.replace(
      opt_state=with_scale(s.opt_state, scale)
    ),
    variables=lambda s: (s.params, s.batch_stats),
    statistics=lambda s: s.batch_stats,
  )


# --- Flax NNX, stateful and functional ----------------------------------------


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    kw = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
    self.hidden = nnx.Linear(4, 8, **kw)
    self.norm = nnx.BatchNorm(8, **kw)
    self.out = nnx.Linear(8, 1, **kw)

  def __call__(self, x):
    return self.out(jnp.tanh(self.norm(self.hidden(x))))


def nnx_stateful_recipe() -> Recipe:
  tx = optimizer()

  def init():
    model = NNXNet(nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss_scale = optimizer.opt_state.loss_scale
    old_stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))

    def scaled_loss(model):
      loss = mse(model(x), y)
      return loss_scale.scale(loss), loss

    (_, loss), grads = nnx.value_and_grad(scaled_loss, has_aux=True)(model)
    optimizer.update(model, grads, value=loss)
    new_stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    should_apply = optimizer.opt_state.should_apply[...]
    nnx.update(model, optax.tree.where(should_apply, new_stats, old_stats))

  def step(state, x, y):
    model, optimizer = state
    train_step(model, optimizer, x, y)
    return state

  def set_scale(state, scale):
    state[1].opt_state.loss_scale.current_loss_scale[...] = jnp.float32(scale)
    return state

  return Recipe(
    init=init,
    step=step,
    opt_state=lambda s: nnx.as_pure(s[1].opt_state),
    with_scale=set_scale,
    variables=lambda s: nnx.as_pure(nnx.state(s[0])),
    statistics=lambda s: nnx.as_pure(nnx.state(s[0], nnx.BatchStat)),
  )


def nnx_functional_recipe() -> Recipe:
  tx = optimizer()
  graphdef, params, stats = nnx.split(NNXNet(nnx.Rngs(0)), nnx.Param, ...)

  def loss_fn(params, stats, x, y):
    model = nnx.merge(graphdef, params, stats, copy=True)
    return mse(model(x), y), nnx.state(model, nnx.BatchStat)

  @jax.jit
  def step(state, x, y):
    params, stats, opt_state = state
    (_, new_stats), params, opt_state = tx.minimize(
      loss_fn, params, opt_state, stats, x, y, has_aux=True
    )
    stats = optax.tree.where(opt_state.should_apply, new_stats, stats)
    return params, stats, opt_state

  return Recipe(
    init=lambda: (params, stats, tx.init(params)),
    step=step,
    opt_state=lambda s: s[2],
    with_scale=lambda s, scale: (s[0], s[1], with_scale(s[2], scale)),
    variables=lambda s: nnx.as_pure(s[:2]),
    statistics=lambda s: nnx.as_pure(s[1]),
  )


# --- Haiku, `state` -------------------------------------------------------------


class HalfLinear(hk.Linear):
  """`hk.Linear` with float32 parameters and float16 compute."""


hk.mixed_precision.set_policy(HalfLinear, jmp.get_policy("p=f32,c=f16,o=f32"))


def haiku_recipe() -> Recipe:
  def forward(x, is_training):
    h = HalfLinear(8)(x)
    h = hk.BatchNorm(True, True, 0.9)(h, is_training)
    return HalfLinear(1)(jnp.tanh(h))

  net = hk.without_apply_rng(hk.transform_with_state(forward))
  tx = optimizer()
  params, hk_state = jax.jit(net.init, static_argnames="is_training")(
    jax.random.key(3), X, is_training=True
  )

  def hk_loss(params, hk_state, x, y):
    pred, new_state = net.apply(params, hk_state, x, is_training=True)
    return mse(pred, y), new_state

  @jax.jit
  def step(state, x, y):
    params, hk_state, opt_state = state
    (_, new_state), params, opt_state = tx.minimize(
      hk_loss, params, opt_state, hk_state, x, y, has_aux=True
    )
    hk_state = optax.tree.where(opt_state.should_apply, new_state, hk_state)
    return params, hk_state, opt_state

  return Recipe(
    init=lambda: (params, hk_state, tx.init(params)),
    step=step,
    opt_state=lambda s: s[2],
    with_scale=lambda s, scale: (s[0], s[1], with_scale(s[2], scale)),
    variables=lambda s: s[:2],
    statistics=lambda s: s[1],
  )


RECIPES = {
  "linen": linen_recipe,
  "nnx_stateful": nnx_stateful_recipe,
  "nnx_functional": nnx_functional_recipe,
  "haiku": haiku_recipe,
}


def bits(tree: Any) -> list[bytes]:
  return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


@dataclasses.dataclass
class Outcome:
  variables: Any  # every variable of the model, after the step
  inner_state: Any
  opt_state: Any  # the LossScaleOptimizerState
  statistics: Any


@pytest.fixture(scope="module", params=list(RECIPES))
def runs(request) -> dict[str, Outcome]:
  """One step of a recipe from the same start: normal, overflowed, NaN."""
  with jax.numpy_dtype_promotion("standard"):
    recipe = RECIPES[request.param]()

    def outcome(state):
      opt_state = recipe.opt_state(state)
      return Outcome(
        variables=recipe.variables(state),
        inner_state=opt_state.inner_state,
        opt_state=opt_state,
        statistics=recipe.statistics(state),
      )

    # Three fresh states (an NNX step changes its own); at a huge scale,
    # a step overflows.
    starts = {"normal": recipe.init(), "nan": recipe.init()}
    starts["overflow"] = recipe.with_scale(recipe.init(), HUGE)
    found = {"start": outcome(starts["normal"])}
    found["overflow_start"] = outcome(starts["overflow"])
    batches = {"normal": X, "overflow": X, "nan": NAN_X}
    for case, state in starts.items():
      found[case] = outcome(recipe.step(state, batches[case], Y))
    return found


@pytest.mark.slow
def test_a_normal_step_changes_the_parameters_and_the_statistics(runs):
  start, done = runs["start"], runs["normal"]
  assert bool(done.opt_state.should_apply)
  for old, new in zip(
    bits(start.statistics), bits(done.statistics), strict=True
  ):
    assert old != new  # every statistic moved
  assert bits(start.variables) != bits(done.variables)
  assert bits(start.inner_state) != bits(done.inner_state)


@pytest.mark.slow
def test_an_overflow_skips_the_step_and_keeps_every_variable(runs):
  start, done = runs["overflow_start"], runs["overflow"]
  assert not bool(done.opt_state.should_apply)
  (report,) = ols.skip_reports(done.opt_state)
  assert report.loss_finite and report.nonfinite  # gradients overflowed
  assert report.loss_scale == HUGE and report.next_loss_scale == HUGE / 2
  assert bits(done.variables) == bits(start.variables)
  assert bits(done.inner_state) == bits(start.inner_state)


@pytest.mark.slow
def test_a_nan_batch_skips_the_step_and_keeps_every_variable(runs):
  start, done = runs["start"], runs["nan"]
  assert not bool(done.opt_state.should_apply)
  (report,) = ols.skip_reports(done.opt_state)
  assert not report.loss_finite
  assert report.next_loss_scale == report.loss_scale  # the loss was given
  assert bits(done.variables) == bits(start.variables)
  assert bits(done.inner_state) == bits(start.inner_state)


# --- flax's DynamicScale, reproduced --------------------------------------------

GROWTH_INTERVAL = 2
TINY = float(jnp.finfo(jnp.float32).tiny)
FLAX_LIKE = ols.DynamicLossScale(
  initial_loss_scale=2.0**16,
  increment_period=GROWTH_INTERVAL + 1,
  multiplier=2.0,
  min_loss_scale=TINY,
)
PARAMS = {"w": jnp.ones(2, jnp.float32)}
INNER = optax.sgd(0.0)  # the parameters stay: a step's gradient is `scale * c`
TX = ols.LossScaleOptimizer(INNER, FLAX_LIKE)


def linear_loss(params, c):
  # Its scaled gradient overflows float32 once the scale passes 3.4e38 / c.
  return jnp.sum(params["w"] * c)


@jax.jit
def flax_run(ds, cs):
  """flax's way: its `value_and_grad`, the update, a `jnp.where`."""

  def body(carry, c):
    ds, params, inner_state = carry
    ds, is_fin, _, grads = ds.value_and_grad(linear_loss)(params, c)
    updates, new_inner = INNER.update(grads, inner_state, params)
    params = optax.tree.where(
      is_fin, optax.apply_updates(params, updates), params
    )
    inner_state = optax.tree.where(is_fin, new_inner, inner_state)
    return (ds, params, inner_state), (ds.scale, is_fin)

  carry = (ds, PARAMS, INNER.init(PARAMS))
  return jax.lax.scan(body, carry, cs)[1]


@functools.partial(jax.jit, static_argnames="pass_loss")
def ours_run(opt_state, cs, pass_loss):
  def body(carry, c):
    params, opt_state = carry
    loss, grads = ols.scaled_value_and_grad(linear_loss)(opt_state, params, c)
    extra = {"value": loss} if pass_loss else {}
    params, opt_state = TX.apply_gradients(grads, opt_state, params, **extra)
    scale = opt_state.loss_scale.current_loss_scale
    return (params, opt_state), (scale, opt_state.should_apply)

  return jax.lax.scan(body, (PARAMS, opt_state), cs)[1]


def both_runs(scale, cs, pass_loss=False):
  ds = DynamicScale(
    growth_interval=GROWTH_INTERVAL,
    scale=jnp.float32(scale),
    fin_steps=jnp.int32(0),
  )
  ours = ours_run(with_scale(TX.init(PARAMS), scale), cs, pass_loss)
  return jax.device_get(flax_run(ds, cs)), jax.device_get(ours)


def batches(*values):
  return jnp.asarray([[v, 1.0] for v in values], jnp.float32)


# The scaled gradient of BIG is finite at 2**16, and overflows at 2**17.
BIG, INF, NAN = 4e33, float("inf"), float("nan")
SEQUENCE = batches(
  *[BIG] * 4, NAN, *[BIG] * 4, INF, 1.0, 1.0, 1.0, 1.0, BIG, BIG, BIG, BIG
)


def test_flax_like_has_flax_defaults():
  assert FLAX_LIKE.initial_loss_scale == DynamicScale().scale == 2.0**16
  assert FLAX_LIKE.min_loss_scale == DynamicScale().minimum_scale
  assert ols.DynamicLossScale().initial_loss_scale == 2.0**15  # ours


def test_dynamic_scale_is_reproduced_bit_for_bit():
  (flax_scales, flax_fin), (scales, applied) = both_runs(2.0**16, SEQUENCE)
  assert scales.tobytes() == flax_scales.tobytes()
  np.testing.assert_array_equal(applied, flax_fin)
  assert set(scales.tolist()) == {2.0**15, 2.0**16, 2.0**17}
  assert not applied.all() and applied.any()


def test_dynamic_scale_is_reproduced_at_the_floor():
  infs = batches(*[INF] * len(SEQUENCE))
  (flax_scales, flax_fin), (scales, applied) = both_runs(2.0**-124, infs)
  assert scales.tobytes() == flax_scales.tobytes()
  assert scales[-1] == TINY and not applied.any() and not flax_fin.any()


def test_dynamic_scale_differs_at_the_top_as_documented():
  ones = batches(*[1.0] * len(SEQUENCE))
  (flax_scales, flax_fin), (scales, applied) = both_runs(2.0**127, ones)
  assert applied.all() and flax_fin.all()
  assert flax_scales[-1] == np.finfo(np.float32).max  # not a power of two
  assert (scales == 2.0**127).all()


def test_a_nan_loss_as_value_keeps_the_scale_where_flax_lowers_it():
  (flax_scales, flax_fin), (scales, applied) = both_runs(
    2.0**16, SEQUENCE, pass_loss=True
  )
  nan_step = 4
  assert scales[:nan_step].tobytes() == flax_scales[:nan_step].tobytes()
  upto = slice(nan_step + 1)
  np.testing.assert_array_equal(applied[upto], flax_fin[upto])  # both skip
  assert scales[nan_step] == scales[nan_step - 1]  # kept
  assert flax_scales[nan_step] == flax_scales[nan_step - 1] / 2  # lowered
