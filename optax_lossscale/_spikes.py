"""The spike rule: skip a step whose norm or loss stands far above recent ones.

OLMo-core's `SkipStepOptimizer`, and Levanter's and MaxText's ports.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class SpikeWindow(NamedTuple):
  """The recent finite steps' global norms and losses, a ring, kept in
  `LossScaleOptimizerState.spikes`.

  Attributes:
    values: float32, shape `(2, spike_window)`: row 0 the norms, row 1 the
      losses (0 where no loss was given).
    loss_given: per slot, whether its step was given a loss (bool): the
      loss row's statistics read only those.
    written: how many values were written, less `spike_window` each time it
      reaches twice that (int32): the window holds `min(written,
      spike_window)` values, and the next goes to `written % spike_window`.
    loss_sum: under accumulation, the sum of the losses of the micro-batches
      the open window kept (float32); 0 otherwise.
  """

  values: jax.Array
  loss_given: jax.Array
  written: jax.Array
  loss_sum: jax.Array

  @classmethod
  def empty(cls, length: int) -> SpikeWindow:
    """A window of `length` values that holds none."""
    return cls(
      values=jnp.zeros((2, length), jnp.float32),
      loss_given=jnp.zeros((length,), jnp.bool_),
      written=jnp.zeros((), jnp.int32),
      loss_sum=jnp.zeros((), jnp.float32),
    )


class Spike(NamedTuple):
  """The rule's verdict on one step.

  `found`: whether the step is a spike (bool). `spiked`: which of the norm
  and the loss is (bool, shape `(2,)`). `stats`: per row (norm, loss), the
  step's value, the window's mean and standard deviation, and the threshold
  (float32, shape `(2, 4)`).
  """

  found: jax.Array
  spiked: jax.Array
  stats: jax.Array


def judge(
  window: SpikeWindow,
  value: jax.Array,
  judged: jax.Array,
  sigmas: float,
  loss_given: bool,
) -> Spike:
  """Whether `value` (the norm and the loss, float32 `(2,)`) spikes: it
  exceeds the window's mean by more than `sigmas` sample standard
  deviations (at least a millionth of the mean and 1e-6, so that a constant
  window does not skip a rounding error), once half the window holds values; only
  where `judged`. The loss is judged only when given, against the losses
  given."""
  length = window.values.shape[-1]
  # The slots below `min(written, length)` hold values.
  filled = jnp.arange(length, dtype=jnp.int32) < window.written
  held = jnp.stack([filled, filled & window.loss_given]).astype(jnp.float32)
  n = held.sum(-1)
  mean = (window.values * held).sum(-1) / jnp.maximum(n, 1.0)
  spread = jnp.square((window.values - mean[:, None]) * held).sum(-1)
  std = jnp.sqrt(spread / jnp.maximum(n - 1.0, 1.0))
  # Floored at a millionth of the mean, and of 1e-6 (Levanter's floor).
  floor = 1e-6 * jnp.maximum(jnp.abs(mean), 1.0)
  threshold = mean + sigmas * jnp.maximum(std, floor)
  ready = judged & (n >= length // 2) & jnp.array([True, loss_given])
  spiked = ready & (value > threshold)
  stats = jnp.stack([value, mean, std, threshold], axis=-1)
  return Spike(found=jnp.any(spiked), spiked=spiked, stats=stats)


def entered(
  window: SpikeWindow, value: jax.Array, finite: jax.Array, loss_given: bool
) -> SpikeWindow:
  """`window` with `value` (the norm and the loss) written where `finite`:
  every finite step enters, a spike too, so that a lasting shift becomes
  the window's mean within a window's length."""
  length = window.values.shape[-1]
  at = window.written % length
  written = window.written + 1
  after = window._replace(
    values=window.values.at[:, at].set(value),
    loss_given=window.loss_given.at[at].set(loss_given),
    written=jnp.where(written >= 2 * length, written - length, written),
  )
  return optax.tree.where(finite, after, window)  # type: ignore[no-any-return]
