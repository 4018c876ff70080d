"""FP8 scales and amax histories: overwritten with their gradient, not scaled.

flax's FP8 ops keep them in the `_overwrite_with_gradient` collection, and
their "gradients" are their new values. `LossScaleOptimizer` checks them as
they are, gives them no `inner` state, assigns them on an applied step and
keeps them on a skipped one, through every route. A linen model built on
`Fp8DotGeneralOp` runs on CPU beside flax's own unscaled `TrainState` path.
The slow tests run two layers, `Fp8DirectDotGeneralOp` and more steps, and
check what docs/guides/fp8.md says of the output gradients' FP8 scales.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import core
from flax import linen as nn
from flax.linen import fp8_ops
from flax.training.train_state import TrainState

import optax_lossscale as ols

pytestmark = [
  pytest.mark.usefixtures("standard_promotion"),
  # `Fp8DotGeneralOp`, the op the issue names, is deprecated in flax 0.12.
  pytest.mark.filterwarnings("ignore::DeprecationWarning:flax.*"),
]

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
# A power of two: scaling by it commutes with float32 and FP8 rounding, so
# the unscaled gradients are flax's, bit for bit.
SCALE = 2.0**8
# A few float32 ulps, from the second step on (the first is bit for bit):
# with the unscaling multiply in the program, XLA rounds Adam's arithmetic
# differently. Plain Adam given gradients times 2**8 and their unscaling in
# one program differs from flax's path alike, without FP8, and matches ours
# bit for bit.
RTOL = 1e-6
X = jax.random.normal(jax.random.key(0), (4, 3))
# Far from the outputs: a loss scale of 2**127 overflows the gradients.
Y = 4.0 + jax.random.normal(jax.random.key(1), (4, 2))
INF_X = X.at[0, 0].set(jnp.inf)


def same(a: Any, b: Any) -> bool:
  """Bit for bit: the same structure, dtypes and values (NaNs included)."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return all(
    x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
    for x, y in pairs
  )


def masked(tree: Any) -> bool:
  """Whether `tree` has leaves and each is an `optax.MaskedNode`."""
  is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  leaves = jax.tree.leaves(tree, is_leaf=is_masked)
  return bool(leaves) and all(map(is_masked, leaves))


def named(tree: Any, name: str) -> list[jax.Array]:
  """The leaves of `tree` whose last key is `name`, in order."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return [leaf for path, leaf in leaves if path[-1].key == name]


# --- A linen model on flax's FP8 ops -----------------------------------------


class Fp8Net(nn.Module):
  op: Any = fp8_ops.Fp8DotGeneralOp
  depth: int = 1

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth - 1):
      x = nn.relu(nn.Dense(8, dot_general_cls=self.op)(x))
    return nn.Dense(2, dot_general_cls=self.op)(x)


def quick_init(model: nn.Module) -> Any:
  """The model's variables, without compiling `init`: flax's FP8 values."""
  rng = np.random.default_rng(0)

  def fill(path: Any, leaf: jax.ShapeDtypeStruct) -> jax.Array:
    name = path[-1].key
    if name == "kernel":
      values = rng.normal(size=leaf.shape) / np.sqrt(leaf.shape[0])
      return jnp.asarray(values, leaf.dtype)
    return jnp.full(leaf.shape, name.endswith("_scale"), leaf.dtype)

  shapes = jax.eval_shape(model.init, jax.random.key(0), X)
  return jax.tree_util.tree_map_with_path(fill, shapes)


@dataclasses.dataclass
class Run:
  """flax's unscaled `TrainState` step and ours, each compiled once."""

  variables: Any
  flax_state: TrainState
  flax_step: Any  # (state, x, y) -> state
  tx: ols.LossScaleOptimizer
  opt_state: ols.LossScaleOptimizerState
  step: Any  # (variables, opt_state, x, y) -> (variables, opt_state)


@functools.cache
def run(
  op: Any = fp8_ops.Fp8DotGeneralOp, depth: int = 1, route: str = "minimize"
) -> Run:
  model = Fp8Net(op, depth)
  variables = quick_init(model)

  def loss(variables, x, y):
    return jnp.mean((model.apply(variables, x) - y) ** 2)

  flax_state = TrainState.create(
    apply_fn=model.apply, params=variables, tx=optax.adam(1e-2)
  )

  @jax.jit
  def flax_step(state, x, y):
    return state.apply_gradients(grads=jax.grad(loss)(state.params, x, y))

  tx = ols.LossScaleOptimizer(optax.adam(1e-2), ols.DynamicLossScale(SCALE))

  @jax.jit
  def step(variables, opt_state, x, y):
    if route == "minimize":
      _, variables, opt_state = tx.minimize(loss, variables, opt_state, x, y)
      return variables, opt_state
    value, grads = ols.scaled_value_and_grad(loss)(opt_state, variables, x, y)
    return tx.apply_gradients(grads, opt_state, variables, value=value)

  return Run(variables, flax_state, flax_step, tx, tx.init(variables), step)


FORWARD = [
  "input_scale",
  "input_amax_history",
  "kernel_scale",
  "kernel_amax_history",
]


def check_matches_flax(r: Run, steps: int) -> None:
  """`steps` steps of ours against `steps` of flax's unscaled path."""
  state, variables, opt_state = r.flax_state, r.variables, r.opt_state
  for t in range(1, steps + 1):
    state = r.flax_step(state, X, Y)
    variables, opt_state = r.step(variables, opt_state, X, Y)
    flax = state.params
    assert int(opt_state.skipped_steps) == 0
    assert float(opt_state.loss_scale()) == SCALE
    rtol = 0 if t == 1 else RTOL
    chex.assert_trees_all_close(variables["params"], flax["params"], rtol=rtol)
    for name in FORWARD:  # forward scales and amax histories: flax's
      chex.assert_trees_all_close(
        named(variables, name), named(flax, name), rtol=rtol
      )
    # The output gradients are scaled, so their amax histories hold SCALE
    # times flax's amax. The FP8 scales computed from them are SCALE times
    # flax's too (after the first step, which keeps the initial 1), and the
    # quantized gradients are flax's.
    scaled = [SCALE * x for x in named(flax, "output_grad_amax_history")]
    ours = named(variables, "output_grad_amax_history")
    chex.assert_trees_all_close(ours, scaled, rtol=rtol)
    scaled = [
      (SCALE if t > 1 else 1) * x for x in named(flax, "output_grad_scale")
    ]
    ours = named(variables, "output_grad_scale")
    chex.assert_trees_all_close(ours, scaled, rtol=rtol)
    for history in named(flax, "output_grad_amax_history"):
      assert np.count_nonzero(history) == t  # newest first, then rolled


def test_fp8_model_reaches_flax_unscaled_parameters_and_forward_scales():
  check_matches_flax(run(), steps=3)


@pytest.mark.parametrize("overflow", ["inf in the batch", "scale 2**127"])
def test_fp8_model_overflow_leaves_every_variable_unchanged(overflow):
  r = run()
  variables, opt_state = r.step(r.variables, r.opt_state, X, Y)
  x = INF_X if overflow == "inf in the batch" else X
  if overflow == "scale 2**127":
    loss_scale = dataclasses.replace(
      opt_state.loss_scale, current_loss_scale=jnp.float32(2.0**127)
    )
    opt_state = opt_state._replace(loss_scale=loss_scale)
  new_variables, new_state = r.step(variables, opt_state, x, Y)
  assert int(new_state.skipped_steps) == 1
  assert same(new_variables, variables)
  assert same(new_state.inner_state, opt_state.inner_state)
  assert float(new_state.loss_scale()) == float(opt_state.loss_scale()) / 2


def test_fp8_model_an_inf_input_reaches_only_an_amax_history():
  # FP8 clips the inf, so the loss and every parameter's gradient stay
  # finite: the new input amax history alone holds it. flax's `TrainState`
  # writes it, and the input scale then stays frozen until it rolls out.
  r = run()
  flax = r.flax_step(r.flax_state, INF_X, Y).params
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(flax["params"]))
  (history,) = named(flax, "input_amax_history")
  assert history[0] == np.inf
  # `LossScaleOptimizer` checks the overwritten leaves too, and skips.
  _, opt_state = r.step(r.variables, r.opt_state, INF_X, Y)
  (report,) = ols.skip_reports(opt_state)
  assert report.loss_finite
  assert report.nonfinite == (
    f"['{OWG}']['Dense_0']['Fp8DotGeneralOp_0']['input_amax_history']",
  )


def test_fp8_model_inner_state_holds_the_parameters_only():
  r = run()
  (adam, _) = r.opt_state.inner_state
  trained = jax.tree.leaves(r.variables["params"])
  assert len(jax.tree.leaves(r.opt_state.inner_state)) == 1 + 2 * len(trained)
  assert masked(adam.mu[OWG])
  assert masked(adam.nu[OWG])


@pytest.mark.slow
@pytest.mark.parametrize(
  "op", [fp8_ops.Fp8DotGeneralOp, fp8_ops.Fp8DirectDotGeneralOp]
)
@pytest.mark.parametrize("route", ["minimize", "apply_gradients"])
def test_fp8_two_layers_reach_flax_unscaled_path_over_more_steps(op, route):
  check_matches_flax(run(op, depth=2, route=route), steps=6)


@pytest.mark.slow
def test_quick_init_gives_flax_initial_fp8_variables():
  model = Fp8Net(depth=2)
  variables = jax.jit(model.init)(jax.random.key(0), X)
  assert same(quick_init(model)[OWG], variables[OWG])


@pytest.mark.slow
def test_output_gradients_clip_on_the_first_step_and_after_the_scale_grows():
  # What docs/guides/fp8.md says of the output gradients' FP8 scales.
  model = Fp8Net(depth=2)

  @jax.jit
  def grads(variables, y, scale):
    loss = lambda v: scale * jnp.mean((model.apply(v, X) - y) ** 2)  # noqa: E731
    scaled = jax.grad(loss)(variables)
    return jax.tree.map(lambda g: g / scale, scaled["params"]), scaled[OWG]

  def unscaled(variables, y, scale):
    return grads(variables, y, jnp.float32(scale))[0]

  # The first step quantizes with the initial scale, 1: scaled output
  # gradients above 57344 are clipped. Far from the outputs, the last
  # layer's are about 10.
  variables, far = quick_init(model), Y + 40.0
  assert same(unscaled(variables, far, 2.0**8), unscaled(variables, far, 1))
  assert not same(
    unscaled(variables, far, 2.0**15), unscaled(variables, far, 1)
  )
  # After a step at 2**8, the histories hold amax at that scale.
  variables = {**variables, OWG: grads(variables, Y, jnp.float32(2.0**8))[1]}
  at_2_8 = unscaled(variables, Y, 2.0**8)
  assert same(unscaled(variables, Y, 2.0**7), at_2_8)  # a power of two down
  assert not same(unscaled(variables, Y, 2.0**9), at_2_8)  # the top clipped


# --- Every route, on a small tree --------------------------------------------


@jax.custom_vjp
def observe(x: jax.Array, history: jax.Array) -> jax.Array:
  """`x`; its "gradient" for `history` is the history with max |x| first.

  What flax's FP8 ops do, without the quantization.
  """
  return x


def _observe_fwd(x, history):
  amax = jnp.max(jnp.abs(x)).astype(history.dtype)
  return x, jnp.roll(history, -1).at[0].set(amax)


def _observe_bwd(new_history, g):
  return g, new_history


observe.defvjp(_observe_fwd, _observe_bwd)


def small_tree() -> Any:
  return {
    "params": {"w": jnp.asarray([1.0, -2.0, 3.0]), "b": jnp.asarray([0.5])},
    OWG: {"dense": {"scale": jnp.ones(1), "amax_history": jnp.zeros(4)}},
  }


def small_loss(params: Any, x: jax.Array) -> jax.Array:
  h = observe(x, params[OWG]["dense"]["amax_history"])
  h = jnp.clip(h, -8.0, 8.0)  # as FP8 saturates
  scale = jnp.max(jnp.abs(h))  # a new "scale" for the next step
  h = h + 0.0 * observe(scale, params[OWG]["dense"]["scale"])
  return jnp.sum((params["params"]["w"] * h + params["params"]["b"]) ** 2)


ROUTES = ["update", "gradient_transformation", "apply_gradients", "minimize"]


@functools.cache
def small_routes(tx: ols.LossScaleOptimizer) -> Any:
  """Each route's step on `small_tree`, compiled together once."""

  @jax.jit
  def steps(params, state, x):
    value, grads = ols.scaled_value_and_grad(small_loss)(state, params, x)
    out = {}
    for route in ROUTES[:2]:
      transform = tx if route == "update" else tx.gradient_transformation()
      updates, new_state = transform.update(grads, state, params, value=value)
      out[route] = optax.apply_updates(params, updates), new_state
    out["apply_gradients"] = tx.apply_gradients(
      grads, state, params, value=value
    )
    out["minimize"] = tx.minimize(small_loss, params, state, x)[1:]
    return out

  return steps


MOMENTUM = ols.LossScaleOptimizer(
  optax.sgd(0.5, momentum=0.5), ols.DynamicLossScale(SCALE)
)


def test_every_route_assigns_overwritten_leaves_and_trains_the_rest():
  params = small_tree()
  x = jnp.asarray([0.5, -16.0, 2.0])
  out = small_routes(MOMENTUM)(params, MOMENTUM.init(params), x)
  # The unscaled gradients, by hand: the clipped x is [0.5, -8, 2], and
  # w * x + b is [1, 16.5, 6.5]. sgd's first step is -0.5 times them.
  grads = {"w": jnp.asarray([1.0, -264.0, 26.0]), "b": jnp.asarray([48.0])}
  trained = {"w": jnp.asarray([0.5, 130.0, -10.0]), "b": jnp.asarray([-23.5])}
  # The new history has max |x|, before the clip, first; the new scale is 8.
  fp8 = {"dense": {"scale": jnp.asarray([8.0]), "amax_history": jnp.zeros(4)}}
  fp8["dense"]["amax_history"] = fp8["dense"]["amax_history"].at[0].set(16.0)
  for route in ROUTES:
    new_params, state = out[route]
    assert int(state.skipped_steps) == 0, route
    assert same(new_params["params"], trained), route
    if route in ("update", "gradient_transformation"):
      # The update is new - old: `optax.apply_updates` rounds once more.
      chex.assert_trees_all_close(new_params[OWG], fp8, rtol=1e-6)
    else:
      assert same(new_params[OWG], fp8), route
    (inner, _) = state.inner_state
    assert masked(inner.trace[OWG])
    assert same(inner.trace["params"], grads), route


def test_every_route_keeps_overwritten_leaves_on_a_skipped_step():
  # The inf reaches the new amax history only (the clip keeps it from the
  # parameters' gradients), and is enough to skip the step.
  params = small_tree()
  state = MOMENTUM.init(params)
  x = jnp.asarray([0.5, -jnp.inf, 2.0])
  out = small_routes(MOMENTUM)(params, state, x)
  for route in ROUTES:
    new_params, new_state = out[route]
    assert int(new_state.skipped_steps) == 1, route
    assert same(new_params, params), route
    assert same(new_state.inner_state, state.inner_state), route


def test_overwritten_leaves_are_checked_as_they_are_not_unscaled():
  # Below a loss scale of 1, unscaling multiplies: 60000 in float16 would
  # become inf. An overwritten leaf is new value, never scaled: it is checked
  # and assigned as it is.
  loss_scale = ols.DynamicLossScale(2.0**-4, min_loss_scale=2.0**-10)
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), loss_scale)
  params = {
    "params": {"w": jnp.ones(2, jnp.float16)},
    OWG: {"amax_history": jnp.zeros(2, jnp.float16)},
  }
  grads = {
    "params": {"w": jnp.full(2, 2.0**-4, jnp.float16)},
    OWG: {"amax_history": jnp.asarray([60000.0, 0.0], jnp.float16)},
  }
  new, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
  assert int(state.skipped_steps) == 0
  assert same(new[OWG], grads[OWG])
  assert same(new["params"], {"w": jnp.zeros(2, jnp.float16)})


def test_adam_has_no_state_for_overwritten_leaves():
  tx = ols.LossScaleOptimizer(optax.adam(1e-3), ols.DynamicLossScale())
  params = small_tree()
  inner = tx.init(params).inner_state
  trained = len(jax.tree.leaves(params["params"]))
  assert len(jax.tree.leaves(inner)) == 1 + 2 * trained
  assert same(inner[0].mu["params"], optax.tree.zeros_like(params["params"]))


@pytest.mark.parametrize("freeze", [False, True], ids=["dict", "FrozenDict"])
def test_the_default_finds_the_collection_in_a_frozen_dict(freeze):
  params = core.freeze(small_tree()) if freeze else small_tree()
  tx = ols.LossScaleOptimizer(optax.adam(1e-3), ols.DynamicLossScale())
  assert len(jax.tree.leaves(tx.init(params).inner_state)) == 1 + 2 * 2


# --- The mask, for other frameworks' names ------------------------------------


def te_tree() -> Any:
  """TransformerEngine's names: FP8 metadata under `fp8_metas`."""
  return {
    "params": {"w": jnp.ones(3)},
    "fp8_metas": {"scale": jnp.ones(1), "amax_history": jnp.zeros(4)},
  }


def in_fp8_metas(path: tuple[Any, ...]) -> bool:
  return any(getattr(key, "key", None) == "fp8_metas" for key in path)


MASKS = {
  "function of the path": in_fp8_metas,
  "prefix": {"params": False, "fp8_metas": True},
  "whole tree": {
    "params": {"w": False},
    "fp8_metas": {"scale": True, "amax_history": True},
  },
}


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
def test_a_mask_selects_the_overwritten_leaves(mask):
  tx = ols.LossScaleOptimizer(
    optax.adam(1e-3), ols.DynamicLossScale(), overwrite_with_gradient=mask
  )
  params = te_tree()
  (adam, _) = tx.init(params).inner_state
  assert masked(adam.mu["fp8_metas"])
  assert len(jax.tree.leaves(adam)) == 1 + 2 * 1


def test_a_mask_function_assigns_the_leaves_it_selects():
  tx = ols.LossScaleOptimizer(
    optax.sgd(1.0), ols.FixedLossScale(4), overwrite_with_gradient=in_fp8_metas
  )
  params = te_tree()
  grads = {
    "params": {"w": jnp.full(3, 4.0)},
    "fp8_metas": {"scale": jnp.full(1, 0.5), "amax_history": jnp.ones(4)},
  }
  new, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
  assert same(new["fp8_metas"], grads["fp8_metas"])
  assert same(new["params"], {"w": jnp.zeros(3)})


def test_the_default_ignores_other_names():
  tx = ols.LossScaleOptimizer(optax.adam(1e-3), ols.DynamicLossScale())
  inner = tx.init(te_tree()).inner_state
  assert len(jax.tree.leaves(inner)) == 1 + 2 * 3


BAD_MASKS = {
  "not bools": (lambda path: 1, TypeError),
  "an array": (lambda path: jnp.asarray(True), TypeError),
  "a string tree": ({"params": "no", "fp8_metas": "yes"}, TypeError),
  "another structure": ({"params": False, "metas": True}, ValueError),
}


@pytest.mark.parametrize(
  ("mask", "error"), BAD_MASKS.values(), ids=BAD_MASKS.keys()
)
def test_a_bad_mask_names_the_argument(mask, error):
  tx = ols.LossScaleOptimizer(
    optax.sgd(1.0), ols.DynamicLossScale(), overwrite_with_gradient=mask
  )
  with pytest.raises(error, match="overwrite_with_gradient"):
    tx.init(te_tree())


def test_update_without_params_refuses_overwritten_leaves():
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), ols.DynamicLossScale())
  params = small_tree()
  with pytest.raises(ValueError, match="params"):
    jax.jit(tx.update)(params, tx.init(params))


# --- Without such leaves, nothing changes -------------------------------------


def test_without_the_collection_the_state_and_updates_are_as_before():
  sgd = optax.sgd(0.5, momentum=0.5)
  tx = ols.LossScaleOptimizer(sgd, ols.FixedLossScale(SCALE))
  params = {"params": {"w": jnp.asarray([1.0, -2.0])}, "b": jnp.ones(1)}
  state = tx.init(params)
  assert same(state.inner_state, sgd.init(params))
  grads = {"params": {"w": jnp.asarray([3.0, 1.0])}, "b": jnp.ones(1)}
  scaled = jax.tree.map(lambda g: g * SCALE, grads)
  updates, state = jax.jit(tx.update)(scaled, state)  # no params needed
  assert same(updates, jax.tree.map(lambda g: -0.5 * g, grads))
  (trace, _) = state.inner_state
  assert same(trace.trace, grads)
