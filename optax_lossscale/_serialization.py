"""`serialize` and `deserialize`, in TensorFlow's and Keras' format."""

from __future__ import annotations

import numbers
from typing import Any, cast

import jax
import numpy as np

from optax_lossscale._loss_scale import (
  DynamicLossScale,
  FixedLossScale,
  LossScale,
  NoOpLossScale,
)
from optax_lossscale._validation import describe

__all__ = ["deserialize", "register_loss_scale", "serialize"]

# The built-in classes, and those `register_loss_scale` adds.
_CLASSES: dict[str, type[LossScale]] = {
  cls.__name__: cls for cls in (FixedLossScale, DynamicLossScale, NoOpLossScale)
}


def register_loss_scale(cls: type[LossScale]) -> type[LossScale]:
  """Lets `deserialize` build `cls` from a config naming `cls.__name__`.

  `deserialize` only builds the built-in loss scales and the classes
  registered here; it never imports or looks up anything a config names.
  Usable as a class decorator.

  Args:
    cls: a subclass of `LossScale` with `get_config`/`from_config`.

  Returns:
    `cls`, unchanged.

  Raises:
    TypeError: if `cls` is not a subclass of `LossScale`.
    ValueError: if another class is registered, or built in, under its name.

  Examples:
    >>> import optax_lossscale as ols
    >>> @ols.register_loss_scale
    ... class MyLossScale(ols.NoOpLossScale):
    ...   pass
    >>> ols.deserialize({"class_name": "MyLossScale", "config": {}})
    MyLossScale()
  """
  where = "`register_loss_scale(cls)`"
  if not (isinstance(cls, type) and issubclass(cls, LossScale)):
    raise TypeError(
      f"{where} takes a subclass of LossScale, got {describe(cls)}."
    )
  if (known := _CLASSES.setdefault(cls.__name__, cls)) is not cls:
    raise ValueError(
      f"{where}: the name {cls.__name__!r} is already taken by {known!r}."
    )
  return cls


def serialize(loss_scale: LossScale) -> dict[str, Any]:
  """Returns `{"class_name": ..., "config": ...}`, the TF/Keras format.

  Only the hyperparameters are kept, as in TensorFlow; save the array state
  (for example with Orbax) to resume a run.

  Args:
    loss_scale: a `LossScale`.

  Returns:
    A JSON-compatible dict.

  Raises:
    TypeError: if `loss_scale` is not a `LossScale`.

  Examples:
    >>> import optax_lossscale as ols
    >>> ols.serialize(ols.FixedLossScale(64))
    {'class_name': 'FixedLossScale', 'config': {'loss_scale_value': 64.0}}
  """
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
      f"`serialize(loss_scale)` takes a LossScale, got {describe(loss_scale)}."
    )
  name = type(loss_scale).__name__
  return {"class_name": name, "config": loss_scale.get_config()}


def deserialize(config: dict[str, Any]) -> LossScale:
  """Builds a loss scale from `serialize`'s dict, or TensorFlow's or Keras'.

  Accepted: `{"class_name": name, "config": {...}}` for `FixedLossScale`,
  `DynamicLossScale`, `NoOpLossScale` and registered classes, with the extra
  `module`/`registered_name` keys newer Keras versions write (ignored); and
  the config of a Keras `LossScaleOptimizer` (`class_name`
  `"LossScaleOptimizer"`), from which the loss scale is taken.

  Nothing named in `config` is imported, looked up or called beyond the
  built-in classes and those passed to `register_loss_scale`.

  Args:
    config: a dict.

  Returns:
    A `LossScale` in its initial state.

  Raises:
    ValueError: if the dict is malformed, the class is unknown or a value is
      invalid.
    TypeError: if `config` or one of its values has the wrong type.

  Examples:
    >>> import optax_lossscale as ols
    >>> ols.deserialize({"class_name": "DynamicLossScale",
    ...                  "config": {"initial_loss_scale": 256.0,
    ...                             "increment_period": 100,
    ...                             "multiplier": 2.0}}).get_config()
    {'initial_loss_scale': 256.0, 'increment_period': 100, 'multiplier': 2.0}
  """
  where = "`deserialize(config)`"
  if not isinstance(config, dict):
    raise TypeError(f"{where} takes a dict, got {type(config).__name__}.")
  # Keras' `serialize_keras_object` writes `module` and `registered_name` too;
  # they name Python modules, which are never imported here.
  if config.keys() - {"module", "registered_name"} != {"class_name", "config"}:
    raise ValueError(
      f"{where} takes a dict with the keys 'class_name' and 'config', got"
      f" the keys [{', '.join(sorted(map(repr, config)))}]."
    )
  name, inner = config["class_name"], config["config"]
  if not isinstance(inner, dict) or not all(isinstance(k, str) for k in inner):
    raise ValueError(f"{where}: 'config' must be a dict with string keys.")
  if name == "LossScaleOptimizer":  # a Keras optimizer's config: its scale
    if isinstance(inner.get("loss_scale"), (dict, numbers.Real, str)):
      # TF 2.3's `mixed_precision.experimental.LossScaleOptimizer`.
      return from_identifier(inner["loss_scale"], "deserialize(config)")
    initial = inner.get("initial_scale", 2.0**15)
    if not inner.get("dynamic", True):
      return FixedLossScale(initial)
    return DynamicLossScale(initial, inner.get("dynamic_growth_steps", 2000))
  if not isinstance(name, str) or name not in _CLASSES:
    raise ValueError(
      f"{where}: unknown loss scale class {describe(name)}; known:"
      f" {sorted(_CLASSES)}. Register your own with `register_loss_scale`."
    )
  return _CLASSES[name].from_config(inner)


def from_identifier(identifier: Any, where: str) -> LossScale:
  """A loss scale from a number, "dynamic", a config dict or a loss scale."""
  if isinstance(identifier, LossScale):
    return identifier
  if isinstance(
    identifier, (numbers.Real, np.ndarray, np.generic, jax.Array)
  ) and not isinstance(identifier, (bool, np.bool_)):
    # FixedLossScale validates and converts the number itself.
    return FixedLossScale(cast(float, identifier))
  if isinstance(identifier, str) and identifier == "dynamic":
    return DynamicLossScale()
  if isinstance(identifier, dict):
    return deserialize(identifier)
  raise ValueError(
    f"`{where}` could not interpret the loss scale {describe(identifier)}:"
    " pass a number, 'dynamic', a LossScale or a serialized dict."
  )
