"""get, serialize and deserialize, in TensorFlow's and Keras' formats."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols


def test_get_number_gives_fixed():
  loss_scale = ols.get(123)
  assert isinstance(loss_scale, ols.FixedLossScale)
  assert float(loss_scale()) == 123.0
  assert isinstance(ols.get(64.0), ols.FixedLossScale)
  assert isinstance(ols.get(np.float32(8)), ols.FixedLossScale)


def test_get_dynamic_string_gives_default_dynamic():
  loss_scale = ols.get("dynamic")
  assert isinstance(loss_scale, ols.DynamicLossScale)
  assert loss_scale.get_config() == ols.DynamicLossScale().get_config()


def test_get_passes_loss_scales_and_none_through():
  loss_scale = ols.DynamicLossScale(4.0)
  assert ols.get(loss_scale) is loss_scale
  assert ols.get(None) is None


def test_get_deserializes_dicts():
  config = ols.serialize(ols.FixedLossScale(32))
  assert ols.get(config).get_config() == {"loss_scale_value": 32.0}


@pytest.mark.parametrize("identifier", ["dynamic2", "", True, [1.0], object()])
def test_get_rejects_anything_else(identifier):
  with pytest.raises(ValueError, match="identifier"):
    ols.get(identifier)


@pytest.mark.parametrize(
  "loss_scale",
  [
    ols.FixedLossScale(123),
    ols.DynamicLossScale(),
    ols.DynamicLossScale(1, 2, 3, min_loss_scale=0.5, max_loss_scale=1e9),
    ols.NoOpLossScale(),
  ],
  ids=["fixed", "dynamic", "dynamic-custom", "noop"],
)
def test_serialization_round_trip_through_json(loss_scale):
  config = ols.serialize(loss_scale)
  assert config["class_name"] == type(loss_scale).__name__
  restored = ols.deserialize(json.loads(json.dumps(config)))
  assert type(restored) is type(loss_scale)
  assert restored.get_config() == loss_scale.get_config()
  assert float(restored()) == float(loss_scale())


def test_from_config_round_trip():
  loss_scale = ols.DynamicLossScale(1, 2, 3)
  restored = ols.DynamicLossScale.from_config(loss_scale.get_config())
  assert restored.get_config() == {
    "initial_loss_scale": 1.0,
    "increment_period": 2,
    "multiplier": 3.0,
  }  # TensorFlow's keys: the bounds are the defaults
  bounded = ols.DynamicLossScale(4, 2, 2, min_loss_scale=2, max_loss_scale=64)
  assert ols.DynamicLossScale.from_config(
    bounded.get_config()
  ).get_config() == {
    "initial_loss_scale": 4.0,
    "increment_period": 2,
    "multiplier": 2.0,
    "min_loss_scale": 2.0,
    "max_loss_scale": 64.0,
  }
  # A config 0.1.0 wrote, with the default bounds spelled out, still loads.
  old = {**loss_scale.get_config(), "min_loss_scale": 1.0}
  old["max_loss_scale"] = None
  assert ols.DynamicLossScale.from_config(old).get_config() == (
    loss_scale.get_config()
  )
  fixed = ols.FixedLossScale.from_config({"loss_scale_value": 5.0})
  assert fixed.loss_scale_value == 5.0


def test_serialize_restarts_from_the_initial_scale_as_tensorflow_does():
  loss_scale, _ = ols.DynamicLossScale(8.0).update([jnp.array(jnp.inf)])
  restored = ols.deserialize(ols.serialize(loss_scale))
  assert float(loss_scale()) == 4.0 and float(restored()) == 8.0


# Configs as TensorFlow's `tf.keras.mixed_precision.experimental` and Keras'
# `serialize_keras_object` wrote them.
TF_DYNAMIC = {
  "class_name": "DynamicLossScale",
  "config": {
    "initial_loss_scale": 32768.0,
    "increment_period": 2000,
    "multiplier": 2.0,
  },
}
TF_FIXED = {
  "class_name": "FixedLossScale",
  "config": {"loss_scale_value": 128.0},
}
KERAS3_DYNAMIC = {
  "module": "keras.mixed_precision",
  "class_name": "DynamicLossScale",
  "config": {
    "initial_loss_scale": 1024.0,
    "increment_period": 100,
    "multiplier": 2.0,
  },
  "registered_name": None,
}
KERAS2_OPTIMIZER = {
  "class_name": "LossScaleOptimizer",
  "config": {
    "inner_optimizer": {"class_name": "SGD", "config": {"lr": 0.1}},
    "dynamic": True,
    "initial_scale": 4096.0,
    "dynamic_growth_steps": 500,
  },
}
KERAS2_FIXED_OPTIMIZER = {
  "class_name": "LossScaleOptimizer",
  "config": {
    "inner_optimizer": {},
    "dynamic": False,
    "initial_scale": 64.0,
    "dynamic_growth_steps": None,
  },
}
TF23_OPTIMIZER = {
  "class_name": "LossScaleOptimizer",
  "config": {
    "optimizer": {"class_name": "Adam", "config": {}},
    "loss_scale": TF_DYNAMIC,
  },
}


def test_deserialize_tensorflow_configs():
  dynamic = ols.deserialize(TF_DYNAMIC)
  assert isinstance(dynamic, ols.DynamicLossScale)
  assert dynamic.get_config()["increment_period"] == 2000
  fixed = ols.deserialize(TF_FIXED)
  assert isinstance(fixed, ols.FixedLossScale) and fixed.loss_scale_value == 128


def test_deserialize_keras_configs_without_importing_their_module():
  loss_scale = ols.deserialize(KERAS3_DYNAMIC)
  assert float(loss_scale()) == 1024.0
  optimizer = ols.deserialize(KERAS2_OPTIMIZER)
  assert isinstance(optimizer, ols.DynamicLossScale)
  assert float(optimizer()) == 4096.0 and optimizer.increment_period == 500
  fixed = ols.deserialize(KERAS2_FIXED_OPTIMIZER)
  assert isinstance(fixed, ols.FixedLossScale) and fixed.loss_scale_value == 64
  assert isinstance(ols.deserialize(TF23_OPTIMIZER), ols.DynamicLossScale)


@pytest.mark.parametrize(
  "config, error",
  [
    ({"class_name": "DynamicLossScale"}, ValueError),
    ({"config": {}}, ValueError),
    ({"class_name": "FixedLossScale", "config": {}, "extra": 1}, ValueError),
    ({"class_name": "os.system", "config": {}}, ValueError),
    ({"class_name": "LossScale", "config": {}}, ValueError),
    ({"class_name": 3, "config": {}}, ValueError),
    ({"class_name": "FixedLossScale", "config": [1]}, ValueError),
    (
      {"class_name": "FixedLossScale", "config": {"loss_scale_value": 0.5}},
      ValueError,
    ),
    (
      {"class_name": "FixedLossScale", "config": {"loss_scale_value": "1"}},
      TypeError,
    ),
    ({"class_name": "FixedLossScale", "config": {"value": 2.0}}, ValueError),
    (
      {
        "class_name": "DynamicLossScale",
        "config": {"increment_period": 10**400},
      },
      ValueError,
    ),
    (
      {
        "class_name": "DynamicLossScale",
        "config": {"initial_loss_scale": 10**400},
      },
      ValueError,
    ),
    ("FixedLossScale", TypeError),
    (None, TypeError),
  ],
)
def test_deserialize_rejects_malformed_configs(config, error):
  with pytest.raises(error):
    ols.deserialize(config)


def test_deserialize_names_the_keys_it_was_given():
  with pytest.raises(ValueError) as error:
    ols.deserialize({"class_name": "FixedLossScale", "config": {}, "extra": 1})
  assert str(error.value) == (
    "`deserialize(config)` takes a dict with the keys 'class_name' and"
    " 'config', got the keys ['class_name', 'config', 'extra']."
  )


def test_deserialize_refuses_unregistered_subclasses_until_registered():
  class Halving(ols.NoOpLossScale):
    pass

  config = {"class_name": "Halving", "config": {}}
  with pytest.raises(ValueError, match="unknown loss scale class"):
    ols.deserialize(config)
  ols.register_loss_scale(Halving)
  assert type(ols.deserialize(config)) is Halving


def test_register_rejects_non_loss_scales_and_name_clashes():
  with pytest.raises(TypeError, match="cls"):
    ols.register_loss_scale(dict)  # type: ignore[arg-type]

  class FixedLossScale(ols.NoOpLossScale):
    pass

  with pytest.raises(ValueError, match="already taken"):
    ols.register_loss_scale(FixedLossScale)


def test_serialize_rejects_non_loss_scales():
  with pytest.raises(TypeError, match="loss_scale"):
    ols.serialize(2.0)  # type: ignore[arg-type]


# --- the Raises sections -------------------------------------------------------


@pytest.mark.parametrize(
  "cls, config, error, match",
  [
    (
      ols.FixedLossScale,
      [("loss_scale_value", 2.0)],
      TypeError,
      "takes a dict",
    ),
    (ols.FixedLossScale, {"loss_scale_value": "2"}, TypeError, "a number"),
    (
      ols.FixedLossScale,
      {"value": 2.0},
      ValueError,
      r"unknown keys \['value'\]",
    ),
    (ols.FixedLossScale, {"loss_scale_value": 0.5}, ValueError, "at least 1"),
    (
      ols.DynamicLossScale,
      {"current_loss_scale": 8.0},
      ValueError,
      r"unknown keys \['current_loss_scale'\]",
    ),
    (ols.DynamicLossScale, {"multiplier": 1.0}, ValueError, "greater than 1"),
    (ols.DynamicLossScale, {"hysteresis": 1.5}, TypeError, "hysteresis"),
    (ols.NoOpLossScale, {"loss_scale_value": 2.0}, ValueError, "unknown keys"),
  ],
)
def test_from_config_raises_as_documented(cls, config, error, match):
  with pytest.raises(error, match=match) as raised:
    cls.from_config(config)
  assert cls.__name__ in str(raised.value)


@pytest.mark.parametrize(
  "identifier, error, match",
  [
    (0.5, ValueError, "at least 1"),
    (np.array([2.0, 4.0]), ValueError, "scalar"),
    (np.complex64(2), TypeError, "real number"),
    ({"class_name": "NoSuchLossScale", "config": {}}, ValueError, "unknown"),
    (
      {"class_name": "FixedLossScale", "config": {"loss_scale_value": "2"}},
      TypeError,
      "a number",
    ),
  ],
)
def test_get_raises_what_fixed_loss_scale_and_deserialize_raise(
  identifier, error, match
):
  with pytest.raises(error, match=match):
    ols.get(identifier)


def test_register_refuses_a_name_another_registered_class_has():
  def make():
    class TakenOnce(ols.NoOpLossScale):
      pass

    return TakenOnce

  first = make()
  assert ols.register_loss_scale(first) is first
  assert ols.register_loss_scale(first) is first  # the same class again
  with pytest.raises(ValueError, match="'TakenOnce' is already taken by"):
    ols.register_loss_scale(make())
