"""The optimizer states that hold a loss scale, and the skip record."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale import _validation
from optax_lossscale._loss_scale import LossScale

__all__ = ["LossScaleOptimizerState", "UnscaleGradientsState"]


class UnscaleGradientsState(NamedTuple):
  """The state of `unscale_gradients`.

  Attributes:
    loss_scale: the loss scale for the next step.
    should_apply: the loss scale's answer for the last step, as
      TensorFlow's `LossScale.update` gives it (a bool scalar); True before
      the first step. A `FixedLossScale` or `NoOpLossScale` answers True
      whatever the gradients: they cannot adjust.
    finite: whether the last step's unscaled gradients, and its loss when
      given as `value=`, were all finite (a bool scalar); True before the
      first step. A chain that skips reads this one.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> tx = ols.unscale_gradients(ols.FixedLossScale(8.0))
    >>> _, state = tx.update({"w": jnp.array([jnp.inf])}, tx.init(None))
    >>> float(state.loss_scale()), bool(state.should_apply), bool(state.finite)
    (8.0, True, False)
  """

  loss_scale: LossScale
  should_apply: jax.Array
  finite: jax.Array


def first_copy(x: Any) -> Any:
  """`x` readable on this host: a multi-process array's first local shard."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x.addressable_data(0)
  return x if isinstance(x, (jax.Array, np.ndarray)) else jnp.asarray(x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SkipRecord:
  """The last skipped step, kept in `LossScaleOptimizerState.last_skip`.

  Written inside the compiled step, on skipped steps only, so that the host
  can report a skip later without synchronising with the step. Read it with
  `skip_reports` or a `SkipMonitor`. Under `vmap`, each field has one entry
  per member.

  Attributes:
    step: the skipped step's number: how many steps came before it (int32),
      so the first step is 0, as in a Python loop; -1 before the first skip.
    loss_scale: the scale of the skipped step (float32); with retries, the
      scale it started at.
    next_loss_scale: the scale for the step after it (float32).
    consecutive_skipped_steps: how many steps in a row were skipped, this
      one included (int32); 0 before the first skip.
    loss_given: whether the step was given the loss as `value=` (bool).
    loss_finite: whether that loss was finite (bool; True when not given).
    at_floor: whether the scale of the skipped step could not be lowered
      (bool): the stop rule's advice depends on it.
    nonfinite: per leaf of the parameters, whether its unscaled gradient
      held a non-finite value (bool, one more axis), agreed across replicas.
    spiked: whether the step was skipped as a spike of its global norm and
      of its loss (bool, shape `(2,)`; see `LossScaleOptimizer`'s
      `spike_sigmas`).
    spike_stats: on a spike, for the norm and the loss (rows), the step's
      value, the window's mean and standard deviation and the threshold
      (float32, `(2, 4)`); zeros otherwise.
    leaf_norms: on a spike, per leaf, the norm of its unscaled gradient
      (float32, one more axis): the leaves that carry the norm; zeros
      otherwise.
    optimizer_step: the skipped step's number in optimizer steps: under
      accumulation, its window's (`step // gradient_accumulation_steps`);
      `step` otherwise (int32).
    leaf_names: the leaves' names (`jax.tree_util.keystr` of their paths in
      the parameters given to `init`, without an NNX variable's `.value`),
      as UTF-8 bytes, each ended by a
      newline (uint8, one more axis), so that a restored state still names
      them; `names()` decodes them.
  """

  step: jax.Array
  loss_scale: jax.Array
  next_loss_scale: jax.Array
  consecutive_skipped_steps: jax.Array
  loss_given: jax.Array
  loss_finite: jax.Array
  at_floor: jax.Array
  nonfinite: jax.Array
  spiked: jax.Array
  spike_stats: jax.Array
  leaf_norms: jax.Array
  optimizer_step: jax.Array
  leaf_names: jax.Array

  @classmethod
  def empty(cls, loss_scale: jax.Array, names: Sequence[str]) -> SkipRecord:
    """The record of no skip, for parameters whose leaves are `names`."""
    text = "".join(f"{name}\n" for name in names).encode()
    return cls(
      step=jnp.full((), -1, jnp.int32),
      loss_scale=jnp.copy(loss_scale),
      next_loss_scale=jnp.copy(loss_scale),
      consecutive_skipped_steps=jnp.zeros((), jnp.int32),
      loss_given=jnp.array(False),
      loss_finite=jnp.array(True),
      at_floor=jnp.array(False),
      nonfinite=jnp.zeros((len(names),), jnp.bool_),
      spiked=jnp.zeros((2,), jnp.bool_),
      spike_stats=jnp.zeros((2, 4), jnp.float32),
      leaf_norms=jnp.zeros((len(names),), jnp.float32),
      optimizer_step=jnp.full((), -1, jnp.int32),
      leaf_names=jnp.asarray(np.frombuffer(text, np.uint8)),
    )

  def names(self) -> tuple[str, ...]:
    """The leaves' names, decoded on the host (of member 0)."""
    raw = np.asarray(first_copy(self.leaf_names))
    row = raw.reshape(-1, raw.shape[-1])[0] if raw.size else raw
    return tuple(row.tobytes().decode().split("\n")[:-1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WriteRecord:
  """The parameters that a skipped step found non-finite, and their writer.

  Finite gradients can still make a non-finite update: float16 parameters
  with Adam, whose `eps=1e-8` is 0 in float16, divide 0 by 0. The next
  steps then skip (their loss or gradients are not finite), and each
  skipped step checks the parameters it was given. Written inside the
  compiled step, in `LossScaleOptimizerState.last_nonfinite_write`;
  `SkipMonitor` raises when it sees a new one.

  Attributes:
    step: the number of the last step applied before that skipped step
      (how many steps came before it, so the first step is 0), which wrote
      the values, unless they did not reach the loss; -1 if none (int32).
    nonfinite: per leaf of the parameters, whether it held a non-finite
      value (bool, one more axis).
  """

  step: jax.Array
  nonfinite: jax.Array

  @classmethod
  def empty(cls, names: Sequence[str]) -> WriteRecord:
    """The record of no such step, for parameters whose leaves are `names`."""
    return cls(jnp.full((), -1, jnp.int32), jnp.zeros(len(names), jnp.bool_))


class LossScaleOptimizerState(NamedTuple):
  """The state of `LossScaleOptimizer`.

  Its leaves are the same whatever the loss scale's hyperparameters, so a
  checkpoint restores into the state of an optimizer configured otherwise;
  `gradient_accumulation_steps` and the spike rule's settings shape
  `accumulator` and `spikes` (`docs/guides/bad_batches.md` changes them in
  a resumed run).

  Attributes:
    loss_scale: the loss scale for the next step.
    inner_state: the state of the wrapped optimizer; a skipped step leaves
      it bit for bit unchanged.
    should_apply: whether the last step was applied (bool); True before the
      first step: TensorFlow's meaning. Under accumulation, a step is a
      micro-batch, and this says whether it was kept (the skip counters and
      `SkipMonitor` count micro-batches too); `stepped` says whether
      `inner` stepped.
    skipped_steps: how many steps were skipped in all (int32).
    consecutive_skipped_steps: how many steps were skipped since the last
      applied one (int32): the stop rule reads it.
    nonfinite_loss_steps: how many skipped steps had a non-finite loss
      (int32): those a lower scale cannot fix.
    retries: how many times `minimize` recomputed a batch at a lower scale
      (int32): the forward and backward passes spent on overflow.
    last_skip: the last skipped step, a `SkipRecord`.
    steps: how many steps were taken, applied or skipped (int32).
    last_nonfinite_write: the last skipped step that was given non-finite
      parameters, a `WriteRecord`.
    grad_norm: the global L2 norm of the last step's unscaled gradients
      (float32), from the step's one read of them, before clipping, as
      `optax.global_norm` gives it; overwritten (FP8) leaves are not in it.
      It is inf when a gradient is not finite (NaN included), at any loss
      scale, and when the norm passes float32's range. Under accumulation
      it is the micro-batch's norm, except when `inner` steps, where it is
      the norm of the window's mean gradient (of the micro-batches it
      kept), the one the optimizer takes.
    accumulated: how many micro-batches the open accumulation window kept
      (int32); 0 without accumulation.
    stepped: whether `inner` stepped on the last call (bool); False before
      the first step. Without accumulation, `should_apply`; with it, True
      at a window's last micro-batch if the window kept one. What an EMA,
      a schedule or a log of optimizer steps gates on.
    micro_step: the position of the next micro-batch in its accumulation
      window, counting dropped ones (int32): 0 at a window's start, and
      always 0 without accumulation.
    accumulator: the mean of the micro-batches the open window kept, like
      the parameters, in their dtypes (overwritten leaves left out); `()`
      without accumulation.
    skipped_optimizer_steps: how many optimizer steps did not happen
      (int32; Megatron-LM's skipped iterations): without accumulation,
      `skipped_steps`; with it, the windows that closed without `inner`
      stepping.
    spikes: the spike rule's window of recent norms and losses, a
      `SpikeWindow`; `()` when the rule is off.

  A 0.1.0 checkpoint (the first five fields, and a `DynamicLossScale` of two
  leaves) restores as `docs/guides/frameworks.md` shows.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
    >>> params = {"w": jnp.zeros(2)}
    >>> _, state = tx.update(
    ...   {"w": jnp.array([jnp.nan, 1.0])}, tx.init(params), params
    ... )
    >>> int(state.skipped_steps), bool(state.should_apply)
    (1, False)
  """

  loss_scale: LossScale
  inner_state: optax.OptState
  should_apply: jax.Array
  skipped_steps: jax.Array
  consecutive_skipped_steps: jax.Array
  nonfinite_loss_steps: jax.Array
  retries: jax.Array
  last_skip: SkipRecord
  steps: jax.Array
  last_nonfinite_write: WriteRecord
  grad_norm: jax.Array
  accumulated: jax.Array
  stepped: jax.Array
  micro_step: jax.Array
  accumulator: Any
  skipped_optimizer_steps: jax.Array
  spikes: Any


def check_like(call: str, state: Any, like: Any) -> None:
  """Raises a `TypeError`, at trace time, unless `state` is a state of
  `like`'s type whose fields were not cast.

  `like` is a state of the expected type, fields and dtypes (from `init`,
  abstract). The inner state, the accumulator and the spike window are
  shaped by `inner`, the parameters or the settings: they are not compared
  here (`LossScaleOptimizer` checks the last two against its settings).
  """
  wanted = f"the {type(like).__name__} that `init` returned"
  if not isinstance(state, type(like)):
    if isinstance(state, dict):  # a checkpoint restored without a target
      wanted += " (restore a checkpoint into a target built by `init`)"
    raise _validation.must(TypeError, f"`{call}`: the state", wanted, state)
  # Shaped by `inner`, the parameters or the settings: checked elsewhere.
  own = {"inner_state": None, "accumulator": (), "spikes": ()}
  blank = {k: v for k, v in own.items() if k in state._fields}
  flat = lambda s: jax.tree_util.tree_leaves_with_path(s._replace(**blank))  # noqa: E731
  want = {jax.tree_util.keystr(p): x.dtype for p, x in flat(like)}
  got = {jax.tree_util.keystr(p): x for p, x in flat(state)}
  if got.keys() != want.keys():
    raise TypeError(
      f"`{call}`: the state's fields {sorted(got.keys() ^ want.keys())[:4]}"
      " differ from those `init` returns: restore into a target built by it."
    )
  for path, leaf in got.items():
    _validation.array_dtype(f"`{call}`: the state's `{path}`", leaf, want[path])


def find_one(where: str, opt_state: Any, types: tuple[type, ...]) -> Any:
  """The one node of `opt_state` of the given types, or a `ValueError`.

  It may be nested at any depth.
  """
  nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, types))
  found = [n for n in nodes if isinstance(n, types)]
  if len(found) != 1:
    raise ValueError(
      f"{where} must be an optimizer state holding one"
      f" {' or '.join(t.__name__ for t in types)}, found {len(found)} in"
      f" {_validation.describe(opt_state)}."
    )
  return found[0]


def find_loss_scale(where: str, opt_state: Any) -> LossScale:
  """The one loss scale held in `opt_state`, at any depth, or raises."""
  types = (UnscaleGradientsState, LossScaleOptimizerState)
  return find_one(where, opt_state, types).loss_scale  # type: ignore[no-any-return]
