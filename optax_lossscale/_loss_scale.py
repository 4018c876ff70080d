"""TensorFlow's loss scales as immutable JAX pytrees.

Loss scaling multiplies the loss by a factor before differentiation, so that
small float16 gradients do not underflow, and divides the gradients by the same
factor afterwards (Micikevicius et al., *Mixed Precision Training*, 2018,
arXiv:1710.03740). `DynamicLossScale` adjusts the factor as TensorFlow's
`tf.compat.v1.mixed_precision.DynamicLossScale` does::

  if grads are finite:
    num_good_steps += 1
    if num_good_steps >= increment_period:
      if isfinite(scale * multiplier) and scale * multiplier <= max_loss_scale:
        scale *= multiplier
      num_good_steps = 0
  else:
    scale = max(scale / multiplier, min_loss_scale)
    num_good_steps = 0
  should_apply = grads are finite

The arithmetic is float32, as in TensorFlow, and matches it bit for bit.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Self

import jax
import jax.numpy as jnp
from jax import lax

from optax_lossscale import _numerics, _validation

__all__ = ["DynamicLossScale", "FixedLossScale", "LossScale", "NoOpLossScale"]


def _exact_div(x: jax.Array, divisor: jax.Array | float) -> jax.Array:
  """`x / divisor` for scalars, correctly rounded.

  XLA rewrites a division by a compile-time constant into a multiplication by
  its reciprocal, which differs from IEEE division in the last bit for divisors
  such as 3 or 10. The barrier hides the constant, so the division stays one.
  """
  hidden: jax.Array = lax.optimization_barrier(jnp.asarray(divisor, x.dtype))
  return x / hidden


def _compute_dtype(dtype: Any) -> Any:
  """At least float32: half-precision leaves are scaled in float32."""
  if jnp.issubdtype(dtype, jnp.complexfloating) or jnp.finfo(dtype).bits >= 32:
    return dtype
  return jnp.dtype(jnp.float32)


def _check_leaf(leaf: Any, method: str) -> jax.Array:
  x: jax.Array = jnp.asarray(leaf)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    raise TypeError(
      f"`{method}(tree)` takes floating-point arrays, got a leaf of dtype"
      f" {x.dtype} and shape {x.shape}; integer values cannot be scaled."
    )
  return x


def _map_arrays(fn: Any, tree: Any, method: str) -> Any:
  """Maps `fn` over the array leaves; `None` and `float0` leaves pass as is."""

  def leaf(x: Any) -> Any:
    if x is None or _numerics._is_float0(x):
      return x
    return fn(_check_leaf(x, method))

  return jax.tree.map(leaf, tree, is_leaf=lambda x: x is None)


class LossScale(abc.ABC):
  """The base class of loss scales: a scale factor and how it evolves.

  A loss scale is an immutable pytree: `update` returns a new loss scale rather
  than changing this one. Subclasses are frozen dataclasses registered with
  `jax.tree_util.register_dataclass`, and implement `__call__`, `adjust` and
  `get_config`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> loss_scale: ols.LossScale = ols.DynamicLossScale(initial_loss_scale=4.0)
    >>> scaled_loss = loss_scale.scale(jnp.array(0.5, jnp.float16))
    >>> scaled_loss
    Array(2., dtype=float16)
    >>> grads = loss_scale.unscale({"w": jnp.array([8.0, 4.0])})
    >>> loss_scale, should_apply = loss_scale.update(grads)
    >>> grads["w"], bool(should_apply)
    (Array([2., 1.], dtype=float32), True)
  """

  #: Whether `adjust` depends on the finiteness verdict. Lets the optimizer
  #: skip the finiteness reduction when nothing would read it.
  _needs_finiteness: ClassVar[bool] = True

  @abc.abstractmethod
  def __call__(self) -> jax.Array:
    """Returns the current loss scale as a float32 scalar `jax.Array`."""

  @abc.abstractmethod
  def adjust(self, grads_finite: jax.Array) -> tuple[Self, jax.Array]:
    """Returns `(new_loss_scale, should_apply)` given a finiteness verdict.

    Args:
      grads_finite: a bool scalar, True when the (unscaled) gradients of this
        step are all finite, as `all_finite` computes it.

    Returns:
      The loss scale for the next step and a bool scalar `jax.Array` saying
      whether the gradients of this step should be applied.
    """

  @abc.abstractmethod
  def get_config(self) -> dict[str, Any]:
    """Returns the hyperparameters as a JSON-compatible dict."""

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> Self:
    """Builds a loss scale, in its initial state, from `get_config()`'s dict.

    Args:
      config: a dict as `get_config()` returns it.

    Returns:
      A new loss scale.

    Raises:
      TypeError: if `config` is not a dict or has keys the class does not take.
      ValueError: if a value is invalid.
    """
    where = f"`{cls.__name__}.from_config(config)`"
    if not isinstance(config, dict):
      raise TypeError(f"{where} takes a dict, got {type(config).__name__}.")
    if dataclasses.is_dataclass(cls):
      hyperparameters = {
        f.name for f in dataclasses.fields(cls) if f.metadata.get("static")
      }
      unknown = [k for k in config if k not in hyperparameters]
      if unknown:
        raise ValueError(
          f"{where} got unknown keys {sorted(map(repr, unknown))}; it takes"
          f" {sorted(hyperparameters)}."
        )
    return cls(**config)

  def update(
    self, grads: Any, *, axis_name: _numerics.AxisName = None
  ) -> tuple[Self, jax.Array]:
    """Returns `(new_loss_scale, should_apply)` for this step's gradients.

    The functional form of TensorFlow's `LossScale.update`, which returned
    `(update_op, should_apply_gradients)`.

    Args:
      grads: the unscaled gradients of this step, a pytree (None leaves are
        ignored).
      axis_name: a mapped axis over which replicas must agree (see
        `all_finite`).

    Returns:
      The loss scale for the next step and a bool scalar `jax.Array`.
    """
    finite = (
      _numerics.all_finite(grads, axis_name=axis_name)
      if self._needs_finiteness
      else jnp.array(True)
    )
    return self.adjust(finite)

  def scale(self, tree: Any) -> Any:
    """Multiplies every array leaf of `tree` by the loss scale.

    Each leaf keeps its dtype; the product is computed in at least float32 and
    rounded once. A float16 loss whose scaled value exceeds the float16 range
    becomes inf, as in TensorFlow, and the step is then skipped.

    Args:
      tree: a pytree of floating-point arrays (typically the loss).

    Returns:
      A pytree of the same structure and dtypes. `None` leaves stay `None`.
    """
    s = self()

    def mul(x: jax.Array) -> jax.Array:
      ct = _compute_dtype(x.dtype)
      return (x.astype(ct) * s.astype(ct)).astype(x.dtype)

    return _map_arrays(mul, tree, "scale")

  def unscale(self, tree: Any) -> Any:
    """Divides every array leaf of `tree` by the loss scale.

    Each leaf keeps its dtype. The division is computed in at least float32 as
    a multiplication by the correctly rounded reciprocal of the scale (what
    XLA emits for a division by a scalar, and what TensorFlow's optimizers do),
    so it is exact whenever the scale is a power of two, and the same with and
    without `jit`.

    Args:
      tree: a pytree of floating-point arrays (typically scaled gradients).

    Returns:
      A pytree of the same structure and dtypes. `None` leaves stay `None`.
    """
    s = self()
    inverses: dict[Any, jax.Array] = {}

    def div(x: jax.Array) -> jax.Array:
      ct = _compute_dtype(x.dtype)
      if ct not in inverses:
        inverses[ct] = _exact_div(jnp.ones((), ct), s.astype(ct))
      return (x.astype(ct) * inverses[ct]).astype(x.dtype)

    return _map_arrays(div, tree, "unscale")

  def _may_scale_below_one(self) -> bool:
    """Whether unscaling can enlarge a gradient (and so overflow it)."""
    return False

  def _unscaled_all_finite(
    self, grads: Any, *, axis_name: _numerics.AxisName = None
  ) -> jax.Array:
    """`all_finite(self.unscale(grads))`, reading `grads` once.

    A scale of at least 1 cannot turn a finite gradient into an infinite one,
    so the scaled gradients are checked directly, and the unscaling itself is
    left to be fused into the inner optimizer's update. Only a loss scale that
    can fall below 1 checks the unscaled values (still one fused pass).
    """
    leaves = [_check_leaf(x, "update") for x in _numerics._array_leaves(grads)]
    if self._may_scale_below_one():
      leaves = jax.tree.leaves(self.unscale(leaves))
    return _numerics._verdict(leaves, axis_name)

  def _update_scaled(
    self, grads: Any, *, axis_name: _numerics.AxisName = None
  ) -> tuple[Self, jax.Array]:
    """`self.update(self.unscale(grads))`, checking the scaled `grads`.

    The unscaled gradients are then not read by the check, so their
    computation can fuse into whatever consumes them.
    """
    finite = (
      self._unscaled_all_finite(grads, axis_name=axis_name)
      if self._needs_finiteness
      else jnp.array(True)
    )
    return self.adjust(finite)


def _static(**kwargs: Any) -> Any:
  return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class FixedLossScale(LossScale):
  """A loss scale that never changes: TensorFlow's `FixedLossScale`.

  `update` returns the same loss scale and `should_apply` True, whatever the
  gradients, as TensorFlow does. (`loss_scale_optimizer` still skips
  non-finite steps unless `skip_nonfinite=False`.)

  Args:
    loss_scale_value: the scale, a number of at least 1.

  Raises:
    ValueError: if `loss_scale_value` is below 1, NaN, infinite or not a scalar.
    TypeError: if it is not a number (bools, strings and None included).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> loss_scale = ols.FixedLossScale(128)
    >>> loss_scale()
    Array(128., dtype=float32)
    >>> loss_scale.unscale(jnp.array([256.0, 64.0], jnp.float16))
    Array([2. , 0.5], dtype=float16)
    >>> loss_scale.get_config()
    {'loss_scale_value': 128.0}
  """

  loss_scale_value: float = _static()
  _needs_finiteness: ClassVar[bool] = False

  def __post_init__(self) -> None:
    value = _validation.scalar(
      "FixedLossScale", "loss_scale_value", self.loss_scale_value
    )
    if value < 1:
      raise ValueError(
        "`FixedLossScale(loss_scale_value=...)` must be at least 1, got"
        f" {self.loss_scale_value!r}."
      )
    object.__setattr__(self, "loss_scale_value", value)

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.loss_scale_value, jnp.float32)

  def adjust(self, grads_finite: jax.Array) -> tuple[Self, jax.Array]:
    del grads_finite
    return self, jnp.array(True)

  def get_config(self) -> dict[str, Any]:
    return {"loss_scale_value": self.loss_scale_value}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(LossScale):
  """A loss scale of 1 that never skips: one code path for every precision.

  Use it for bfloat16 and float32 training, which need no loss scaling, so
  that the same train step serves float16 with a real loss scale.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> loss_scale = ols.NoOpLossScale()
    >>> loss_scale()
    Array(1., dtype=float32)
    >>> new_loss_scale, should_apply = loss_scale.update([jnp.array(jnp.nan)])
    >>> should_apply
    Array(True, dtype=bool)
  """

  _needs_finiteness: ClassVar[bool] = False

  def __call__(self) -> jax.Array:
    return jnp.ones((), jnp.float32)

  def adjust(self, grads_finite: jax.Array) -> tuple[Self, jax.Array]:
    del grads_finite
    return self, jnp.array(True)

  def scale(self, tree: Any) -> Any:
    return _map_arrays(lambda x: x, tree, "scale")

  def unscale(self, tree: Any) -> Any:
    return _map_arrays(lambda x: x, tree, "unscale")

  def get_config(self) -> dict[str, Any]:
    return {}


class _Fresh:
  """Marks array fields a constructor call should initialise."""

  def __repr__(self) -> str:
    return "<initial>"


_FRESH: Any = _Fresh()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(LossScale):
  """A loss scale that adapts to the gradients: TensorFlow's algorithm.

  Every `increment_period` consecutive steps with finite gradients, the scale
  is multiplied by `multiplier` (if the product is finite and at most
  `max_loss_scale`). On a step with a non-finite gradient, the scale is divided
  by `multiplier`, floored at `min_loss_scale`, the good-step counter resets and
  `should_apply` is False. The float32 arithmetic matches TensorFlow's
  `DynamicLossScale` bit for bit, for any multiplier.

  The array state is `current_loss_scale` (float32) and `num_good_steps`
  (int32); the hyperparameters are static. Pass the state fields only to
  rebuild a loss scale from saved arrays.

  Args:
    initial_loss_scale: the starting scale. The default, 2**15, is about half
      the largest float16: a scale that is too high falls quickly, one that is
      too low rises slowly.
    increment_period: how many consecutive finite steps raise the scale.
    multiplier: the factor by which the scale rises and falls; greater than 1.
    min_loss_scale: the floor of the scale (TensorFlow's is 1).
    max_loss_scale: the ceiling of the scale; None means float32's maximum.
    current_loss_scale: the current scale, to restore a saved state.
    num_good_steps: the good-step counter, to restore a saved state.

  Raises:
    TypeError: if an argument has the wrong type (bools and strings included).
    ValueError: if `increment_period < 1`, `multiplier <= 1`, or
      `0 < min_loss_scale <= initial_loss_scale <= max_loss_scale` does not
      hold with finite float32 values.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> loss_scale = ols.DynamicLossScale(initial_loss_scale=8.0,
    ...                                   increment_period=2)
    >>> for grad in [1.0, 1.0, jnp.inf, 1.0]:
    ...   loss_scale, should_apply = loss_scale.update({"w": jnp.array(grad)})
    ...   print(float(loss_scale()), bool(should_apply))
    8.0 True
    16.0 True
    8.0 False
    8.0 True
  """

  initial_loss_scale: float = _static(default=2.0**15)
  increment_period: int = _static(default=2000)
  multiplier: float = _static(default=2.0)
  min_loss_scale: float = _static(default=1.0, kw_only=True)
  max_loss_scale: float | None = _static(default=None, kw_only=True)
  current_loss_scale: jax.Array = dataclasses.field(
    default=_FRESH, kw_only=True
  )
  num_good_steps: jax.Array = dataclasses.field(default=_FRESH, kw_only=True)

  def __post_init__(self) -> None:
    fresh = self.current_loss_scale is _FRESH
    if fresh or self.num_good_steps is _FRESH:
      # The public constructor. (Unflattening, with arbitrary leaves, passes
      # the already validated hyperparameters and skips this.)
      self._validate()
      if fresh:
        object.__setattr__(
          self,
          "current_loss_scale",
          jnp.asarray(self.initial_loss_scale, jnp.float32),
        )
      if self.num_good_steps is _FRESH:
        object.__setattr__(self, "num_good_steps", jnp.zeros((), jnp.int32))

  def _validate(self) -> None:
    call = "DynamicLossScale"
    initial = _validation.scalar(
      call, "initial_loss_scale", self.initial_loss_scale
    )
    period = _validation.integer(
      call, "increment_period", self.increment_period, minimum=1
    )
    multiplier = _validation.scalar(call, "multiplier", self.multiplier)
    if not multiplier > 1:
      raise ValueError(
        f"`{call}(multiplier=...)` must be greater than 1, got"
        f" {self.multiplier!r}."
      )
    minimum = _validation.scalar(call, "min_loss_scale", self.min_loss_scale)
    if not minimum > 0:
      raise ValueError(
        f"`{call}(min_loss_scale=...)` must be greater than 0, got"
        f" {self.min_loss_scale!r}."
      )
    if self.max_loss_scale is None:
      maximum = None
    else:
      maximum = _validation.scalar(call, "max_loss_scale", self.max_loss_scale)
    if initial < minimum:
      raise ValueError(
        f"`{call}(initial_loss_scale=...)` must be at least min_loss_scale="
        f"{minimum!r}, got {self.initial_loss_scale!r}."
      )
    if maximum is not None and maximum < initial:
      raise ValueError(
        f"`{call}(max_loss_scale=...)` must be at least initial_loss_scale="
        f"{initial!r}, got {self.max_loss_scale!r}."
      )
    for name, value in [
      ("initial_loss_scale", initial),
      ("increment_period", period),
      ("multiplier", multiplier),
      ("min_loss_scale", minimum),
      ("max_loss_scale", maximum),
    ]:
      object.__setattr__(self, name, value)

  def __call__(self) -> jax.Array:
    # `asarray` unwraps containers such as Flax NNX's optimizer variables.
    return jnp.asarray(self.current_loss_scale)

  def _may_scale_below_one(self) -> bool:
    return self.min_loss_scale < 1

  def adjust(self, grads_finite: jax.Array) -> tuple[Self, jax.Array]:
    grads_finite = jnp.asarray(grads_finite, jnp.bool_)
    scale = self.current_loss_scale
    multiplier = jnp.float32(self.multiplier)

    good_steps = self.num_good_steps + 1
    increase = good_steps >= self.increment_period
    raised = scale * multiplier
    can_raise = jnp.isfinite(raised)
    if self.max_loss_scale is not None:
      can_raise &= raised <= jnp.float32(self.max_loss_scale)
    grown = jnp.where(increase & can_raise, raised, scale)
    good_steps = jnp.where(increase, 0, good_steps)

    lowered = jnp.maximum(
      _exact_div(scale, multiplier), jnp.float32(self.min_loss_scale)
    )
    new_scale = jnp.where(grads_finite, grown, lowered)
    new_good_steps = jnp.where(grads_finite, good_steps, 0).astype(jnp.int32)
    new = dataclasses.replace(
      self, current_loss_scale=new_scale, num_good_steps=new_good_steps
    )
    return new, grads_finite

  def get_config(self) -> dict[str, Any]:
    return {
      "initial_loss_scale": self.initial_loss_scale,
      "increment_period": self.increment_period,
      "multiplier": self.multiplier,
      "min_loss_scale": self.min_loss_scale,
      "max_loss_scale": self.max_loss_scale,
    }

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> Self:
    """Builds a `DynamicLossScale` from `get_config()`'s dict.

    TensorFlow's three-key config (`initial_loss_scale`, `increment_period`,
    `multiplier`) is accepted too; the bounds then take their defaults, which
    are TensorFlow's.

    Args:
      config: a dict as `get_config()` or TensorFlow wrote it.

    Returns:
      A new `DynamicLossScale` in its initial state.
    """
    return super().from_config(config)
