"""`check_state`: the loss scales and counters of a restored tree, on the host."""

from __future__ import annotations

import functools
import numbers
import warnings
from typing import Any, TypeVar

import jax
import numpy as np
import optax

from optax_lossscale import _loss_scale, _validation
from optax_lossscale._loss_scale import DynamicLossScale, LossScale
from optax_lossscale._optimizer import LossScaleOptimizer
from optax_lossscale._states import LossScaleOptimizerState
from optax_lossscale._validation import FLOAT32_MAX, host_values, must

__all__ = ["check_state"]

T = TypeVar("T")
# An array's valid values under any hyperparameters, by its field's name; any
# other's are at least 0.
_VALID = {
  "current_loss_scale": (float(np.finfo(np.float32).tiny), FLOAT32_MAX),
  **dict.fromkeys(["step", "optimizer_step"], (-1, np.inf)),  # -1: none yet
  **dict.fromkeys(["values", "loss_sum"], (-FLOAT32_MAX, FLOAT32_MAX)),
  "spike_stats": (-np.inf, np.inf),  # a loss may be negative
}
_MOVES = "steps take the nearest bound"
_GROWS = "the next finite step grows the scale"
_LOWERS = "the next non-finite step lowers the scale"


def _array(x: Any) -> Any:
  """`x`, or the one array inside a container such as an NNX variable."""
  leaves = jax.tree.leaves(x)
  return leaves[0] if len(leaves) == 1 else x


@functools.cache
def _fresh(sigmas: float | None) -> Any:
  """A state's own arrays as `init` makes them, with the spike rule's window
  (any `sigmas`: only its axes are read) or without it (None): abstract,
  their dtypes and their axes past the state's. Nothing moves to a device (a
  check runs under `jax.transfer_guard`); its loss scale, inner state and
  accumulator hold no array (`_check_loss_scale` and the accumulator's check
  read those)."""
  noop = _loss_scale.NoOpLossScale()
  tx = LossScaleOptimizer(optax.identity(), noop, spike_sigmas=sigmas)
  return jax.eval_shape(tx.init, {})


def _check_all(node: Any, want: Any, path: str, shape: Any) -> dict[str, Any]:
  """Checks each array of `node` against `want`'s (abstract): its dtype, its
  shape (the state's, plus `want`'s axes) and its range (`_VALID`); returns
  their values where concrete, by path."""
  read = {}
  for keys, like in jax.tree_util.tree_leaves_with_path(want):
    name = jax.tree_util.keystr(keys)
    where = f"`{path}{name}`"
    value = _array(functools.reduce(getattr, [k.name for k in keys], node))
    if isinstance(value, numbers.Number) or value is None:
      raise must(TypeError, where, f"an array of {like.dtype}", value)
    _validation.array_dtype(where, value, like.dtype)
    has = np.shape(value)
    if has[: len(shape)] != shape or len(has) != len(shape) + like.ndim:
      plus = f", plus {like.ndim} axes" if like.ndim else ""
      raise ValueError(
        f"{where} must have the state's shape {shape}{plus}, got {has}."
      )
    _validation.in_range(where, value, *_VALID.get(keys[-1].name, (0, np.inf)))
    read[name] = host_values(value)
  return read


def _check_loss_scale(ls: LossScale, path: str, shape: Any, depth: int) -> None:
  """A `DynamicLossScale`'s state; says what it keeps past its bounds, to
  `check_state`'s caller (`depth` states deep in the tree)."""
  if not isinstance(ls, DynamicLossScale):
    return
  shape = np.shape(_array(ls.current_loss_scale)) if shape is None else shape
  read = _check_all(ls, jax.eval_shape(DynamicLossScale), path, shape)
  top = ls.max_loss_scale or np.inf
  usual = {  # under these hyperparameters; `_VALID` under any
    "current_loss_scale": (ls.min_loss_scale, top, _MOVES),
    "num_good_steps": (0, ls.increment_period - 1, _GROWS),
    "num_bad_steps": (0, ls.hysteresis, _LOWERS),
  }
  for name, (low, high, then) in usual.items():
    got = read[f".{name}"]
    outside = np.zeros(0) if got is None else got[(got < low) | (got > high)]
    if len(outside):
      warnings.warn(
        f"`check_state(tree)` kept `{path}.{name}` = {outside[0].item()!r},"
        f" outside [{low:g}, {high:g}] for these hyperparameters: {then}.",
        stacklevel=4 + depth,
      )


def _check_optimizer_state(state: LossScaleOptimizerState, path: str) -> None:
  """Each of `state`'s own arrays, then what relates them."""
  off = isinstance(state.spikes, tuple) and not state.spikes
  want = _fresh(None if off else 1.0)
  for field in ("loss_scale", "last_skip", "last_nonfinite_write", "spikes"):
    kind = LossScale if field == "loss_scale" else type(getattr(want, field))
    got = getattr(state, field)
    if not isinstance(got, kind):
      what = f"a {kind.__name__}" + (" or ()" if field == "spikes" else "")
      raise must(TypeError, f"`{path}.{field}`", what, got)
  read = _check_all(state, want, path, np.shape(_array(state.should_apply)))
  if not off:  # the window: norms and losses, written fewer than 2x its length
    *_, rows, length = np.shape(_array(state.spikes.values))
    if rows != 2:
      raise ValueError(f"`{path}.spikes.values` must have 2 rows, got {rows}.")
    written = _array(state.spikes.written)
    _validation.in_range(f"`{path}.spikes.written`", written, 0, 2 * length - 1)
  for low, high in [
    ("consecutive_skipped_steps", "skipped_steps"),
    ("accumulated", "micro_step"),  # a window keeps what it has seen
  ]:
    a, b = read[f".{low}"], read[f".{high}"]
    if a is not None and b is not None and not (a <= b).all():
      got = f"{a.tolist()} > {b.tolist()}"
      raise ValueError(f"`{path}.{low}` must be at most `{high}`, got {got}.")
  # A NaN would stay: the mean of the window's micro-batches would be NaN.
  values = map(host_values, jax.tree.leaves(state.accumulator))
  if any(v is not None and np.isnan(v).any() for v in values):
    raise ValueError(
      f"`{path}.accumulator` must hold no NaN: the window's mean would keep it."
    )
  if read[".last_skip.leaf_names"] is not None:
    names = len(state.last_skip.names())
    for field in ("last_skip", "last_nonfinite_write"):
      flags = np.shape(_array(getattr(state, field).nonfinite))
      if flags[-1:] != (names,):
        raise ValueError(
          f"`{path}.{field}.nonfinite` must hold one flag per leaf name"
          f" ({names}), got shape {flags}."
        )


def _walk(tree: Any, root: str, depth: int = 0) -> int:
  """Checks the states in `tree`; returns how many loss scales it holds."""
  found = lambda x: isinstance(x, (LossScale, LossScaleOptimizerState))  # noqa: E731
  count = 0
  for keys, node in jax.tree_util.tree_leaves_with_path(tree, is_leaf=found):
    path = f"{root}{jax.tree_util.keystr(keys)}"
    if isinstance(node, LossScaleOptimizerState):
      _check_optimizer_state(node, path)
      shape = np.shape(_array(node.should_apply))
      _check_loss_scale(node.loss_scale, f"{path}.loss_scale", shape, depth)
      inner = f"{path}.inner_state"
      count += 1 + _walk(node.inner_state, inner, depth + 1)
    elif isinstance(node, LossScale):
      _check_loss_scale(node, path, None, depth)
      count += 1
  return count


def check_state(tree: T) -> T:
  """Checks the loss scales and skip counters in a pytree, on the host.

  Finds every `LossScaleOptimizerState` and `LossScale` in `tree` (a
  restored checkpoint, a linen `TrainState`, an `nnx.Optimizer`, any nested
  optimizer state) and checks, element by element for states stacked over
  replicas or ensemble members:

  - every array has its field's dtype: float32 scales, int32 counters, bool
    flags, a uint8 `last_skip.leaf_names`;
  - every array has the leading shape of its state's `should_apply`;
  - scales are finite and positive, counters and `grad_norm` non-negative
    (`grad_norm` may be inf, never NaN), `consecutive_skipped_steps <=
    skipped_steps`, `accumulated <= micro_step`, and the accumulator holds
    no NaN;
  - the spike rule's window (`spikes`) holds finite values and a count below
    twice its length.

  Unflattening a state (what a restore does) checks none of it, so that it
  stays cheap under `jit`. A `DynamicLossScale`'s state is valid under any
  hyperparameters: a checkpoint may restore into a loss scale configured
  otherwise (another `hysteresis`, a shorter `increment_period`). Values
  outside the new bounds are kept, and a `UserWarning` says which and what
  the next step does with them. It reads the values, so it waits for them.

  Args:
    tree: any pytree holding at least one loss scale. Restore a checkpoint
      into a target built by `init`: without one, Orbax returns dicts.

  Returns:
    `tree`, unchanged.

  Raises:
    ValueError: naming the field (its path in `tree`) and the offending
      value, or the shape it should have; or if `tree` holds no loss scale.
    TypeError: naming the field, if a value is not of its dtype, or a
      record, the spike window or the loss scale not of its type.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
    >>> state = ols.check_state(tx.init({"w": jnp.zeros(2)}))
    >>> ols.check_state(state._replace(skipped_steps=jnp.int32(-1)))
    Traceback (most recent call last):
    ...
    ValueError: `tree.skipped_steps` must be at least 0, got -1.
  """
  if not _walk(tree, "tree"):
    raise ValueError(
      f"`check_state(tree)` found no loss scale in {_validation.describe(tree)}:"
      " restore into a target built by `init` (a restore without one gives"
      " dicts); with Flax NNX, pass the `nnx.Optimizer`."
    )
  return tree
