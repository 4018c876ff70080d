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
from collections.abc import Callable
from typing import Any, NoReturn, Self

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale import _exact, _numerics, _validation

__all__ = ["DynamicLossScale", "FixedLossScale", "LossScale", "NoOpLossScale"]


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


def _passes_unchanged(x: Any) -> bool:
  """`None`, `float0`, integer and bool leaves: nothing to scale or check."""
  if x is None or _numerics.is_float0(x):
    return True
  dtype = jnp.result_type(x)
  return bool(jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_)


def _map_arrays(fn: Any, tree: Any, method: str) -> Any:
  """Maps `fn` over the float leaves; `_passes_unchanged` leaves pass as is."""

  def leaf(x: Any) -> Any:
    if _passes_unchanged(x):
      return x
    return fn(_check_leaf(x, method))

  return jax.tree.map(leaf, tree, is_leaf=lambda x: x is None)


def _not_a_number(operation: str) -> Callable[..., NoReturn]:
  """A method that refuses `operation`: a loss scale is not a number."""

  def refuse(self: Any, *args: Any) -> NoReturn:
    raise TypeError(
      f"`{operation}` with a {type(self).__name__}: a loss scale is not a"
      " number. Call `loss_scale.scale(loss)` to scale a loss (and"
      " `loss_scale.unscale(grads)` to unscale gradients), or `loss_scale()`"
      " for the scale itself, a float32 array."
    )

  return refuse


class LossScale(abc.ABC):
  """The base class of loss scales: a scale factor and how it evolves.

  A loss scale is an immutable pytree: `update` returns a new loss scale rather
  than changing this one. The built-in ones are frozen dataclasses:
  `FixedLossScale` and `NoOpLossScale` are registered with
  `jax.tree_util.register_dataclass` and have no leaves; `DynamicLossScale` is
  registered with keys (`jax.tree_util.register_pytree_with_keys`) and has two
  leaves, `current_loss_scale` and `num_good_steps`, and a third,
  `hysteresis_budget`, when `hysteresis > 1`. A subclass must be a pytree whose
  hyperparameters are static (a frozen dataclass registered with
  `register_dataclass` is the simplest), and implement `__call__`, `adjust`
  and `get_config`. It may override `grads_finite` (its own verdict; skip
  records then read the gradients again) and `lowered` (to support
  retries); the base implementations are correct for any scale.

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

    A loss scale is not a number; arithmetic and conversions with it raise a
    `TypeError` that says what to call instead:

    >>> jnp.float32(0.5) * loss_scale
    Traceback (most recent call last):
    ...
    TypeError: `x * loss_scale` with a DynamicLossScale: a loss scale is not
    a number. Call `loss_scale.scale(loss)` to scale a loss (and
    `loss_scale.unscale(grads)` to unscale gradients), or `loss_scale()` for
    the scale itself, a float32 array.
  """

  # NumPy defers to the reflected operators below instead of making an
  # object array.
  __array_ufunc__ = None
  __add__ = _not_a_number("loss_scale + x")
  __radd__ = _not_a_number("x + loss_scale")
  __sub__ = _not_a_number("loss_scale - x")
  __rsub__ = _not_a_number("x - loss_scale")
  __mul__ = _not_a_number("loss_scale * x")
  __rmul__ = _not_a_number("x * loss_scale")
  __matmul__ = _not_a_number("loss_scale @ x")
  __rmatmul__ = _not_a_number("x @ loss_scale")
  __truediv__ = _not_a_number("loss_scale / x")
  __rtruediv__ = _not_a_number("x / loss_scale")
  __floordiv__ = _not_a_number("loss_scale // x")
  __rfloordiv__ = _not_a_number("x // loss_scale")
  __mod__ = _not_a_number("loss_scale % x")
  __rmod__ = _not_a_number("x % loss_scale")
  __pow__ = _not_a_number("loss_scale ** x")
  __rpow__ = _not_a_number("x ** loss_scale")
  __neg__ = _not_a_number("-loss_scale")
  __pos__ = _not_a_number("+loss_scale")
  __abs__ = _not_a_number("abs(loss_scale)")
  __lt__ = _not_a_number("loss_scale < x")
  __le__ = _not_a_number("loss_scale <= x")
  __gt__ = _not_a_number("loss_scale > x")
  __ge__ = _not_a_number("loss_scale >= x")
  __float__ = _not_a_number("float(loss_scale)")
  __int__ = _not_a_number("int(loss_scale)")
  __complex__ = _not_a_number("complex(loss_scale)")
  __array__ = _not_a_number("asarray(loss_scale)")

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
      The loss scale for the next step, of the same pytree structure as this
      one (it is carried through `lax.cond` and `lax.scan`), and a bool scalar
      `jax.Array` saying whether the gradients of this step should be applied.
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
      TypeError: if `config` is not a dict, or a value has the wrong type.
      ValueError: if `config` has keys the class does not take (for a frozen
        dataclass, the names of its static fields), or a value is invalid.
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
          f"{where} got unknown keys [{', '.join(sorted(map(repr, unknown)))}];"
          " it takes"
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
    return self.adjust(_numerics.all_finite(grads, axis_name=axis_name))

  def scale(self, tree: Any) -> Any:
    """Multiplies every array leaf of `tree` by the loss scale.

    Each leaf keeps its dtype; the product is computed in at least float32 and
    rounded once. A float16 loss whose scaled value exceeds the float16 range
    becomes inf, as in TensorFlow. That alone does not skip the step: the
    scaling is linear, so its VJP multiplies the incoming cotangent by the
    scale, whatever the scaled loss is, and the backward pass sees the scale,
    never the scaled loss. The gradients are then as finite as they would be
    for a finite scaled loss, and the step is applied unless they overflow
    (as they do when the scale itself exceeds float16's largest value, 65504:
    the cotangent becomes inf where it enters float16). To skip on a
    non-finite loss, pass the unscaled loss as `value=` (the value
    `scaled_value_and_grad` returns).

    Args:
      tree: a pytree of floating-point arrays (typically the loss).

    Returns:
      A pytree of the same structure and dtypes. `None` leaves stay `None`;
      integer, bool and `float0` leaves pass unchanged.
    """
    s = self()

    def mul(x: jax.Array) -> jax.Array:
      ct = _compute_dtype(x.dtype)
      return (x.astype(ct) * s.astype(ct)).astype(x.dtype)

    return _map_arrays(mul, tree, "scale")

  def unscale(self, tree: Any) -> Any:
    """Divides every array leaf of `tree` by the loss scale.

    The division is elementwise and the same for every leaf of a dtype (skip
    reports rely on it: they unscale concatenations of leaves). Each leaf
    keeps its dtype. The division is computed in at least float32 as
    a multiplication by the correctly rounded reciprocal of the scale (what
    XLA emits for a division by a scalar, and what TensorFlow's optimizers do),
    so it is exact whenever the scale is a power of two, and the same with and
    without `jit`.

    Args:
      tree: a pytree of floating-point arrays (typically scaled gradients).

    Returns:
      A pytree of the same structure and dtypes. `None` leaves stay `None`;
      integer, bool and `float0` leaves pass unchanged.
    """
    s = self()
    inverses: dict[Any, jax.Array] = {}

    def div(x: jax.Array) -> jax.Array:
      ct = _compute_dtype(x.dtype)
      if ct not in inverses:
        inverses[ct] = _exact.exact_div(jnp.ones((), ct), s.astype(ct))
      return (x.astype(ct) * inverses[ct]).astype(x.dtype)

    return _map_arrays(div, tree, "unscale")

  def grads_finite(
    self, scaled_grads: Any, *, axis_name: _numerics.AxisName = None
  ) -> jax.Array:
    """Returns whether the gradients of a step are all finite once unscaled.

    The optimizers call this on the *scaled* gradients, as `jax.grad` of the
    scaled loss gives them, and pass the verdict to `adjust`. This base
    implementation checks `self.unscale(scaled_grads)`, which is right for any
    scale, including scales below 1, where unscaling enlarges a gradient (a
    float16 gradient of 40000 unscaled by 0.5 overflows). The built-in loss
    scales check the scaled gradients directly when their scale cannot fall
    below 1, since unscaling by a scale of at least 1 cannot make a finite
    gradient infinite. A subclass that overrides it decides by its own
    verdict; `LossScaleOptimizer` then reads the unscaled gradients a second
    time on skipped steps, for the skip record's per-leaf flags.

    Args:
      scaled_grads: the scaled gradients, a pytree (None leaves are ignored).
      axis_name: a mapped axis over which replicas must agree (see
        `all_finite`).

    Returns:
      A bool scalar `jax.Array`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_lossscale as ols
      >>> grads = {"w": jnp.array([40000.0], jnp.float16)}
      >>> bool(ols.FixedLossScale(2.0).grads_finite(grads))
      True
    """
    checked = self._checked_grads(scaled_grads)
    return _numerics.all_finite(checked, axis_name=axis_name)

  def _checked_grads(self, scaled_grads: Any) -> Any:
    """The gradients `grads_finite` reads: the unscaled ones, here.

    The built-in loss scales, whose scale cannot fall below 1, return the
    scaled gradients: unscaling by at least 1 cannot make a finite gradient
    infinite, and the unscaling is then not read by the check, so it fuses
    into whatever consumes the unscaled gradients (the inner update).
    """
    return self.unscale(scaled_grads)

  def lowered(self) -> Self | None:
    """Returns the loss scale to retry a step with after its gradients overflowed.

    `LossScaleOptimizer.minimize(..., max_retries=k)` recomputes an overflowed
    step with this loss scale. The base implementation returns None: the loss
    scale cannot be lowered, and `max_retries > 0` is refused. A lowered loss
    scale whose scale is not below this one's (a floor was reached) stops the
    retries.

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


def leaf_flags(loss_scale: LossScale, scaled_grads: Any) -> jax.Array | None:
  """Per leaf of `scaled_grads`, whether it is finite once unscaled; local.

  A bool vector in `jax.tree.leaves` order, read as `grads_finite` reads the
  gradients: its verdict is `jnp.all` of it, before replicas agree. None
  when the loss scale's class overrides `grads_finite`, whose own verdict
  then decides.
  """
  if type(loss_scale).grads_finite is not LossScale.grads_finite:
    return None
  checked = loss_scale._checked_grads(scaled_grads)
  return _numerics.finite_flags(jax.tree.leaves(checked))


def _scaled(scaled_grads: Any) -> Any:
  """The scaled gradients, their leaves checked: a check's input."""
  return _map_arrays(lambda x: x, scaled_grads, "update")


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
    ValueError: if `loss_scale_value` is below 1, NaN, infinite, beyond
      float32's range or not a scalar.
    TypeError: if it is not a real number (bools, strings, None and complex
      numbers included) or is a traced value.

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

  def _checked_grads(self, scaled_grads: Any) -> Any:
    return _scaled(scaled_grads)

  def get_config(self) -> dict[str, Any]:
    return {"loss_scale_value": self.loss_scale_value}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(LossScale):
  """A loss scale of 1: one code path for every precision.

  Use it for bfloat16 and float32 training, which need no loss scaling, so
  that the same train step serves float16 with a real loss scale. Its own
  `update` returns `should_apply` True whatever the gradients, as
  `FixedLossScale`'s does; `LossScaleOptimizer` (and `loss_scale_optimizer`)
  still skip non-finite steps unless `skip_nonfinite=False`.

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

  def __call__(self) -> jax.Array:
    return jnp.ones((), jnp.float32)

  def adjust(self, grads_finite: jax.Array) -> tuple[Self, jax.Array]:
    del grads_finite
    return self, jnp.array(True)

  def _checked_grads(self, scaled_grads: Any) -> Any:
    return _scaled(scaled_grads)

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


# Registered as a pytree below the class, keyed by field name.
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(LossScale):
  """A loss scale that adapts to the gradients: TensorFlow's algorithm.

  Every `increment_period` consecutive steps with finite gradients, the scale
  is multiplied by `multiplier` (if the product is finite and at most
  `max_loss_scale`). On a step with a non-finite gradient, the scale is divided
  by `multiplier`, floored at `min_loss_scale`, the good-step counter resets and
  `should_apply` is False. The float32 arithmetic matches TensorFlow's
  `DynamicLossScale` bit for bit, for any multiplier.

  With `hysteresis=h > 1` (Megatron-LM's `hysteresis`, DeepSpeed's
  `delayed_shift`), the scale is lowered only once `h` non-finite steps have
  used up a budget::

    if grads are finite:
      num_good_steps += 1
      if consecutive_hysteresis: budget = hysteresis
      if num_good_steps >= increment_period:
        grow the scale if it can; num_good_steps = 0; budget = hysteresis
    else:
      num_good_steps = 0
      budget = max(budget - 1, 0)
      if budget == 0: scale = max(scale / multiplier, min_loss_scale)

  A non-finite step is skipped whatever the budget. `hysteresis=1` is
  TensorFlow's algorithm, bit for bit.

  The array state is `current_loss_scale` (float32), `num_good_steps`
  (int32) and, when `hysteresis > 1`, `hysteresis_budget` (int32; None
  otherwise, so a default loss scale has TensorFlow's two leaves). The
  hyperparameters are static and validated on every construction, also when
  the state fields are passed and when a pytree is unflattened. Pass the state
  fields only to rebuild a loss scale from saved arrays. Each is converted to
  its dtype if its values are exact in it (a float16, bfloat16, float64 or
  integer scale; a counter of any integer dtype), and refused otherwise: a
  float64 `1/3` or a Python `0.1` is not a float32 value (pass
  `np.float32(0.1)` to round it), nor is a bool a number. A traced value is
  converted only from a dtype whose every value is exact (float16 to float32,
  int8 to int32, not int32 to float32). The fields passed must have one
  shape, that of the state: a scalar, or stacked over replicas with leading
  axes. Concrete values (Python numbers, NumPy arrays, JAX arrays that are not
  tracers) are checked element by element: the scale must be finite and in
  `[min_loss_scale, max_loss_scale]`, `num_good_steps` an integer in
  `[0, increment_period)` and `hysteresis_budget` one in `[0, hysteresis]`
  (None when `hysteresis=1`). A JAX array is read for this, which waits for
  it, and converted where it lives. Unflattening (under `jit`, in
  `jax.tree.map`, in an Orbax restore) neither checks, converts nor reads the
  state: check a restored tree with `check_state`.

  Args:
    initial_loss_scale: the starting scale. The default, 2**15, is about half
      the largest float16: a scale that is too high falls quickly, one that is
      too low rises slowly.
    increment_period: how many consecutive finite steps raise the scale.
    multiplier: the factor by which the scale rises and falls; greater than 1.
    min_loss_scale: the floor of the scale (TensorFlow's is 1).
    max_loss_scale: the ceiling of the scale; None means float32's maximum.
    hysteresis: how many non-finite steps it takes to lower the scale; the
      budget refills when the scale grows (or would, but is capped).
    consecutive_hysteresis: refill the budget on every finite step too, so
      that only consecutive non-finite steps count (DeepSpeed's option).
    current_loss_scale: the current scale, to restore a saved state.
    num_good_steps: the good-step counter, to restore a saved state.
    hysteresis_budget: the hysteresis budget, to restore a saved state.

  Raises:
    TypeError: if a hyperparameter has the wrong type (bools and strings
      included), or a state value a dtype that does not convert to its own
      (a complex or bool scale, a float counter, a traced int32 scale).
    ValueError: if `increment_period < 1`, `multiplier <= 1`, `hysteresis < 1`,
      or `0 < min_loss_scale <= initial_loss_scale <= max_loss_scale` does not
      hold with finite float32 values; if a concrete state value is out of
      its range or not exact in its dtype, or the state values passed differ
      in shape (the message names the field and the value).

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

    With a hysteresis of 2, one overflow is skipped without lowering the
    scale; the second one lowers it:

    >>> loss_scale = ols.DynamicLossScale(8.0, hysteresis=2)
    >>> for grad in [jnp.inf, jnp.inf, jnp.inf]:
    ...   loss_scale, should_apply = loss_scale.update({"w": jnp.array(grad)})
    ...   print(float(loss_scale()), bool(should_apply))
    8.0 False
    4.0 False
    2.0 False

    State values passed to the constructor are converted to float32 and
    int32 when they are exact in them, and checked:

    >>> import numpy as np
    >>> ols.DynamicLossScale(current_loss_scale=np.float16(8)).current_loss_scale
    array(8., dtype=float32)
    >>> ols.DynamicLossScale(current_loss_scale=jnp.float32(jnp.nan))
    Traceback (most recent call last):
    ...
    ValueError: `DynamicLossScale(current_loss_scale=...)` must be finite and in [min_loss_scale=1.0, float32's maximum], got nan.
  """

  initial_loss_scale: float = _static(default=2.0**15)
  increment_period: int = _static(default=2000)
  multiplier: float = _static(default=2.0)
  min_loss_scale: float = _static(default=1.0, kw_only=True)
  max_loss_scale: float | None = _static(default=None, kw_only=True)
  hysteresis: int = _static(default=1, kw_only=True)
  consecutive_hysteresis: bool = _static(default=False, kw_only=True)
  current_loss_scale: jax.Array = dataclasses.field(
    default=_FRESH, kw_only=True
  )
  num_good_steps: jax.Array = dataclasses.field(default=_FRESH, kw_only=True)
  hysteresis_budget: jax.Array | None = dataclasses.field(
    default=_FRESH, kw_only=True
  )

  def __post_init__(self) -> None:
    # A call of the constructor (or `dataclasses.replace`): the state passed
    # is checked where it is concrete.
    self._setup(check_state=True)

  @classmethod
  def _from_fields(cls, fields: dict[str, Any]) -> Self:
    """Builds from every field, without checking or reading the state.

    For unflattening, which passes arbitrary leaves (tracers, shardings,
    None, NumPy zeros from a tree map) and must stay cheap, and for the
    states that `adjust` and `lowered` compute.
    """
    new = object.__new__(cls)
    for f in dataclasses.fields(cls):
      object.__setattr__(new, f.name, fields[f.name])
    new._setup(check_state=False)
    return new

  def _with_state(self, **state: Any) -> Self:
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return self._from_fields(fields | state)

  def _setup(self, *, check_state: bool) -> None:
    # The hyperparameters are Python values: checked on every construction.
    self._validate()
    passed = {
      name: getattr(self, name)
      for name in _DYNAMIC_STATE
      if getattr(self, name) is not _FRESH
    }
    if check_state:
      state = check_state_values(
        self, passed, lambda name: f"`DynamicLossScale({name}=...)`", True
      )
    else:
      # A Python number would become a weakly typed array: another trace.
      state = {
        name: np.asarray(value, _STATE_DTYPES[name])
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else value
        for name, value in passed.items()
      }
    for name in _DYNAMIC_STATE:
      value = state[name] if name in state else self._fresh(name)
      object.__setattr__(self, name, value)
    if check_state and passed:
      self._check_shapes(passed)

  def _fresh(self, name: str) -> jax.Array | None:
    """The initial value of a state field."""
    if name == "current_loss_scale":
      return jnp.asarray(self.initial_loss_scale, jnp.float32)
    if name == "num_good_steps":
      return jnp.zeros((), jnp.int32)
    if self.hysteresis > 1:
      return jnp.asarray(self.hysteresis, jnp.int32)
    return None

  def _check_shapes(self, passed: dict[str, Any]) -> None:
    """Raises unless the state fields have one shape (passed or not)."""
    first = next(iter(passed))
    shape = _validation.shape_of(getattr(self, first))
    if shape is None:
      return
    for name in _DYNAMIC_STATE:
      got = _validation.shape_of(getattr(self, name))
      if got is None or got == shape:
        continue
      if name not in passed:
        raise ValueError(
          f"`DynamicLossScale({first}=...)` has shape {shape}: pass {name}"
          " too, of that shape (a state field not passed starts as a"
          " scalar)."
        )
      _validation.same_shape(
        f"`DynamicLossScale({name}=...)`", got, first, shape
      )

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
    hysteresis = _validation.integer(
      call, "hysteresis", self.hysteresis, minimum=1
    )
    consecutive = _validation.boolean(
      call, "consecutive_hysteresis", self.consecutive_hysteresis
    )
    for name, value in [
      ("initial_loss_scale", initial),
      ("increment_period", period),
      ("multiplier", multiplier),
      ("min_loss_scale", minimum),
      ("max_loss_scale", maximum),
      ("hysteresis", hysteresis),
      ("consecutive_hysteresis", consecutive),
    ]:
      object.__setattr__(self, name, value)

  def __call__(self) -> jax.Array:
    # `asarray` unwraps containers such as Flax NNX's optimizer variables.
    return jnp.asarray(self.current_loss_scale)

  def _checked_grads(self, scaled_grads: Any) -> Any:
    if self.min_loss_scale >= 1:
      return _scaled(scaled_grads)
    return self.unscale(scaled_grads)

  def _backed_off(self) -> jax.Array:
    """The scale divided by `multiplier`, floored: TensorFlow's backoff."""
    scale = jnp.asarray(self.current_loss_scale)
    return jnp.maximum(
      _exact.exact_div(scale, jnp.float32(self.multiplier)),
      jnp.float32(self.min_loss_scale),
    )

  def lowered(self) -> Self:
    """The scale divided by `multiplier` (floored), the good-step count reset.

    What TensorFlow's algorithm does on a non-finite step, whatever the
    hysteresis; the budget is left as it is.
    """
    return self._with_state(
      current_loss_scale=self._backed_off(),
      num_good_steps=jnp.zeros_like(self.num_good_steps),
    )

  def adjust(self, grads_finite: jax.Array) -> tuple[Self, jax.Array]:
    grads_finite = jnp.asarray(grads_finite, jnp.bool_)
    scale = jnp.asarray(self.current_loss_scale)
    multiplier = jnp.float32(self.multiplier)

    good_steps = self.num_good_steps + 1
    increase = good_steps >= self.increment_period
    raised = scale * multiplier
    can_raise = jnp.isfinite(raised)
    if self.max_loss_scale is not None:
      can_raise &= raised <= jnp.float32(self.max_loss_scale)
    grown = jnp.where(increase & can_raise, raised, scale)
    good_steps = jnp.where(increase, 0, good_steps)

    if self.hysteresis == 1:
      lower, new_budget = jnp.array(True), self.hysteresis_budget
    else:
      budget = jnp.asarray(self.hysteresis_budget)
      spent = jnp.maximum(budget - 1, 0)
      lower = spent == 0
      refill = increase | self.consecutive_hysteresis
      full = jnp.full_like(budget, self.hysteresis)
      new_budget = jnp.where(
        grads_finite, jnp.where(refill, full, budget), spent
      )
    lowered = jnp.where(lower, self._backed_off(), scale)
    new_scale = jnp.where(grads_finite, grown, lowered)
    new_good_steps = jnp.where(grads_finite, good_steps, 0).astype(jnp.int32)
    new = self._with_state(
      current_loss_scale=new_scale,
      num_good_steps=new_good_steps,
      hysteresis_budget=new_budget,
    )
    return new, grads_finite

  def get_config(self) -> dict[str, Any]:
    config: dict[str, Any] = {
      "initial_loss_scale": self.initial_loss_scale,
      "increment_period": self.increment_period,
      "multiplier": self.multiplier,
    }
    # Written only when not the defaults (TensorFlow's), so that a config
    # TensorFlow could write is exactly TensorFlow's three keys.
    if self.min_loss_scale != 1.0:
      config["min_loss_scale"] = self.min_loss_scale
    if self.max_loss_scale is not None:
      config["max_loss_scale"] = self.max_loss_scale
    if self.hysteresis != 1:
      config["hysteresis"] = self.hysteresis
    if self.consecutive_hysteresis:
      config["consecutive_hysteresis"] = True
    return config

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

    Raises:
      TypeError: if `config` is not a dict, or a value has the wrong type.
      ValueError: if `config` has keys other than the hyperparameters' (a
        state field included), or a value is invalid.
    """
    return super().from_config(config)


_DYNAMIC_STATE = ("current_loss_scale", "num_good_steps", "hysteresis_budget")
# The dtype of each array of a `DynamicLossScale`'s state.
_STATE_DTYPES = {
  "current_loss_scale": np.dtype(np.float32),
  "num_good_steps": np.dtype(np.int32),
  "hysteresis_budget": np.dtype(np.int32),
}
_DYNAMIC_STATIC = tuple(
  f.name
  for f in dataclasses.fields(DynamicLossScale)
  if f.metadata.get("static")
)


def _flatten_dynamic(
  ls: DynamicLossScale,
) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
  # The budget is a leaf only when `hysteresis > 1`, and not even a None node
  # otherwise: a default loss scale has exactly 0.1.0's two keyed leaves, so
  # checkpoints (whose metadata records None nodes too) still load.
  names = _DYNAMIC_STATE if ls.hysteresis > 1 else _DYNAMIC_STATE[:2]
  children = [(jax.tree_util.GetAttrKey(n), getattr(ls, n)) for n in names]
  return children, tuple(getattr(ls, n) for n in _DYNAMIC_STATIC)


def _unflatten_dynamic(
  static: tuple[Any, ...], children: Any
) -> DynamicLossScale:
  fields = dict(zip(_DYNAMIC_STATIC, static, strict=True))
  fields |= dict(zip(_DYNAMIC_STATE, children, strict=False))
  fields.setdefault("hysteresis_budget", None)
  return DynamicLossScale._from_fields(fields)


jax.tree_util.register_pytree_with_keys(
  DynamicLossScale, _flatten_dynamic, _unflatten_dynamic
)


def _bounds(loss_scale: DynamicLossScale, name: str) -> dict[str, Any]:
  """The range of a state field's values, as `_validation.elements` takes it."""
  if name == "current_loss_scale":
    low = loss_scale.min_loss_scale
    if loss_scale.max_loss_scale is None:
      high, top = _validation.FLOAT32_MAX, "float32's maximum"
    else:
      high = loss_scale.max_loss_scale
      top = f"max_loss_scale={high!r}"
    return dict(
      integer=False,
      low=low,
      high=high,
      expected=f"finite and in [min_loss_scale={low!r}, {top}]",
    )
  if name == "num_good_steps":
    period = loss_scale.increment_period
    return dict(
      integer=True,
      low=0,
      high=period,
      high_open=True,
      expected=f"an integer in [0, increment_period={period})",
    )
  return dict(
    integer=True,
    low=0,
    high=loss_scale.hysteresis,
    expected=f"an integer in [0, hysteresis={loss_scale.hysteresis}]",
  )


def check_state_values(
  loss_scale: DynamicLossScale,
  state: dict[str, Any],
  describe: Callable[[str], str],
  convert: bool = False,
) -> dict[str, Any]:
  """Raises unless the values in `state` are valid for `loss_scale`.

  Each value must be of its field's dtype (`_STATE_DTYPES`); with `convert`,
  of any dtype whose values convert exactly. Concrete values are then checked
  element by element; abstract ones (tracers, shapes) only for their dtype.

  Args:
    loss_scale: gives the hyperparameters the values are checked against.
    state: values by field name (`current_loss_scale`, `num_good_steps`,
      `hysteresis_budget`).
    describe: gives where a field's value came from, for the message.
    convert: whether to convert values to their field's dtype.

  Returns:
    `state`, its values converted where `convert` is True.

  Raises:
    TypeError: if a value has the wrong dtype (or one that does not convert).
    ValueError: naming the field and the first offending element, if an
      element is out of range or (with `convert`) not exact in its dtype.
  """
  checked = dict(state)
  for name, value in state.items():
    where = describe(name)
    if name == "hysteresis_budget" and loss_scale.hysteresis == 1:
      if value is not None and _validation.host_pieces(value):
        raise ValueError(
          f"{where} must be None when hysteresis=1, got {value!r:.80}."
        )
      continue
    bounds = _bounds(loss_scale, name)
    if value is None:
      raise ValueError(f"{where} must be {bounds['expected']}, got None.")
    dtype = _STATE_DTYPES[name]
    _validation.state_dtype(where, value, dtype, convert=convert)
    _validation.elements(where, value, **bounds)
    if convert:
      checked[name] = _validation.state_array(where, value, dtype)
  return checked
