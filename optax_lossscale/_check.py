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
from optax_lossscale._states import LossScaleOptimizerState

__all__ = ["check_state"]

T = TypeVar("T")

# The counters of `LossScaleOptimizerState` checked by name; fields this list
# does not name are searched for loss scales, not checked themselves.
_COUNTERS = (
  "skipped_steps",
  "consecutive_skipped_steps",
  "nonfinite_loss_steps",
  "retries",
)
# The counters of a `SkipRecord` (the last skipped step).
_RECORD_COUNTERS = ("skipped_steps", "consecutive_skipped_steps", "nonfinite")
_CALL = "`check_state(tree)`"


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


def _check_counters(state: LossScaleOptimizerState, where: str) -> None:
  counters = {name: _unwrapped(getattr(state, name)) for name in _COUNTERS}
  for name, value in counters.items():
    if value is not None:  # None in a state restored from 0.1.0
      _validation.elements(
        f"{where}.{name}`",
        value,
        integer=True,
        low=0,
        expected="non-negative",
      )
  consecutive = _validation.host_pieces(counters["consecutive_skipped_steps"])
  skipped = _validation.host_pieces(counters["skipped_steps"])
  for (offset, c), (_, s) in zip(consecutive, skipped, strict=False):
    c, s = np.broadcast_arrays(c, s)
    index = _validation.first_bad(c <= s)
    if index is not None:
      raise ValueError(
        f"{where}.consecutive_skipped_steps` must be at most"
        f" `skipped_steps`, got {_validation.element(offset, c, index)}"
        f", with skipped_steps={s[index].item()!r}."
      )


def _check_record(state: LossScaleOptimizerState, where: str) -> None:
  """The last skip's counters are non-negative integers."""
  if state.last_skip is None:  # a state restored from 0.1.0
    return
  for name in _RECORD_COUNTERS:
    _validation.elements(
      f"{where}.last_skip.{name}`",
      _unwrapped(getattr(state.last_skip, name)),
      integer=True,
      low=0,
      expected="non-negative",
    )


def _walk(tree: Any, prefix: tuple[Any, ...]) -> int:
  """Checks what `tree` holds; returns how many loss scales were found."""
  found = 0
  nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_found)
  for path, node in nodes:
    path = prefix + tuple(path)
    where = f"{_CALL}: `tree{jax.tree_util.keystr(path)}"
    if isinstance(node, LossScaleOptimizerState):
      _check_counters(node, where)
      _check_record(node, where)
      for name, value in node._asdict().items():
        if name not in _COUNTERS:
          key = jax.tree_util.GetAttrKey(name)
          found += _walk(value, (*path, key))
    elif isinstance(node, LossScale):
      found += 1
      if isinstance(node, DynamicLossScale):
        state = {
          name: _unwrapped(getattr(node, name))
          for name in ("current_loss_scale", "num_good_steps")
        }
        if node.hysteresis > 1:
          state["hysteresis_budget"] = _unwrapped(node.hysteresis_budget)

        def describe(name: str, where: str = where) -> str:
          return f"{where}.{name}`"

        check_state_values(node, state, describe)
  return found


def check_state(tree: T) -> T:
  """Checks the loss scales and skip counters in a pytree, on the host.

  Finds every `LossScaleOptimizerState` and `LossScale` in `tree` (a restored
  checkpoint, a Flax linen `TrainState`, an `nnx.Optimizer` or its
  `opt_state`, an optimizer state of any nesting) and checks their concrete
  values, element by element for states stacked over replicas (`pmap`):

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
  it has concrete values to check (abstract ones pass).

  Args:
    tree: any pytree holding at least one loss scale. Restore a checkpoint
      into a target (a freshly initialised state): without one, Orbax returns
      dicts, whose loss scales have lost their type and hyperparameters.

  Returns:
    `tree`, unchanged.

  Raises:
    ValueError: naming the field (its path in `tree`) and the offending value
      (and its index, in a stacked state), or if `tree` holds no loss scale.
    TypeError: if a value has the wrong dtype (a float counter).

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
  if not _walk(tree, ()):
    raise ValueError(
      f"{_CALL} found no loss scale in `tree` (a"
      f" {type(tree).__name__}). Pass a tree that holds the optimizer state:"
      " restore a checkpoint into a target, since a restore without one"
      " gives dicts; with Flax NNX, check the `nnx.Optimizer` (or its"
      " `opt_state`), not `nnx.state(...)`, after `nnx.update`."
    )
  return tree
