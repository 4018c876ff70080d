"""Train steps of a loss function, with and without loss scaling.

Shared by the benchmark scripts. Each factory returns `(init, step)`:
`init(params) -> opt_state` and
`step(params, opt_state, batch) -> (params, opt_state, loss)`, to be jitted
with the parameters and the optimizer state donated. All use Adam.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optax_lossscale as ols

Loss = Callable[[Any, Any], jax.Array]
Step = Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]]
Config = tuple[Callable[[Any], Any], Step]


def plain(loss_fn: Loss, lr: float) -> Config:
  """`optax.adam` without loss scaling."""
  tx = optax.adam(lr)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return tx.init, step


def apply_gradients(
  loss_fn: Loss, lr: float, loss_scale: ols.LossScale
) -> Config:
  """`ols.scaled_value_and_grad`, then `LossScaleOptimizer.apply_gradients`."""
  tx = ols.LossScaleOptimizer(optax.adam(lr), loss_scale)

  def step(params, state, batch):
    loss, grads = ols.scaled_value_and_grad(loss_fn)(state, params, batch)
    params, state = tx.apply_gradients(grads, state, params, value=loss)
    return params, state, loss

  return tx.init, step


def minimize(
  loss_fn: Loss, lr: float, loss_scale: ols.LossScale, max_retries: int = 0
) -> Config:
  """`LossScaleOptimizer.minimize` with `max_retries`."""
  tx = ols.LossScaleOptimizer(optax.adam(lr), loss_scale)

  def step(params, state, batch):
    loss, params, state = tx.minimize(
      loss_fn, params, state, batch, max_retries=max_retries
    )
    return params, state, loss

  return tx.init, step


def jmp_pattern(loss_fn: Loss, lr: float, scale: float) -> Config:
  """jmp: scale, grad, unscale, `all_finite`, `select_tree`, `adjust`."""
  import jmp

  tx = optax.adam(lr)

  def init(params):
    # jmp's loss scale is carried as its arrays: a `jmp.DynamicLossScale` in
    # the inputs or outputs of `jax.jit(...).lower` raises a TypeError.
    return tx.init(params), (jnp.float32(scale), jnp.int32(0))

  def step(params, state, batch):
    opt_state, (current, counter) = state
    loss_scale = jmp.DynamicLossScale(current, counter)
    scaled = lambda p: loss_scale.scale(loss_fn(p, batch))  # noqa: E731
    loss, grads = jax.value_and_grad(scaled)(params)
    loss, grads = loss_scale.unscale((loss, grads))
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = jmp.select_tree(finite, new_params, params)
    opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
    return (
      params,
      (opt_state, (loss_scale.loss_scale, loss_scale.counter)),
      loss,
    )

  return init, step


def flax_pattern(loss_fn: Loss, lr: float, scale: float) -> Config:
  """flax `DynamicScale.value_and_grad`, then `jnp.where` on every leaf."""
  from flax.training.dynamic_scale import DynamicScale

  tx = optax.adam(lr)

  def init(params):
    dyn_scale = DynamicScale(fin_steps=jnp.int32(0), scale=jnp.float32(scale))
    return tx.init(params), dyn_scale

  def step(params, state, batch):
    opt_state, dyn_scale = state
    dyn_scale, is_fin, loss, grads = dyn_scale.value_and_grad(loss_fn)(
      params, batch
    )
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    sel = lambda new, old: jnp.where(is_fin, new, old)  # noqa: E731
    params = jax.tree.map(sel, new_params, params)
    opt_state = jax.tree.map(sel, new_opt_state, opt_state)
    return params, (opt_state, dyn_scale), loss

  return init, step
