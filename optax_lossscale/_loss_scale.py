"""TensorFlow's loss scales as immutable JAX pytrees.

Loss scaling multiplies the loss by a factor before differentiation, so that
small float16 gradients do not underflow, and divides the gradients by the
same factor afterwards (Micikevicius et al., *Mixed Precision Training*,
2018, arXiv:1710.03740). `DynamicLossScale` adjusts the factor as
TensorFlow's `tf.compat.v1.mixed_precision.DynamicLossScale` does, in float32
and bit for bit::

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
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale import _numerics
from optax_lossscale._validation import FLOAT32_MAX, boolean, integer, scalar

__all__ = ["DynamicLossScale", "FixedLossScale", "LossScale", "NoOpLossScale"]


def multiply_floats(
  tree: Any, factor: jax.Array, twos: Sequence[Any] = ()
) -> Any:
  """Each float leaf times `factor` and the powers of two `twos`, in at least
  float32; the others pass as they are.

  Each leaf keeps its dtype: it is widened, multiplied by each power of two
  (exactly, unless the product is subnormal anyway), then by `factor` cast
  to that width, and the product is rounded once.
  """

  def leaf(x: Any) -> Any:
    if not _numerics.is_float(x):
      return x
    x = jnp.asarray(x)
    if jnp.iscomplexobj(x):  # part by part: (inf + 0j) * (s + 0j) has a NaN
      return jax.lax.complex(leaf(jnp.real(x)), leaf(jnp.imag(x)))
    product = _numerics.wide(x)
    for by in (*twos, factor):
      product = product * by.astype(product.dtype)
    return product.astype(x.dtype)

  return jax.tree.map(leaf, tree)  # None is an empty subtree: it stays


def reciprocal(scale: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
  """`1 / scale` as `(factor, twos)` for `multiply_floats`: the correctly
  rounded reciprocal of its mantissa, and its power of two in two normal
  halves. The reciprocal of a scale above 2**126 is below float32's least
  normal number, which XLA:CPU and accelerators flush to 0; its parts are
  not. Compute it outside a conditional that multiplies by it: XLA copies
  scalar work done inside one into every leaf's kernel."""
  mantissa, exponent = jnp.frexp(scale)
  half = -exponent // 2
  two = lambda k: jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)  # noqa: E731
  # Behind a barrier, XLA cannot fold constant halves into one subnormal.
  twos = jax.lax.optimization_barrier([two(half), two(-exponent - half)])
  return 1 / mantissa, twos


class LossScale(abc.ABC):
  """The base class of loss scales: a scale factor and how it evolves.

  A loss scale is an immutable pytree: `update` and `adjust` return a new one.
  The built-in ones are frozen dataclasses registered with
  `jax.tree_util.register_dataclass`: their hyperparameters are static, their
  state (if any) are array leaves, and `dataclasses.replace` works on them. A
  subclass must be such a pytree and implement `__call__`, `adjust` and
  `get_config`; it may implement `lowered` to support
  `LossScaleOptimizer.minimize(..., max_retries=k)`.

  Loss scales compare by identity: `DynamicLossScale() == DynamicLossScale()`
  is False. Their leaves are arrays, whose `==` is elementwise and, under
  `jit`, has no truth value. Compare the scales, `float(a()) == float(b())`,
  or the hyperparameters, `a.get_config() == b.get_config()`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> loss_scale = ols.DynamicLossScale(initial_loss_scale=4.0)
    >>> loss_scale.scale(jnp.array(0.5, jnp.float16))
    Array(2., dtype=float16)
    >>> grads = loss_scale.unscale({"w": jnp.array([8.0, 4.0])})
    >>> loss_scale, should_apply = loss_scale.update(grads)
    >>> grads["w"], bool(should_apply)
    (Array([2., 1.], dtype=float32), True)
  """

  @abc.abstractmethod
  def __call__(self) -> jax.Array:
    """Returns the current loss scale, a float32 scalar `jax.Array`."""

  def __float__(self) -> float:
    """Raises a `TypeError` that says how to read the scale: a loss scale is
    a pytree of its state, and `float(loss_scale())` is its value."""
    raise TypeError(
      f"float() of a {type(self).__name__}: it is a pytree of its state;"
      " read the scale with `float(loss_scale())`."
    )

  @abc.abstractmethod
  def adjust(self, grads_finite: jax.Array) -> tuple[Self, jax.Array]:
    """Returns `(new_loss_scale, should_apply)` given a finiteness verdict.

    Args:
      grads_finite: a bool scalar, True when this step's gradients are all
        finite once unscaled.

    Returns:
      The loss scale for the next step, of this one's pytree structure, and
      a bool scalar: whether this step's gradients should be applied.
    """

  @abc.abstractmethod
  def get_config(self) -> dict[str, Any]:
    """Returns the hyperparameters as a JSON-compatible dict."""

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> Self:
    """Builds a loss scale, in its initial state, from `get_config()`'s dict.

    Args:
      config: a dict as `get_config()` returns it (for `DynamicLossScale`,
        TensorFlow's three-key config too).

    Returns:
      A new loss scale.

    Raises:
      TypeError: if `config` is not a dict, or a value has the wrong type.
      ValueError: if `config` has a key that is not a hyperparameter of the
        class, or a value is invalid.
    """
    where = f"`{cls.__name__}.from_config(config)`"
    if not isinstance(config, dict):
      raise TypeError(f"{where} takes a dict, got {type(config).__name__}.")
    if dataclasses.is_dataclass(cls):  # a subclass need not be one
      fields = dataclasses.fields(cls)
      known = sorted(f.name for f in fields if f.metadata.get("static"))
      if extra := sorted(set(config) - set(known)):
        raise ValueError(f"{where} got unknown keys {extra}; it takes {known}.")
    return cls(**config)

  def update(
    self, grads: Any, *, axis_name: _numerics.AxisName = None
  ) -> tuple[Self, jax.Array]:
    """Returns `(new_loss_scale, should_apply)` for this step's gradients.

    The functional form of TensorFlow's `LossScale.update`.

    Args:
      grads: the unscaled gradients, a pytree (None leaves are ignored).
      axis_name: a mapped axis whose replicas must agree (see `all_finite`).

    Returns:
      The loss scale for the next step and a bool scalar `jax.Array`.
    """
    return self.adjust(_numerics.all_finite(grads, axis_name=axis_name))

  def scale(self, tree: Any) -> Any:
    """Multiplies every float leaf of `tree` by the loss scale.

    Each leaf keeps its dtype; the product is computed in at least float32
    and rounded once. A float16 loss whose scaled value overflows becomes
    inf, as in TensorFlow; the backward pass still sees only the scale (the
    scaling is linear), so that alone does not skip the step. Pass the
    unscaled loss as `value=` to skip on a non-finite loss.

    Args:
      tree: a pytree of arrays, typically the loss.

    Returns:
      A pytree of the same structure and dtypes; None, integer, bool and
      `float0` leaves pass unchanged.
    """
    return multiply_floats(tree, self())

  def unscale(self, tree: Any) -> Any:
    """Divides every float leaf of `tree` by the loss scale.

    Each leaf keeps its dtype. It is multiplied, in at least float32, by the
    correctly rounded reciprocal of the scale (what XLA makes of a division
    by a scalar, and what TensorFlow's optimizers do): exact whenever the
    scale is a power of two, and the same with and without `jit`. Its
    power of two is applied apart, so that a scale above 2**126, whose
    reciprocal is subnormal, still unscales.

    Args:
      tree: a pytree of arrays, typically scaled gradients.

    Returns:
      A pytree of the same structure and dtypes; None, integer, bool and
      `float0` leaves pass unchanged.
    """
    return multiply_floats(tree, *reciprocal(self()))

  def lowered(self) -> Self | None:
    """Returns the loss scale to retry an overflowed step with, or None.

    `LossScaleOptimizer.minimize(..., max_retries=k)` recomputes an
    overflowed batch with it. None (this base implementation) means the
    scale cannot be lowered, and `max_retries > 0` is refused.

    Returns:
      A new loss scale, or None.

    Examples:
      >>> import optax_lossscale as ols
      >>> float(ols.DynamicLossScale(8.0).lowered()())
      4.0
      >>> print(ols.FixedLossScale(8.0).lowered())
      None
    """
    return None


def _static(check: Any = None, **kwargs: Any) -> Any:
  """A hyperparameter: a static field, and how `__post_init__` checks it."""
  return dataclasses.field(metadata=dict(static=True, check=check), **kwargs)


_TENSORFLOW_KEYS = ("initial_loss_scale", "increment_period", "multiplier")


@dataclasses.dataclass(frozen=True, eq=False)
class _BuiltIn(LossScale):
  """A built-in loss scale: its `_static` fields, its hyperparameters, are
  checked on construction and make its config."""

  def __post_init__(self) -> None:
    # Also on every unflattening, with any leaves (tracers, shardings, None):
    # only the Python hyperparameters are checked. A field whose default is
    # None takes None unchecked.
    for field in dataclasses.fields(self):
      name, check = field.name, field.metadata.get("check")
      value = getattr(self, name)
      if check and (value is not None or field.default is not None):
        object.__setattr__(self, name, check(type(self).__name__, name, value))

  def get_config(self) -> dict[str, Any]:
    # TensorFlow's keys, then the other hyperparameters that are not their
    # defaults: with TensorFlow's bounds, the config is exactly TensorFlow's.
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.metadata.get("static")
      and (f.name in _TENSORFLOW_KEYS or getattr(self, f.name) != f.default)
    }


class _Constant(_BuiltIn):
  """A scale that never changes: its `update` always applies."""

  def adjust(self, grads_finite: jax.Array) -> tuple[Self, jax.Array]:
    return self, jnp.array(True)


# One factor raises and lowers the scale: GradScaler's backoff_factor=0.5
# is multiplier=2.
_MULTIPLIER = "greater than 1 (the scale grows by it and backs off by it)"


def _require(ok: bool, call: str, name: str, wanted: str, value: Any) -> None:
  """Raises a `ValueError` unless `ok`: `call`'s `name` must be `wanted`."""
  if not ok:
    raise ValueError(f"`{call}({name}=...)` must be {wanted}, got {value!r}.")


def _at_least_1(call: str, name: str, value: Any) -> float:
  """`value` as a Python float of at least 1 (see `scalar`), or raises."""
  result = scalar(call, name, value)
  _require(result >= 1, call, name, "at least 1", value)
  return result


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class FixedLossScale(_Constant):
  """A loss scale that never changes: TensorFlow's `FixedLossScale`.

  Its `update` returns the same loss scale and `should_apply` True, whatever
  the gradients, as TensorFlow's does. (`LossScaleOptimizer` still skips
  non-finite steps unless `skip_nonfinite=False`.)

  Args:
    loss_scale_value: the scale, a number of at least 1.

  Raises:
    ValueError: if `loss_scale_value` is below 1 or not finite in float32.
    TypeError: if it is not a real number (bools included).

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

  loss_scale_value: float = _static(_at_least_1)

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.loss_scale_value, jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(_Constant):
  """A loss scale of 1: one code path for every precision.

  For bfloat16 and float32 training, which need no loss scaling, so that the
  same train step serves float16 with a real loss scale. Its `update`
  returns `should_apply` True whatever the gradients; `LossScaleOptimizer`
  still skips non-finite steps unless `skip_nonfinite=False`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> ols.NoOpLossScale()()
    Array(1., dtype=float32)
  """

  def __call__(self) -> jax.Array:
    return jnp.ones((), jnp.float32)


class _Initial:
  """The default of a state field: the initial value, made on construction."""

  def __repr__(self) -> str:
    return "<initial>"


_INITIAL: Any = _Initial()
_positive = functools.partial(integer, minimum=1)
_TINY = float(np.finfo(np.float32).tiny)  # below it, a scale flushes to 0
# What `min_loss_scale` must be.
_NORMAL = f"at least {_TINY:g}, float32's least normal number"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(_BuiltIn):
  """A loss scale that adapts to the gradients: TensorFlow's algorithm.

  Every `increment_period` consecutive steps with finite gradients, the scale
  is multiplied by `multiplier` (if the product is finite and at most
  `max_loss_scale`). A step with a non-finite gradient is not applied, the
  good-step count restarts, and the scale is divided by `multiplier`
  (floored at `min_loss_scale`). With the default `hysteresis=1` this is
  TensorFlow's algorithm, bit for bit, for any multiplier.

  With `hysteresis=h > 1` (Megatron-LM's `hysteresis`, DeepSpeed's
  `delayed_shift`), a non-finite step lowers the scale only once `h` of them
  have counted since the scale last grew::

    if grads are finite:
      if consecutive_hysteresis: num_bad_steps = 0
      (TensorFlow's rule; when the scale grows or is capped, num_bad_steps = 0)
    else:
      num_bad_steps = min(num_bad_steps + 1, hysteresis)
      num_good_steps = 0
      if num_bad_steps == hysteresis: lower the scale

  The state is three array leaves, whatever the hyperparameters:
  `current_loss_scale` (float32), `num_good_steps` and `num_bad_steps`
  (int32). The hyperparameters are static and validated on every
  construction. `dataclasses.replace` changes them on a fresh or a running
  loss scale; the state is kept, and the next step follows the rule from
  there (a `num_good_steps` at or past the period grows the scale at the
  next finite step; a `num_bad_steps` at or past `hysteresis` lets the next
  overflow lower it). Pass the state fields only to rebuild a loss scale
  from saved arrays; they are not read here, so `check_state` checks them.

  Args:
    initial_loss_scale: the starting scale. The default, 2**15, is about
      half the largest float16.
    increment_period: how many consecutive finite steps raise the scale.
    multiplier: the factor by which the scale rises and falls; above 1.
    min_loss_scale: the floor of the scale (TensorFlow's is 1).
    max_loss_scale: the ceiling of the scale; None means float32's maximum.
      A stored scale above it (+inf included) counts as the ceiling.
    hysteresis: how many non-finite steps it takes to lower the scale.
    consecutive_hysteresis: reset the count of non-finite steps on every
      finite step, so that only consecutive ones count (DeepSpeed's option).
    current_loss_scale: the scale, to rebuild a saved state.
    num_good_steps: consecutive finite steps since the scale last moved.
    num_bad_steps: non-finite steps counted against `hysteresis`.

  Raises:
    TypeError: if a hyperparameter has the wrong type (bools included).
    ValueError: if `increment_period < 1`, `multiplier <= 1`,
      `hysteresis < 1`, or `min_loss_scale <= initial_loss_scale <=
      max_loss_scale` does not hold with finite float32 values, the least
      of them at least float32's least normal number (about 1.18e-38: a
      subnormal scale flushes to 0 on accelerators).

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

    With a hysteresis of 2, the first overflow is skipped without lowering
    the scale:

    >>> loss_scale = ols.DynamicLossScale(8.0, hysteresis=2)
    >>> for grad in [jnp.inf, jnp.inf, jnp.inf]:
    ...   loss_scale, should_apply = loss_scale.update({"w": jnp.array(grad)})
    ...   print(float(loss_scale()), bool(should_apply))
    8.0 False
    4.0 False
    2.0 False
  """

  # The hyperparameters, TensorFlow's first, then the state.
  initial_loss_scale: float = _static(scalar, default=2.0**15)
  increment_period: int = _static(_positive, default=2000)
  multiplier: float = _static(scalar, default=2.0)
  _: dataclasses.KW_ONLY
  min_loss_scale: float = _static(scalar, default=1.0)
  max_loss_scale: float | None = _static(scalar, default=None)
  hysteresis: int = _static(_positive, default=1)
  consecutive_hysteresis: bool = _static(boolean, default=False)
  current_loss_scale: jax.Array = _INITIAL
  num_good_steps: jax.Array = _INITIAL
  num_bad_steps: jax.Array = _INITIAL

  def __post_init__(self) -> None:
    super().__post_init__()
    low, init = self.min_loss_scale, self.initial_loss_scale
    top = np.inf if self.max_loss_scale is None else self.max_loss_scale
    for name, ok, wanted in (
      ("multiplier", self.multiplier > 1, _MULTIPLIER),
      ("min_loss_scale", low >= _TINY, _NORMAL),
      ("initial_loss_scale", init >= low, f"at least min_loss_scale ({low:g})"),
      ("max_loss_scale", top >= init, "at least initial_loss_scale"),
    ):
      _require(ok, type(self).__name__, name, wanted, getattr(self, name))
    if self.current_loss_scale is _INITIAL:
      object.__setattr__(self, "current_loss_scale", jnp.float32(init))
    for name in ("num_good_steps", "num_bad_steps"):
      if getattr(self, name) is _INITIAL:
        object.__setattr__(self, name, jnp.int32(0))

  def __call__(self) -> jax.Array:
    # A scale outside the bounds (restored into other ones) counts as the
    # nearest, and NaN as the floor.
    top = FLOAT32_MAX if self.max_loss_scale is None else self.max_loss_scale
    scale = jnp.minimum(self.current_loss_scale, jnp.float32(top))
    return jnp.where(scale >= self.min_loss_scale, scale, self.min_loss_scale)

  def _backed_off(self) -> jax.Array:
    """The scale divided by `multiplier`, floored: TensorFlow's backoff."""
    scale = _numerics.exact_div(self(), jnp.float32(self.multiplier))
    return jnp.maximum(scale, jnp.float32(self.min_loss_scale))

  def adjust(self, grads_finite: jax.Array) -> tuple[Self, jax.Array]:
    finite = jnp.asarray(grads_finite, jnp.bool_)
    scale = self()
    good = jnp.asarray(self.num_good_steps) + 1
    grow = good >= self.increment_period
    raised = scale * jnp.float32(self.multiplier)
    # None is float32's maximum, so `raised <= top` is False for inf and NaN.
    top = jnp.float32(self.max_loss_scale or FLOAT32_MAX)
    grown = jnp.where(grow & (raised <= top), raised, scale)
    bad = jnp.minimum(self.num_bad_steps, self.hysteresis - 1) + 1
    lowered = jnp.where(bad >= self.hysteresis, self._backed_off(), scale)
    kept = jnp.where(grow | self.consecutive_hysteresis, 0, self.num_bad_steps)
    return dataclasses.replace(
      self,
      current_loss_scale=jnp.where(finite, grown, lowered),
      num_good_steps=jnp.where(finite & ~grow, good, 0).astype(jnp.int32),
      num_bad_steps=jnp.where(finite, kept, bad).astype(jnp.int32),
    ), finite

  def lowered(self) -> Self:
    """The scale divided by `multiplier` (floored), the good steps reset."""
    return dataclasses.replace(
      self,
      current_loss_scale=self._backed_off(),
      num_good_steps=jnp.zeros_like(self.num_good_steps),
    )
