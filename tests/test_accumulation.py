"""Gradient accumulation: the loss scale moves once per optimizer step."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

K = 3  # micro-batches per window


def _reference(flags, *, k, period, hysteresis, scale, consecutive=False):
  """The scale after each micro-batch, written out independently.

  A finite micro-batch is an optimizer step only when it completes its
  window; a non-finite one is a (skipped) step at once and is not counted in
  the window.
  """
  good, budget, mini, scales = 0, hysteresis, 0, []
  for finite in flags:
    if finite:
      mini = (mini + 1) % k
      if mini == 0:
        good += 1
        if consecutive:
          budget = hysteresis
        if good >= period:
          scale, good, budget = scale * 2, 0, hysteresis
    else:
      good, budget = 0, max(budget - 1, 0)
      if budget == 0:
        scale = max(scale / 2, 1.0)
    scales.append(scale)
  return scales


def _inner(form):
  inner = optax.MultiSteps(optax.adam(0.1), every_k_schedule=K)
  return inner if form == "MultiSteps" else inner.gradient_transformation()


def _run(form, flags, *, hysteresis=1, value=False, consecutive=False):
  tx = ols.LossScaleOptimizer(
    _inner(form),
    ols.DynamicLossScale(
      2.0**10,
      2,
      hysteresis=hysteresis,
      consecutive_hysteresis=consecutive,
    ),
  )
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients)
  scales, accumulated = [], []
  for i, finite in enumerate(flags):
    scale = ols.get_loss_scale(state)()
    grads = {"w": jnp.full(3, 0.25 + i) * scale, "b": jnp.ones(2) * scale}
    if not finite:
      grads["w"] = grads["w"].at[1].set(jnp.inf)
    extra = dict(value=jnp.float32(1.0)) if value else {}
    params, state = step(grads, state, params, **extra)
    scales.append(float(ols.get_loss_scale(state)()))
    accumulated.append(state.inner_state.acc_grads)
  return scales, params, state, accumulated


FLAGS = np.random.default_rng(0).random(60) > 0.25


@pytest.mark.parametrize(
  ("hysteresis", "consecutive"), [(1, False), (2, False), (2, True)]
)
@pytest.mark.parametrize("value", [False, True])
def test_scale_moves_once_per_window_in_both_forms(
  hysteresis, value, consecutive, standard_promotion
):
  expected = _reference(
    FLAGS,
    k=K,
    period=2,
    hysteresis=hysteresis,
    scale=2.0**10,
    consecutive=consecutive,
  )
  a = _run(
    "MultiSteps",
    FLAGS,
    hysteresis=hysteresis,
    value=value,
    consecutive=consecutive,
  )
  assert a[0] == expected
  b = _run(
    "gradient_transformation",
    FLAGS,
    hysteresis=hysteresis,
    value=value,
    consecutive=consecutive,
  )
  assert b[0] == expected
  chex.assert_trees_all_equal(a[1], b[1])  # params
  chex.assert_trees_all_equal(a[2].loss_scale, b[2].loss_scale)
  chex.assert_trees_all_equal(a[2].inner_state, b[2].inner_state)
  steps = list(zip(expected, expected[1:], strict=False))
  assert any(b > a for a, b in steps) and any(b < a for a, b in steps)


def test_good_step_counter_advances_only_when_a_window_completes(
  standard_promotion,
):
  _, _, state, _ = _run("MultiSteps", [True] * (K - 1))
  assert int(state.loss_scale.num_good_steps) == 0
  _, _, state, _ = _run("MultiSteps", [True] * K)
  assert int(state.loss_scale.num_good_steps) == 1
  scales, *_ = _run("MultiSteps", [True] * (2 * K))
  assert scales == [2.0**10] * (2 * K - 1) + [2.0**11]


def test_a_bad_micro_batch_is_dropped_alone_and_the_window_goes_on(
  standard_promotion,
):
  flags = [True, False, True, True]  # the window: micro-batches 0, 2 and 3
  scales, params, state, accumulated = _run("MultiSteps", flags)
  assert scales == [2.0**10, 2.0**9, 2.0**9, 2.0**9]  # backs off at once
  chex.assert_trees_all_equal(accumulated[1], accumulated[0])  # untouched
  assert int(state.inner_state.gradient_step) == 1
  assert int(state.skipped_steps) == 1
  # One Adam step on the mean of the three finite micro-batches.
  mean = {"w": jnp.full(3, (0.25 + 2.25 + 3.25) / 3), "b": jnp.ones(2)}
  expected = optax.apply_updates(
    {"w": jnp.ones(3), "b": jnp.zeros(2)},
    optax.adam(0.1).update(mean, optax.adam(0.1).init(mean))[0],
  )
  chex.assert_trees_all_close(params, expected, rtol=1e-6)


@pytest.mark.parametrize("form", ["MultiSteps", "gradient_transformation"])
def test_minimize_moves_the_scale_once_per_window(form, standard_promotion):
  tx = ols.LossScaleOptimizer(_inner(form), ols.DynamicLossScale(2.0**10, 2))
  params = {"w": jnp.ones(2)}

  def loss(p, x):
    return jnp.sum(p["w"].astype(jnp.float16) * x.astype(jnp.float16)).astype(
      jnp.float32
    )

  step = jax.jit(lambda p, s, x: tx.minimize(loss, p, s, x, max_retries=1))
  state = tx.init(params)
  flags = FLAGS[:40]
  scales = []
  for finite in flags:
    x = jnp.full(2, 1.0 if finite else 1000.0)
    _, params, state = step(params, state, x)
    scales.append(float(ols.get_loss_scale(state)()))
  # The gradient is x times the scale, in float16: 1000 overflows at a scale
  # of 128 and above. An overflowed batch is retried once at half the scale
  # (the good-step counter reset); if that overflows too, it is dropped and
  # the scale halves again.
  expected, scale, good, mini = [], 2.0**10, 0, 0
  for finite in flags:
    x = 1.0 if finite else 1000.0
    if x * scale > 65504:
      scale, good = scale / 2, 0
      if x * scale > 65504:
        scale = scale / 2
        expected.append(scale)
        continue
    mini = (mini + 1) % K
    if mini == 0:
      good += 1
      if good >= 2:
        scale, good = scale * 2, 0
    expected.append(scale)
  assert scales == expected
  assert int(state.retries) > int(state.skipped_steps) > 0


def test_multisteps_outside_checks_the_accumulated_gradients_once_per_window(
  standard_promotion,
):
  # The other order: Optax's MultiSteps accumulates the scaled gradients and
  # commits the wrapped optimizer's state once per window, so the scale moves
  # per window, from the accumulated gradients.
  tx = optax.MultiSteps(
    ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0, 1)),
    every_k_schedule=2,
  )
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  scales = []
  for _ in range(4):
    scale = ols.get_loss_scale(state)()
    updates, state = step({"w": jnp.full(2, 0.5) * scale}, state, params)
    params = optax.apply_updates(params, updates)
    scales.append(float(ols.get_loss_scale(state)()))
  assert scales == [8.0, 16.0, 16.0, 32.0]
  # Its pitfall, as the accumulation guide says: one non-finite micro-batch poisons the
  # accumulator for good (Optax resets it by multiplying by zero), so every
  # later window is skipped.
  for _ in range(6):
    grads = {"w": jnp.array([jnp.nan, 1.0])} if _ == 0 else {"w": jnp.ones(2)}
    _, state = step(grads, state, params)
  assert int(state.inner_opt_state.skipped_steps) == 3


def _plateau_inner():
  # `reduce_on_plateau` requires `value=`: it fails without it.
  return optax.MultiSteps(
    optax.chain(optax.sgd(0.5), optax.contrib.reduce_on_plateau(patience=1)),
    every_k_schedule=2,
  )


@pytest.mark.parametrize("form", ["MultiSteps", "gradient_transformation"])
@pytest.mark.parametrize("method", ["update", "apply_gradients", "minimize"])
def test_extra_args_reach_the_optimizer_inside_multisteps(
  form, method, standard_promotion
):
  inner = _plateau_inner()
  tx = ols.LossScaleOptimizer(
    inner if form == "MultiSteps" else inner.gradient_transformation(),
    ols.DynamicLossScale(2.0**4, 1000),
  )
  reference = _plateau_inner()

  def loss(p, x):
    return jnp.sum((p["w"] * x) ** 2)

  params = expected = {"w": jnp.array([1.0, -2.0])}
  state, ref_state = tx.init(params), reference.init(expected)

  @jax.jit
  def step(params, state, x):
    if method == "minimize":
      _, params, state = tx.minimize(loss, params, state, x)
      return params, state
    value, grads = ols.scaled_value_and_grad(loss)(state, params, x)
    if method == "apply_gradients":
      return tx.apply_gradients(grads, state, params, value=value)
    updates, state = tx.update(grads, state, params, value=value)
    return optax.apply_updates(params, updates), state

  for i in range(6):
    x = jnp.full(2, 1.0 + 0.25 * i)
    params, state = step(params, state, x)
    value, grads = jax.value_and_grad(loss)(expected, x)
    updates, ref_state = reference.update(
      grads, ref_state, expected, value=value
    )
    expected = optax.apply_updates(expected, updates)
  chex.assert_trees_all_close(params, expected, rtol=1e-6)
  chex.assert_trees_all_close(state.inner_state, ref_state, rtol=1e-6)
  # The losses rise, so the plateau lowered the learning rate.
  assert float(state.inner_state.inner_opt_state[1].scale) < 1.0
