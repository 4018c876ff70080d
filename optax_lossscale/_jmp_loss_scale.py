"""jmp's loss scales and `select_tree`, with jmp's bugs fixed.

The same classes, fields, pytree layouts and arithmetic as jmp 0.0.4, so that
scales and counters are bit for bit jmp's eager results. What differs is what
was broken: `min_loss_scale`, `period` and `factor` survive every pytree
operation, the backoff division is exact under `jit` too, the arithmetic
works under strict dtype promotion, the loss scale can be lowered ahead of
time with `jax.jit(...).lower`, and `select_tree` takes a Python bool.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale import _numerics

__all__ = [
  "DynamicLossScale",
  "LossScale",
  "NoOpLossScale",
  "StaticLossScale",
  "select_tree",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """A loss scale of 1 that returns its inputs: jmp's `NoOpLossScale`.

  A pytree without leaves.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import jmp
    >>> loss_scale = jmp.NoOpLossScale()
    >>> loss_scale.loss_scale
    1
    >>> tree = {"w": jnp.ones(2)}
    >>> loss_scale.scale(tree) is tree
    True
  """

  @property
  def loss_scale(self) -> int:
    """The scale, 1."""
    return 1

  def scale(self, tree: T) -> T:
    """Returns `tree` itself."""
    return tree

  def unscale(self, tree: T) -> T:
    """Returns `tree` itself."""
    return tree

  def adjust(self, grads_finite: Any) -> NoOpLossScale:
    """Returns this loss scale."""
    del grads_finite
    return self


def _times(tree: T, factor: Any) -> T:
  """Every leaf of `tree` times `factor`, with JAX's promotion, as in jmp."""
  result: T = jax.tree.map(lambda x: x * factor, tree)
  return result


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """Scales and unscales by a constant: jmp's `StaticLossScale`.

  A pytree without leaves: the scale is static, part of the tree structure.
  `scale` multiplies every leaf by it and `unscale` by its reciprocal, with
  JAX's usual promotion (a float16 leaf times a float32 array is float32).

  Args:
    loss_scale: the scale, a number or a scalar array.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import jmp
    >>> loss_scale = jmp.StaticLossScale(4.0)
    >>> loss_scale.scale(jnp.array([1.0, 2.0]))
    Array([4., 8.], dtype=float32)
    >>> loss_scale.unscale(jnp.array([1.0, 2.0]))
    Array([0.25, 0.5 ], dtype=float32)
  """

  loss_scale: Any

  def scale(self, tree: T) -> T:
    """Multiplies every leaf of `tree` by the scale."""
    return _times(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Multiplies every leaf of `tree` by the reciprocal of the scale."""
    return _times(tree, 1 / self.loss_scale)

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    """Returns this loss scale."""
    del grads_finite
    return self


def _self_as_structure(cls: type[Any]) -> None:
  """No leaves: the object itself is the static part of the tree, as in jmp."""
  jax.tree_util.register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)


_self_as_structure(NoOpLossScale)
_self_as_structure(StaticLossScale)


def _warn_if_not_floating(value: Any, name: str) -> None:
  """jmp's warning for a non-floating scale.

  Leaves that carry no dtype (None, `object()`, the placeholders `jax.jit(...)
  .lower` and other tree maps put in) are not values, and pass silently.
  """
  dtype: Any
  if isinstance(value, (bool, int, float, complex)):
    dtype = jnp.result_type(value)
  else:
    dtype = getattr(value, "dtype", None)
    if not isinstance(dtype, np.dtype):
      return
  if not jnp.issubdtype(dtype, jnp.floating):
    warnings.warn(
      f"Expected floating type for {name}, got {dtype}", stacklevel=4
    )


def _is_python_number(x: Any) -> bool:
  return type(x) in (int, float)


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """A loss scale that grows while gradients are finite: jmp's algorithm.

  Every `period` consecutive steps with finite gradients the scale is
  multiplied by `factor` (if the product is finite); on a step with
  a non-finite gradient it is divided by `factor`, floored at
  `min_loss_scale`, and the counter restarts::

    if grads_finite:
      if counter == period - 1:
        loss_scale = loss_scale * factor if finite else loss_scale
      counter = (counter + 1) % period
    else:
      loss_scale = max(min_loss_scale, loss_scale / factor)
      counter = 0

  The pytree leaves are `[loss_scale, counter]`, as in jmp; `period` and
  `factor` are static, and so is `min_loss_scale` when it is a NumPy or
  Python number (jmp's default is `np.ones([], np.float32)`). A floor that
  is a JAX array, such as one built inside `jit` or `pmap`
  (`DynamicLossScale(x, min_loss_scale=x / 2)`), is a third leaf, mapped and
  replicated with the state. All of them survive `jax.tree.map`, `jit`,
  `pmap`, `lax.scan` and `jax.tree.unflatten` (jmp forgets `min_loss_scale`).
  Results are jmp's eager ones bit for bit, with and without `jit`, and
  whatever `jax_numpy_dtype_promotion` says.

  Args:
    loss_scale: the current scale, a floating-point scalar (a Python float
      becomes a float32 array at the first `adjust`, as in jmp: pass
      `jnp.float32(...)` to trace a jitted step only once).
    counter: the number of consecutive finite steps since the scale last
      changed, an int32 scalar in `[0, period)`.
    period: how many consecutive finite steps grow the scale.
    factor: the growth and backoff factor.
    min_loss_scale: the floor of the scale, a floating-point scalar: static
      as a NumPy or Python number, a leaf as a JAX array. Any positive floor
      is kept, also below 1.

  Raises:
    TypeError: if `period` or `factor` is a traced value.
    ValueError: if `period` or `factor` is not positive.

  Warns:
    UserWarning: if `loss_scale` or `min_loss_scale` is not floating-point,
      as in jmp.

  Examples:
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from optax_lossscale import jmp
    >>> loss_scale = jmp.DynamicLossScale(jnp.float32(8.0), period=2,
    ...                                   min_loss_scale=np.float32(0.5))
    >>> for finite in [True, True, False, False, False, False, False]:
    ...   loss_scale = loss_scale.adjust(jnp.bool_(finite))
    ...   print(float(loss_scale.loss_scale), int(loss_scale.counter))
    8.0 1
    16.0 0
    8.0 0
    4.0 0
    2.0 0
    1.0 0
    0.5 0

    A floor built under `jit` is a third leaf, and is kept:

    >>> import jax
    >>> init = jax.jit(lambda s: jmp.DynamicLossScale(s, min_loss_scale=s / 4))
    >>> loss_scale = init(jnp.float32(8.0))
    >>> len(jax.tree.leaves(loss_scale)), float(loss_scale.min_loss_scale)
    (3, 2.0)
  """

  loss_scale: Any
  counter: Any = dataclasses.field(
    default_factory=lambda: np.zeros([], np.int32)
  )
  period: Any = 2000
  factor: Any = 2
  min_loss_scale: Any = dataclasses.field(
    default_factory=lambda: np.ones([], np.float32)
  )
  # Whether `min_loss_scale` is a pytree leaf: a JAX array (traced under
  # `jit` or `pmap` included) is; a NumPy or Python floor is static.
  _floor_is_leaf: bool = dataclasses.field(
    init=False, repr=False, compare=False
  )

  def __post_init__(self) -> None:
    # Runs on every unflattening too, with whatever leaves it is given.
    _warn_if_not_floating(self.loss_scale, "loss_scale")
    _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
    floor_is_leaf = isinstance(self.min_loss_scale, jax.Array)
    object.__setattr__(self, "_floor_is_leaf", floor_is_leaf)
    for name in ("period", "factor"):
      value = getattr(self, name)
      if isinstance(value, jax.core.Tracer):
        raise TypeError(
          f"`DynamicLossScale({name}=...)` must be a concrete value (it is"
          " static, part of the pytree structure), got a traced value; build"
          " the loss scale outside `jit`, or pass it in."
        )
      if isinstance(value, (int, float, np.number)) and not value > 0:
        raise ValueError(
          f"`DynamicLossScale({name}=...)` must be positive, got {value!r}."
        )

  def scale(self, tree: T) -> T:
    """Multiplies every leaf of `tree` by the scale."""
    return _times(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Multiplies every leaf of `tree` by the reciprocal of the scale."""
    return _times(tree, 1 / self.loss_scale)

  def _backed_off(self) -> Any:
    if _is_python_number(self.loss_scale) and _is_python_number(self.factor):
      return self.loss_scale / self.factor  # Python's division, as in jmp
    return _numerics.exact_div(self.loss_scale, self.factor)

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """Returns the loss scale for the next step.

    Args:
      grads_finite: a bool scalar, whether this step's gradients are all
        finite (`all_finite(grads)`).

    Returns:
      A new `DynamicLossScale` with the same `period`, `factor` and
      `min_loss_scale`.

    Raises:
      AssertionError: if `grads_finite` is not a scalar, as in jmp.
    """
    if np.ndim(grads_finite) != 0:
      raise AssertionError("Expected boolean scalar")
    # jmp's arithmetic is defined by JAX's standard promotion (an int32
    # counter times a bool, a float32 floor against a scale).
    with jax.numpy_dtype_promotion("standard"):
      scale = self.loss_scale
      grown = scale * self.factor
      grown = lax.select(jnp.isfinite(grown).all(), grown, scale)
      kept = lax.select(self.counter == self.period - 1, grown, scale)
      lowered = jnp.maximum(self.min_loss_scale, self._backed_off())
      if lowered.dtype != kept.dtype:
        # A float16 or bfloat16 scale against jmp's float32 floor.
        lowered = lowered.astype(kept.dtype)
      loss_scale = lax.select(grads_finite, kept, lowered)
      counter = ((self.counter + 1) % self.period) * grads_finite
    new = dataclasses.replace(self, loss_scale=loss_scale, counter=counter)
    # The floor keeps its place in the tree (a leaf restored as a NumPy
    # array stays a leaf), so the next step's structure is this one's.
    object.__setattr__(new, "_floor_is_leaf", self._floor_is_leaf)
    return new


def _flatten_dynamic(
  ls: DynamicLossScale,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """jmp's leaves, `[loss_scale, counter]`, and the floor where it is a leaf.

  The static part has the floor exactly when the leaves do not.
  """
  if ls._floor_is_leaf:
    leaves = (ls.loss_scale, ls.counter, ls.min_loss_scale)
    return leaves, (ls.period, ls.factor)
  return (ls.loss_scale, ls.counter), (ls.period, ls.factor, ls.min_loss_scale)


def _unflatten_dynamic(
  static: tuple[Any, ...], leaves: Any
) -> DynamicLossScale:
  if len(static) == 3:
    (loss_scale, counter), (period, factor, floor) = leaves, static
    return DynamicLossScale(loss_scale, counter, period, factor, floor)
  (loss_scale, counter, floor), (period, factor) = leaves, static
  ls = DynamicLossScale(loss_scale, counter, period, factor, floor)
  # A leaf stays a leaf whatever it holds (None, `jax.ShapeDtypeStruct`,
  # a NumPy array from a checkpoint): the structure is the tree's own.
  object.__setattr__(ls, "_floor_is_leaf", True)
  return ls


# Registered without keys, as jmp registers it: a leaf's key path is its index
# ([0], [1], and [2] for a floor that is a leaf), so checkpoints written by
# jmp restore into this class.
jax.tree_util.register_pytree_node(
  DynamicLossScale, _flatten_dynamic, _unflatten_dynamic
)

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
"""Any of the three loss scales, as jmp's `LossScale` union."""


def select_tree(pred: Any, a: T, b: T) -> T:
  """Returns `a` if `pred` else `b`, two pytrees of the same structure.

  jmp's `select_tree`: one `lax.select` per leaf. XLA fuses each select with
  the computation of its leaves, so a donated step needs no more memory than
  without it. Values, dtypes, weak types, `vmap`, gradients and, inside
  `jax.shard_map`, varying axes are `lax.select`'s, as in jmp.

  Args:
    pred: a bool scalar (a Python bool is accepted).
    a: the tree to return when `pred` is True.
    b: the tree to return when `pred` is False, with the same structure,
      shapes and dtypes as `a`.

  Returns:
    A pytree of arrays, `a`'s or `b`'s values.

  Raises:
    AssertionError: "expected boolean scalar", as in jmp, if `pred` is not
      a bool scalar.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import jmp
    >>> new = {"w": jnp.array([1.0, 2.0])}
    >>> old = {"w": jnp.array([0.0, 0.0])}
    >>> jmp.select_tree(jmp.all_finite(new), new, old)
    {'w': Array([1., 2.], dtype=float32)}
  """
  is_bool = isinstance(pred, bool) or getattr(pred, "dtype", None) == np.bool_
  if not is_bool or np.ndim(pred) != 0:
    raise AssertionError("expected boolean scalar")
  result: T = jax.tree.map(lambda x, y: lax.select(pred, x, y), a, b)
  return result
