"""Gradient accumulation: `LossScaleOptimizer(optax.MultiSteps(...))`.

Each micro-batch is checked before it is accumulated: a non-finite one is
dropped alone and lowers the scale at once; finite ones move the scale once
per window, when the window's optimizer step is taken.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

pytestmark = pytest.mark.usefixtures("standard_promotion")

K = 3  # micro-batches per window
FLAGS = np.random.default_rng(0).random(30) > 0.25


def _reference(flags, *, hysteresis, consecutive, scale=2.0**10, period=2):
  """(scale, num_good_steps) after each micro-batch, written out apart.

  A finite micro-batch is a finite step of the loss scale only when it
  completes its window; a non-finite one is a non-finite step at once, and
  is not counted in the window.
  """
  good, bad, mini, out = 0, 0, 0, []
  for finite in flags:
    if finite:
      mini = (mini + 1) % K
      if mini == 0:
        good += 1
        if consecutive:
          bad = 0
        if good >= period:
          scale, good, bad = scale * 2, 0, 0
    else:
      good, bad = 0, min(bad + 1, hysteresis)
      if bad == hysteresis:
        scale = max(scale / 2, 1.0)
    out.append((scale, good))
  return out


def _inner(form):
  inner = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=K)
  return inner if form == "MultiSteps" else inner.gradient_transformation()


@pytest.mark.parametrize(
  ("form", "hysteresis", "consecutive", "value"),
  [
    ("MultiSteps", 1, False, False),
    ("gradient_transformation", 2, False, True),
    ("MultiSteps", 2, True, True),
  ],
)
def test_the_scale_moves_once_per_window_and_at_once_on_an_overflow(
  form, hysteresis, consecutive, value
):
  ls = ols.DynamicLossScale(
    2.0**10, 2, hysteresis=hysteresis, consecutive_hysteresis=consecutive
  )
  tx = ols.LossScaleOptimizer(_inner(form), ls)
  reference = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=K)
  reference_step = jax.jit(reference.update)
  params = expected = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  state, ref_state = tx.init(params), reference.init(params)
  step = jax.jit(tx.apply_gradients)
  extra = dict(value=jnp.float32(1.0)) if value else {}
  seen = []
  for i, finite in enumerate(FLAGS):
    grads = {"w": jnp.full(3, 0.25 + i), "b": jnp.ones(2)}
    scale = state.loss_scale()
    scaled = jax.tree.map(lambda g, s=scale: g * s, grads)
    if not finite:
      scaled["w"] = scaled["w"].at[1].set(jnp.inf)
    acc = state.inner_state.acc_grads
    params, state = step(scaled, state, params, **extra)
    if finite:
      updates, ref_state = reference_step(grads, ref_state, expected)
      expected = optax.apply_updates(expected, updates)
    else:  # dropped alone: the accumulator is untouched
      chex.assert_trees_all_equal(state.inner_state.acc_grads, acc)
    seen.append(
      (float(state.loss_scale()), int(state.loss_scale.num_good_steps))
    )
  want = _reference(FLAGS, hysteresis=hysteresis, consecutive=consecutive)
  assert seen == want
  scales = [s for s, _ in want]
  assert any(b > a for a, b in zip(scales, scales[1:], strict=False))
  assert any(b < a for a, b in zip(scales, scales[1:], strict=False))
  chex.assert_trees_all_close(params, expected, rtol=1e-6)
  chex.assert_trees_all_close(state.inner_state, ref_state, rtol=1e-6)
  assert int(state.skipped_steps) == int((~FLAGS).sum())


def _float16_loss(p, x):
  """Its gradient is x times the scale in float16: inf above 65504."""
  w = p["w"].astype(jnp.float16)
  return jnp.sum(w * x.astype(jnp.float16)).astype(jnp.float32)


@functools.cache
def _minimize():
  """An accumulating optimizer and its `minimize` step, compiled once."""
  tx = ols.LossScaleOptimizer(
    _inner("MultiSteps"), ols.DynamicLossScale(2.0**10, 2)
  )
  step = jax.jit(
    lambda p, s, x: tx.minimize(_float16_loss, p, s, x, max_retries=1)
  )
  return tx, step


def test_minimize_with_retries_moves_the_scale_once_per_window():
  tx, step = _minimize()
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  # A batch of 1000 overflows at 2**7 and above: from 2**10, the retry at
  # 2**9 overflows too, the batch is dropped and the scale drops to 2**8.
  # Finite batches then move the scale once per window of three (the
  # dropped batch is not counted in its window).
  seen = []
  for x in [1.0, 1000.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]:
    _, params, state = step(params, state, jnp.full(2, x))
    seen.append(float(state.loss_scale()))
  assert seen == [2.0**10] + [2.0**8] * 5 + [2.0**9] * 2
  assert int(state.skipped_steps) == 1 and int(state.retries) == 1


def test_a_retried_micro_batch_in_an_open_window_follows_the_one_rule():
  tx, step = _minimize()
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  # 100 overflows at 2**10 and fits at 2**9: retried once and applied; with
  # hysteresis=1 the scale drops to 2**9 though the window stays open.
  _, params, state = step(params, state, jnp.full(2, 1.0))
  _, params, state = step(params, state, jnp.full(2, 100.0))
  assert int(state.retries) == 1 and bool(state.should_apply)
  assert int(state.inner_state.mini_step) == 2
  assert float(state.loss_scale()) == 2.0**9
  assert int(state.loss_scale.num_bad_steps) == 1


def test_multisteps_outside_checks_the_accumulated_gradients_once_per_window():
  # The other order: MultiSteps accumulates the scaled gradients and commits
  # the optimizer's state once per window: the scale moves per window.
  tx = optax.MultiSteps(
    ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0, 1)),
    every_k_schedule=2,
  )
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  scales = []
  for _ in range(4):
    scale = state.inner_opt_state.loss_scale()
    updates, state = step({"w": jnp.full(2, 0.5) * scale}, state, params)
    params = optax.apply_updates(params, updates)
    scales.append(float(state.inner_opt_state.loss_scale()))
  assert scales == [8.0, 16.0, 16.0, 32.0]
  # Its pitfall, as the accumulation guide says: one non-finite micro-batch
  # poisons the accumulator for good (Optax resets it by multiplying by
  # zero), so every later window is skipped.
  for i in range(6):
    grads = {"w": jnp.array([jnp.nan, 1.0] if i == 0 else [1.0, 1.0])}
    _, state = step(grads, state, params)
  assert int(state.inner_opt_state.skipped_steps) == 3


# `minimize` passes its loss through `apply_gradients`.
@pytest.mark.parametrize("entry", ["update", "minimize"])
def test_extra_args_reach_the_optimizer_inside_multisteps(entry):
  def inner():  # `reduce_on_plateau` needs `value=`: it fails without it
    plateau = optax.contrib.reduce_on_plateau(patience=1)
    return optax.MultiSteps(optax.chain(optax.sgd(0.5), plateau), 2)

  tx = ols.LossScaleOptimizer(inner(), ols.DynamicLossScale(2.0**4, 1000))
  reference = inner()

  def loss(p, x):
    return jnp.sum((p["w"] * x) ** 2)

  @jax.jit
  def reference_step(params, state, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    updates, state = reference.update(grads, state, params, value=value)
    return optax.apply_updates(params, updates), state

  @jax.jit
  def step(params, state, x):
    if entry == "minimize":
      _, params, state = tx.minimize(loss, params, state, x)
      return params, state
    value, grads = ols.scaled_value_and_grad(loss)(state, params, x)
    updates, state = tx.update(grads, state, params, value=value)
    return optax.apply_updates(params, updates), state

  params = expected = {"w": jnp.array([1.0, -2.0])}
  state, ref_state = tx.init(params), reference.init(expected)
  for i in range(6):
    x = jnp.full(2, 1.0 + 0.25 * i)
    params, state = step(params, state, x)
    expected, ref_state = reference_step(expected, ref_state, x)
  chex.assert_trees_all_close(params, expected, rtol=1e-6)
  chex.assert_trees_all_close(state.inner_state, ref_state, rtol=1e-6)
  # The losses rise, so the plateau lowered the learning rate.
  assert float(state.inner_state.inner_opt_state[1].scale) < 1.0
