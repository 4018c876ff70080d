"""`check_state`: the loss scales and counters of a restored tree, on the host."""

from __future__ import annotations

import numbers
import warnings
from typing import Any, TypeVar

import jax
import numpy as np

from optax_lossscale import _loss_scale, _spikes, _states, _validation
from optax_lossscale._loss_scale import LossScale
from optax_lossscale._states import LossScaleOptimizerState

__all__ = ["check_state"]

T = TypeVar("T")
# The int32 counters, `skipped_steps` and `consecutive_skipped_steps` first.
_COUNTERS = (
  "skipped_steps",
  "skipped_optimizer_steps",
  "consecutive_skipped_steps",
  "nonfinite_loss_steps",
  "retries",
  "steps",
  "accumulated",
  "micro_step",
)
_MOVES = "steps take the nearest bound"
_GROWS = "the next finite step grows the scale"
_LOWERS = "the next non-finite step lowers the scale"


def _array(x: Any) -> Any:
  """`x`, or the one array inside a container such as an NNX variable."""
  if isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number)):
    return x
  leaves = jax.tree.leaves(x)
  return leaves[0] if len(leaves) == 1 else x


def _check(
  where: str,
  value: Any,
  dtype: Any,
  shape: Any,
  valid: tuple[float, float] = (0, np.inf),
  axes: int = 0,
) -> np.ndarray | None:
  """`value`'s dtype, its shape (the state's, plus `axes` axes), its range;
  returns its values if they are concrete."""
  value = _array(value)
  if isinstance(value, numbers.Number) or value is None:
    got = _validation.describe(value)
    raise TypeError(
      f"{where} must be an array of {np.dtype(dtype)}, got {got}."
    )
  _validation.array_dtype(where, value, dtype)
  got = np.shape(value)[: np.ndim(value) - axes]
  if got != shape or np.ndim(value) < axes:
    plus = f", plus {axes} axes" if axes else ""
    raise ValueError(
      f"{where} must have the state's shape {shape}{plus}, got {np.shape(value)}."
    )
  _validation.in_range(where, value, *valid)
  return _validation.host_values(value)


def _check_loss_scale(ls: LossScale, path: str, shape: Any) -> None:
  """A `DynamicLossScale`'s state; says what it keeps past its bounds."""
  if not isinstance(ls, _loss_scale.DynamicLossScale):
    return
  shape = np.shape(_array(ls.current_loss_scale)) if shape is None else shape
  tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
  top = ls.max_loss_scale or np.inf
  bounds: list[Any] = [  # valid under any hyperparameters; usual under these
    ("current_loss_scale", (tiny, big), (ls.min_loss_scale, top), _MOVES),
    ("num_good_steps", (0, np.inf), (0, ls.increment_period - 1), _GROWS),
    ("num_bad_steps", (0, np.inf), (0, ls.hysteresis), _LOWERS),
  ]
  for name, valid, (low, high), then in bounds:
    where = f"`{path}.{name}`"
    dtype = _loss_scale.STATE_DTYPES[name]
    values = _check(where, getattr(ls, name), dtype, shape, valid)
    outside = np.zeros(0) if values is None else values
    outside = outside[(outside < low) | (outside > high)]
    if len(outside):
      warnings.warn(
        f"`check_state(tree)` kept {where} = {outside[0].item()!r}, outside"
        f" [{low:g}, {high:g}] for these hyperparameters: {then}.",
        stacklevel=4,
      )


def _check_optimizer_state(state: LossScaleOptimizerState, path: str) -> None:
  if not isinstance(state.loss_scale, LossScale):
    got = _validation.describe(state.loss_scale)
    raise TypeError(f"`{path}.loss_scale` must be a LossScale, got {got}.")
  shape = np.shape(_array(state.should_apply))
  for flag in ("should_apply", "stepped"):
    _check(f"`{path}.{flag}`", getattr(state, flag), np.bool_, shape)
  counts = {
    name: _check(f"`{path}.{name}`", getattr(state, name), np.int32, shape)
    for name in _COUNTERS
  }
  norm = _array(state.grad_norm)  # inf after an overflow
  _validation.array_dtype(f"`{path}.grad_norm`", norm, np.float32)
  for low, high in [
    ("consecutive_skipped_steps", "skipped_steps"),
    ("accumulated", "micro_step"),  # a window keeps what it has seen
  ]:
    a, b = counts[low], counts[high]
    if a is not None and b is not None and not (a <= b).all():
      raise ValueError(
        f"`{path}.{low}` must be at most `{high}`, got {a.tolist()} >"
        f" {b.tolist()}."
      )
  for leaf in jax.tree.leaves(state.accumulator):  # a NaN would stay
    values = _validation.host_values(_array(leaf))
    if values is not None and np.isnan(values).any():
      raise ValueError(
        f"`{path}.accumulator` must hold no NaN: the window's mean would"
        " stay NaN."
      )
  if not (isinstance(state.spikes, tuple) and not state.spikes):  # on
    _check_spikes(state.spikes, f"{path}.spikes", shape)
  _check_records(state, path, shape)


def _check_spikes(window: Any, path: str, shape: Any) -> None:
  """The spike rule's window: finite values, a count below twice its
  length."""
  if not isinstance(window, _spikes.SpikeWindow):
    got = _validation.describe(window)
    raise TypeError(f"`{path}` must be a SpikeWindow or (), got {got}.")
  length = np.shape(_array(window.values))[-1]
  big = float(np.finfo(np.float32).max)
  finite = (-big, big)
  _check(f"`{path}.values`", window.values, np.float32, shape, finite, axes=2)
  _check(f"`{path}.loss_given`", window.loss_given, np.bool_, shape, axes=1)
  if np.shape(_array(window.values))[-2:-1] != (2,):
    raise ValueError(f"`{path}.values` must have 2 rows (norms, losses).")
  _check(
    f"`{path}.written`", window.written, np.int32, shape, (0, 2 * length - 1)
  )
  _check(f"`{path}.loss_sum`", window.loss_sum, np.float32, shape, finite)


def _check_records(
  state: LossScaleOptimizerState, path: str, shape: Any
) -> None:
  """The skip record and the write record: types, dtypes, shapes, ranges."""
  records = {  # abstract: no transfer to a device (`jax.transfer_guard`)
    "last_skip": jax.eval_shape(_states.SkipRecord.empty, np.float32(1), []),
    "last_nonfinite_write": jax.eval_shape(_states.WriteRecord.empty, []),
  }
  for field, empty in records.items():
    record = getattr(state, field)
    if not isinstance(record, type(empty)):
      raise TypeError(
        f"`{path}.{field}` must be a {type(empty).__name__}, got"
        f" {_validation.describe(record)}."
      )
    for name, want in vars(empty).items():  # `want`'s axes: per leaf, ...
      where = f"`{path}.{field}.{name}`"
      valid: tuple[float, float] = (-1 if name.endswith("step") else 0, np.inf)
      valid = (-np.inf, np.inf) if name == "spike_stats" else valid  # a loss
      value = getattr(record, name)
      _check(where, value, want.dtype, shape, valid, axes=want.ndim)
    raw = _validation.host_values(_array(state.last_skip.leaf_names))
    names = None if raw is None else len(state.last_skip.names())
    flags = np.shape(_array(record.nonfinite))
    if names is not None and flags[-1:] != (names,):
      raise ValueError(
        f"`{path}.{field}.nonfinite` must hold one flag per leaf name"
        f" ({names}), got shape {flags}."
      )


def _walk(tree: Any, root: str) -> int:
  """Checks the states in `tree`; returns how many loss scales it holds."""
  found = lambda x: isinstance(x, (LossScale, LossScaleOptimizerState))  # noqa: E731
  count = 0
  for keys, node in jax.tree_util.tree_leaves_with_path(tree, is_leaf=found):
    path = f"{root}{jax.tree_util.keystr(keys)}"
    if isinstance(node, LossScaleOptimizerState):
      _check_optimizer_state(node, path)
      shape = np.shape(_array(node.should_apply))
      _check_loss_scale(node.loss_scale, f"{path}.loss_scale", shape)
      count += 1 + _walk(node.inner_state, f"{path}.inner_state")
    elif isinstance(node, LossScale):
      _check_loss_scale(node, path, None)
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
  - scales are finite and positive, counters non-negative,
    `consecutive_skipped_steps <= skipped_steps`, `accumulated <=
    micro_step`, and the accumulator holds no NaN;
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
    TypeError: naming the field, if a value is not of its dtype.

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
