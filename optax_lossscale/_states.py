"""The optimizer states that hold a loss scale, and `get_loss_scale`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale._loss_scale import LossScale

__all__ = [
  "LossScaleOptimizerState",
  "SkipRecord",
  "UnscaleGradientsState",
  "get_loss_scale",
]


class UnscaleGradientsState(NamedTuple):
  """The state of `unscale_gradients`.

  Attributes:
    loss_scale: the loss scale to use for the next step.
    should_apply: whether the last step's gradients were fit to apply (a bool
      scalar); True before the first step.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> tx = ols.unscale_gradients(ols.DynamicLossScale(8.0))
    >>> _, state = tx.update({"w": jnp.array([jnp.inf])}, tx.init(None))
    >>> float(state.loss_scale()), bool(state.should_apply)
    (4.0, False)
  """

  loss_scale: LossScale
  should_apply: jax.Array


def first_copy(x: Any) -> Any:
  """`x` readable on this host: a multi-process array's first local shard.

  Each process holds a whole copy of a replicated array; NNX variables are
  unwrapped.
  """
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x.addressable_data(0)
  return x if isinstance(x, (jax.Array, np.ndarray)) else jnp.asarray(x)


# The scalar fields of a `SkipRecord` and their dtypes (one scalar per member
# in a stacked state); its two vectors, `nonfinite` and `leaf_names`, have
# one more axis.
SKIP_RECORD_SCALARS: dict[str, type] = {
  "loss_scale": np.float32,
  "next_loss_scale": np.float32,
  "skipped_steps": np.int32,
  "consecutive_skipped_steps": np.int32,
  "loss_given": np.bool_,
  "loss_finite": np.bool_,
  "at_floor": np.bool_,
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SkipRecord:
  """The last skipped step, as `LossScaleOptimizer` keeps it in its state.

  Written on skipped steps only, inside the compiled step, and read on the
  host by `skip_reports` and `SkipMonitor`. Every field is a replicated array
  (under `vmap`, one per member), so the record goes wherever the state
  goes: `jit`, `lax.scan`, Orbax checkpoints, `optax.tree.map_params`.

  Attributes:
    loss_scale: the scale of the skipped step (float32).
    next_loss_scale: the scale for the step after it (float32).
    skipped_steps: the state's `skipped_steps` after it (int32); 0 before
      the first skip.
    consecutive_skipped_steps: how many steps in a row were skipped, this
      one included (int32).
    loss_given: whether the step was given the loss as `value=` (bool).
    loss_finite: whether that loss was finite (bool; True when not given).
    at_floor: whether the scale of the skipped step could not be lowered
      (bool).
    nonfinite: for each leaf of the parameters, whether any of its unscaled
      gradient values was not finite (bool, in `names()`' order): the
      finiteness check's own per-leaf verdicts, of the global array under
      sharded `jit`, agreed over the replicas of `axis_name`.
    leaf_names: the leaves' names, `jax.tree_util.keystr` of their paths in
      the parameters `init` was given (`<root>` for a bare array), as UTF-8
      bytes, each name ended by a newline (uint8); `names()` decodes them.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
    >>> params = {"w": jnp.zeros(2)}
    >>> _, state = tx.update(
    ...   {"w": jnp.array([jnp.nan, 1.0])}, tx.init(params), params
    ... )
    >>> state.last_skip.names(), state.last_skip.nonfinite
    (("['w']",), Array([ True], dtype=bool))
  """

  loss_scale: jax.Array
  next_loss_scale: jax.Array
  skipped_steps: jax.Array
  consecutive_skipped_steps: jax.Array
  loss_given: jax.Array
  loss_finite: jax.Array
  at_floor: jax.Array
  nonfinite: jax.Array
  leaf_names: jax.Array

  @staticmethod
  def encode_names(names: Sequence[str]) -> np.ndarray:
    """`names` as the uint8 array `leaf_names` holds: each ends in a newline."""
    text = "".join(f"{name}\n" for name in names)
    return np.frombuffer(text.encode(), np.uint8)

  def names(self) -> tuple[str, ...]:
    """The leaves' names, decoded on the host (replica or member 0)."""
    raw = np.asarray(first_copy(self.leaf_names))
    width = raw.shape[-1] if raw.ndim else 0
    text = raw.reshape(-1, width)[:1].tobytes().decode() if raw.size else ""
    return tuple(text.split("\n")[:-1])


class LossScaleOptimizerState(NamedTuple):
  """The state of `LossScaleOptimizer` (and `loss_scale_optimizer`).

  Attributes:
    loss_scale: the loss scale to use for the next step.
    inner_state: the state of the wrapped transformation; unchanged by skipped
      steps.
    should_apply: whether the last step was applied (a bool scalar); True
      before the first step.
    skipped_steps: how many steps were skipped in all (int32): batches
      dropped, whatever the reason.
    consecutive_skipped_steps: how many steps were skipped since the last
      applied one (int32).
    nonfinite_loss_steps: how many of the skipped steps had a non-finite loss
      (`value=`), int32.
    retries: how many times `minimize` recomputed a batch at a lower scale
      (int32).
    last_skip: the last skipped step, a `SkipRecord`; read it with
      `skip_reports` or `SkipMonitor`.

  A 0.1.0 checkpoint (five fields) restores into a dict of the first five
  fields, `{k: v for k, v in tx.init(params)._asdict().items() if k not in
  ("nonfinite_loss_steps", "retries", "last_skip")}`, and then into the full
  state with
  `tx.init(params)._replace(**restored)`. A state whose three new fields are
  None steps too, and keeps them None.

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
  nonfinite_loss_steps: jax.Array | None = None
  retries: jax.Array | None = None
  last_skip: SkipRecord | None = None


_STATES = (UnscaleGradientsState, LossScaleOptimizerState)


def find_states(opt_state: Any, types: tuple[type, ...] = _STATES) -> list[Any]:
  """The nodes of `opt_state` of the given types, wherever they are nested."""
  is_state = lambda x: isinstance(x, types)  # noqa: E731
  return [
    n for n in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(n)
  ]


def get_loss_scale(opt_state: optax.OptState) -> LossScale:
  """Returns the current loss scale held in an optimizer state.

  Searches the whole state, through `optax.chain`, `optax.MultiSteps`,
  `optax.inject_hyperparams`, `optax.multi_transform` and any other nesting,
  for the state of `unscale_gradients` or `LossScaleOptimizer`.

  Args:
    opt_state: an optimizer state.

  Returns:
    The `LossScale` to scale the next step's loss with.

  Raises:
    ValueError: if the state holds no loss scale, or more than one.

  Examples:
    Clip in the inner optimizer, where the gradients are unscaled. Chained
    before the loss-scale optimizer, a clip sees the scaled gradients: its
    threshold is then in effect divided by the scale (256 here), and moves
    whenever a dynamic scale does.

    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(
    ...     optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    ...     ols.FixedLossScale(256))
    >>> ols.get_loss_scale(tx.init(jnp.zeros(3)))
    FixedLossScale(loss_scale_value=256.0)
  """
  found = find_states(opt_state)
  if len(found) != 1:
    raise ValueError(
      "`get_loss_scale(opt_state)` expects exactly one loss scale in the"
      f" state (from `unscale_gradients` or `LossScaleOptimizer`), found"
      f" {len(found)}."
    )
  loss_scale: LossScale = found[0].loss_scale
  return loss_scale
