"""`check_state`: the loss scales and counters of a restored tree, on the host."""

from __future__ import annotations

import numbers
from typing import Any, TypeVar

import jax
import numpy as np

from optax_lossscale import _validation
from optax_lossscale._loss_scale import (
  DynamicLossScale,
  LossScale,
  check_state_values,
)
from optax_lossscale._states import (
  SKIP_RECORD_SCALARS,
  LossScaleOptimizerState,
  first_copy,
)

__all__ = ["check_state"]

T = TypeVar("T")

# The counters of `LossScaleOptimizerState`, int32 arrays of the shape of its
# `should_apply`.
_COUNTERS = (
  "skipped_steps",
  "consecutive_skipped_steps",
  "nonfinite_loss_steps",
  "retries",
)
_RECORD_COUNTERS = ("skipped_steps", "consecutive_skipped_steps")
_CALL = "`check_state(tree)`"
# A shape every array of a state must have, and the field that gave it.
Batch = tuple[str, tuple[int, ...]] | None


def _field(path: str, name: str) -> str:
  """Where a field is, for a message: `check_state(tree)`: `tree.x.name`."""
  return f"{_CALL}: `{path}.{name}`"


def _is_found(x: Any) -> bool:
  return isinstance(x, (LossScale, LossScaleOptimizerState))


def _unwrapped(x: Any) -> Any:
  """`x`, or the one array inside a container such as Flax NNX's variables."""
  if x is None or isinstance(
    x, (jax.Array, np.ndarray, np.generic, numbers.Number)
  ):
    return x
  leaves = jax.tree.leaves(x)
  return leaves[0] if len(leaves) == 1 else x


def _check_array(
  where: str, value: Any, dtype: Any, batch: Batch, extra_axis: bool = False
) -> None:
  """Raises unless `value` is of `dtype` and of the batch's shape."""
  _validation.state_dtype(where, value, dtype, convert=False)
  _check_shape(where, value, batch, extra_axis)


def _check_shape(
  where: str, value: Any, batch: Batch, extra_axis: bool = False
) -> None:
  """Raises unless `value` has the batch's shape (plus one trailing axis)."""
  shape = _validation.shape_of(value)
  if batch is None or shape is None:
    return
  of, expected = batch
  if extra_axis and len(shape) != len(expected) + 1:
    raise ValueError(
      f"{where} must have the shape of {of}, {expected}, plus one axis, got"
      f" {shape}."
    )
  _validation.same_shape(
    where, shape[:-1] if extra_axis else shape, of, expected
  )


def _batch(path: str, name: str, value: Any) -> Batch:
  """The shape every array of a state must share: `value`'s."""
  shape = _validation.shape_of(value)
  return None if shape is None else (f"`{path}.{name}`", shape)


def _check_counters(
  state: LossScaleOptimizerState, path: str, batch: Batch
) -> None:
  counters = {name: _unwrapped(getattr(state, name)) for name in _COUNTERS}
  for name, value in counters.items():
    if value is not None:  # None in a state restored from 0.1.0
      _check_array(_field(path, name), value, np.int32, batch)
      _validation.elements(
        _field(path, name), value, integer=True, low=0, expected="non-negative"
      )
  consecutive = _validation.host_pieces(counters["consecutive_skipped_steps"])
  skipped = _validation.host_pieces(counters["skipped_steps"])
  for (offset, c), (_, s) in zip(consecutive, skipped, strict=False):
    c, s = np.broadcast_arrays(c, s)
    index = _validation.first_bad(c <= s)
    if index is not None:
      raise ValueError(
        f"{_field(path, 'consecutive_skipped_steps')} must be at most"
        f" `skipped_steps`, got {_validation.element(offset, c, index)}"
        f", with skipped_steps={s[index].item()!r}."
      )


def _name_count(leaf_names: Any) -> int | None:
  """How many names `leaf_names` holds (newline-ended), if it is concrete."""
  if isinstance(leaf_names, jax.core.Tracer) or not isinstance(
    leaf_names, (jax.Array, np.ndarray)
  ):
    return None
  raw = np.asarray(first_copy(leaf_names))
  row = raw.reshape(-1, raw.shape[-1])[0] if raw.size else raw
  return int(np.count_nonzero(row == ord("\n")))


def _check_record(
  state: LossScaleOptimizerState, path: str, batch: Batch
) -> None:
  """The last skip's fields have their dtypes and shapes, counters >= 0."""
  record = state.last_skip
  if record is None:  # a state restored from 0.1.0
    return
  path = f"{path}.last_skip"
  for name, dtype in SKIP_RECORD_SCALARS.items():
    value = _unwrapped(getattr(record, name))
    _check_array(_field(path, name), value, dtype, batch)
  nonfinite = _unwrapped(record.nonfinite)
  leaf_names = _unwrapped(record.leaf_names)
  _check_array(_field(path, "nonfinite"), nonfinite, np.bool_, batch, True)
  _check_array(_field(path, "leaf_names"), leaf_names, np.uint8, batch, True)
  for name in _RECORD_COUNTERS:
    _validation.elements(
      _field(path, name),
      _unwrapped(getattr(record, name)),
      integer=True,
      low=0,
      expected="non-negative",
    )
  count = _name_count(leaf_names)
  shape = _validation.shape_of(nonfinite)
  if count is not None and shape and shape[-1] != count:
    raise ValueError(
      f"{_field(path, 'nonfinite')} must hold one flag per name in"
      f" `{path}.leaf_names`, {count}, got shape {shape}."
    )


def _check_loss_scale(loss_scale: LossScale, path: str, batch: Batch) -> None:
  """A `DynamicLossScale`'s state: dtypes, one shape, values in range."""
  if not isinstance(loss_scale, DynamicLossScale):
    return
  names = ["current_loss_scale", "num_good_steps"]
  if loss_scale.hysteresis > 1:
    names.append("hysteresis_budget")
  state = {name: _unwrapped(getattr(loss_scale, name)) for name in names}
  check_state_values(loss_scale, state, lambda name: _field(path, name))
  if batch is None:
    batch = _batch(path, names[0], state[names[0]])
  for name, value in state.items():
    _check_shape(_field(path, name), value, batch)


def _check_optimizer_state(state: LossScaleOptimizerState, path: str) -> int:
  """Checks the state; returns how many loss scales it holds."""
  should_apply = _unwrapped(state.should_apply)
  _check_array(_field(path, "should_apply"), should_apply, np.bool_, None)
  batch = _batch(path, "should_apply", should_apply)
  _check_counters(state, path, batch)
  found = 0
  if isinstance(state.loss_scale, LossScale):
    _check_loss_scale(state.loss_scale, f"{path}.loss_scale", batch)
    found += 1
  else:
    key = jax.tree_util.GetAttrKey("loss_scale")
    found += _walk(state.loss_scale, path, (key,))
  _check_record(state, path, batch)
  key = jax.tree_util.GetAttrKey("inner_state")
  return found + _walk(state.inner_state, path, (key,))


def _walk(tree: Any, root: str, prefix: tuple[Any, ...]) -> int:
  """Checks what `tree` holds; returns how many loss scales were found."""
  found = 0
  nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_found)
  for keys, node in nodes:
    path = f"{root}{jax.tree_util.keystr(prefix + tuple(keys))}"
    if isinstance(node, LossScaleOptimizerState):
      found += _check_optimizer_state(node, path)
    elif isinstance(node, LossScale):
      _check_loss_scale(node, path, None)
      found += 1
  return found


def check_state(tree: T) -> T:
  """Checks the loss scales and skip counters in a pytree, on the host.

  Finds every `LossScaleOptimizerState` and `LossScale` in `tree` (a restored
  checkpoint, a Flax linen `TrainState`, an `nnx.Optimizer` or its
  `opt_state`, an optimizer state of any nesting) and checks their arrays'
  dtypes and shapes, and their concrete values, element by element for
  states stacked over replicas (`pmap`) or ensemble members (`vmap`):

  - every array has its field's dtype: float32 scales, int32 counters, bool
    flags (`should_apply`, the record's `loss_given`, `loss_finite`,
    `at_floor` and `nonfinite`) and uint8 `last_skip.leaf_names`;
  - every array has the shape of the state's `should_apply` (of its
    `current_loss_scale`, for a bare loss scale), with one more axis for
    `last_skip.nonfinite` (one flag per name in `leaf_names`) and
    `last_skip.leaf_names`;
  - a `DynamicLossScale`'s scale is finite and in `[min_loss_scale,
    max_loss_scale]`, `num_good_steps` an integer in `[0,
    increment_period)`, `hysteresis_budget` one in `[0, hysteresis]`;
  - every counter of a `LossScaleOptimizerState` (`skipped_steps`,
    `consecutive_skipped_steps`, `nonfinite_loss_steps`, `retries`) is
    non-negative, and `consecutive_skipped_steps <= skipped_steps`; so are
    the counters of its `last_skip` record.

  A checkpoint restored into a live run can carry a NaN scale, a negative
  counter or a scale below `min_loss_scale`; unflattening (what a restore
  does) does not check the state, so that it stays cheap under `jit`. Call
  this after a restore: it returns its argument, so it can wrap the call.
  It reads the values, so it waits for them; call it outside `jit`, where
  it has concrete values to check (under `jit`, only dtypes and shapes are).

  Args:
    tree: any pytree holding at least one loss scale. Restore a checkpoint
      into a target (a freshly initialised state): without one, Orbax returns
      dicts, whose loss scales have lost their type and hyperparameters.

  Returns:
    `tree`, unchanged.

  Raises:
    ValueError: naming the field (its path in `tree`) and the offending value
      (and its index, in a stacked state), or the shape it should have; or
      if `tree` holds no loss scale.
    TypeError: naming the field, if a value is not of its dtype (a uint8 or
      Python int counter, a float16 scale).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
    >>> state = ols.check_state(tx.init({"w": jnp.zeros(2)}))
    >>> ols.check_state(state._replace(skipped_steps=jnp.int32(-1)))
    Traceback (most recent call last):
    ...
    ValueError: `check_state(tree)`: `tree.skipped_steps` must be non-negative, got -1.
  """
  if not _walk(tree, "tree", ()):
    raise ValueError(
      f"{_CALL} found no loss scale in `tree` (a"
      f" {type(tree).__name__}). Pass a tree that holds the optimizer state:"
      " restore a checkpoint into a target, since a restore without one"
      " gives dicts; with Flax NNX, check the `nnx.Optimizer` (or its"
      " `opt_state`), not `nnx.state(...)`, after `nnx.update`."
    )
  return tree
