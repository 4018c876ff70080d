"""`serialize`, `deserialize` and configs, in TensorFlow's and Keras' formats.

TensorFlow's own serialized configs are checked in `test_tf_traces.py`.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

import optax_lossscale as ols

LOSS_SCALES = {
  "fixed": ols.FixedLossScale(123),
  "dynamic": ols.DynamicLossScale(),
  "dynamic-custom": ols.DynamicLossScale(
    1,
    2,
    3,
    min_loss_scale=0.5,
    max_loss_scale=1e9,
    hysteresis=4,
    consecutive_hysteresis=True,
  ),
  "noop": ols.NoOpLossScale(),
}


@pytest.mark.parametrize("loss_scale", LOSS_SCALES.values(), ids=LOSS_SCALES)
def test_serialization_round_trips_through_json(loss_scale):
  config = ols.serialize(loss_scale)
  assert config == {
    "class_name": type(loss_scale).__name__,
    "config": loss_scale.get_config(),
  }
  restored = ols.deserialize(json.loads(json.dumps(config)))
  assert type(restored) is type(loss_scale)
  assert restored.get_config() == loss_scale.get_config()
  assert float(restored()) == float(loss_scale())
  again = type(loss_scale).from_config(loss_scale.get_config())
  assert ols.serialize(again) == config


def test_get_config_writes_tensorflow_s_keys_and_only_changed_others():
  assert ols.DynamicLossScale(1, 2, 3).get_config() == {
    "initial_loss_scale": 1.0,
    "increment_period": 2,
    "multiplier": 3.0,
  }
  bounded = ols.DynamicLossScale(4, 2, 2, min_loss_scale=2, max_loss_scale=64)
  assert bounded.get_config() == {
    "initial_loss_scale": 4.0,
    "increment_period": 2,
    "multiplier": 2.0,
    "min_loss_scale": 2.0,
    "max_loss_scale": 64.0,
  }
  assert ols.DynamicLossScale(hysteresis=2).get_config()["hysteresis"] == 2
  assert ols.FixedLossScale(5).get_config() == {"loss_scale_value": 5.0}
  assert ols.NoOpLossScale().get_config() == {}


def test_a_0_1_0_config_with_the_default_bounds_spelled_out_loads():
  old = {
    "initial_loss_scale": 1.0,
    "increment_period": 2,
    "multiplier": 3.0,
    "min_loss_scale": 1.0,
    "max_loss_scale": None,
  }
  loss_scale = ols.DynamicLossScale.from_config(old)
  assert loss_scale.get_config() == {
    k: v for k, v in old.items() if "loss_scale" not in k or "initial" in k
  }
  wrapped = {"class_name": "DynamicLossScale", "config": old}
  assert ols.deserialize(wrapped).get_config() == loss_scale.get_config()


def test_serialize_restarts_from_the_initial_scale_as_tensorflow_does():
  loss_scale, _ = ols.DynamicLossScale(8.0, hysteresis=1).update(
    [jnp.array(jnp.inf)]
  )
  restored = ols.deserialize(ols.serialize(loss_scale))
  assert float(loss_scale()) == 4.0 and float(restored()) == 8.0
  assert int(restored.num_bad_steps) == 0


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


@pytest.mark.parametrize(
  "config, expected",
  [
    (KERAS3_DYNAMIC, ols.DynamicLossScale(1024.0, 100)),
    (KERAS2_OPTIMIZER, ols.DynamicLossScale(4096.0, 500)),
    (KERAS2_FIXED_OPTIMIZER, ols.FixedLossScale(64.0)),
    (TF23_OPTIMIZER, ols.DynamicLossScale()),
  ],
  ids=[
    "keras3",
    "keras2-optimizer",
    "keras2-fixed-optimizer",
    "tf2.3-optimizer",
  ],
)
def test_deserialize_reads_keras_configs_without_importing_their_module(
  config, expected
):
  loss_scale = ols.deserialize(config)
  assert ols.serialize(loss_scale) == ols.serialize(expected)


MALFORMED = [
  (
    {"class_name": "DynamicLossScale"},
    ValueError,
    "got the keys ['class_name'].",
  ),
  ({"config": {}}, ValueError, "with the keys 'class_name' and 'config'"),
  (
    {"class_name": "FixedLossScale", "config": {}, "extra": 1},
    ValueError,
    "got the keys ['class_name', 'config', 'extra'].",
  ),
  (
    {"class_name": "os.system", "config": {}},
    ValueError,
    "unknown loss scale class str 'os.system'; known: ['DynamicLossScale',",
  ),
  (
    {"class_name": "LossScale", "config": {}},
    ValueError,
    "unknown loss scale class str 'LossScale'",
  ),
  (
    {"class_name": 3, "config": {}},
    ValueError,
    "unknown loss scale class int 3",
  ),
  (
    {"class_name": "FixedLossScale", "config": [1]},
    ValueError,
    "'config' must be a dict with string keys.",
  ),
  (
    {"class_name": "FixedLossScale", "config": {"loss_scale_value": 0.5}},
    ValueError,
    "must be at least 1, got 0.5.",
  ),
  (
    {"class_name": "FixedLossScale", "config": {"loss_scale_value": "1"}},
    TypeError,
    "must be a real number, got str '1'.",
  ),
  (
    {"class_name": "FixedLossScale", "config": {"value": 2.0}},
    ValueError,
    "got unknown keys ['value']; it takes ['loss_scale_value'].",
  ),
  (
    {"class_name": "DynamicLossScale", "config": {"increment_period": 1e3}},
    TypeError,
    "must be an int, got float 1000.0.",
  ),
  (
    {
      "class_name": "DynamicLossScale",
      "config": {"increment_period": 10**400},
    },
    ValueError,
    "increment_period=...)` must be an int in [1, 2147483647], got 1000",
  ),
  (
    {
      "class_name": "DynamicLossScale",
      "config": {"initial_loss_scale": 10**400},
    },
    ValueError,
    "initial_loss_scale=...)` must be finite in float32",
  ),
  ("FixedLossScale", TypeError, "takes a dict, got str."),
  (None, TypeError, "takes a dict, got NoneType."),
]


@pytest.mark.parametrize(
  "config, error, message", MALFORMED, ids=[c[2] for c in MALFORMED]
)
def test_deserialize_rejects_malformed_configs_saying_why(
  config, error, message
):
  with pytest.raises(error) as raised:
    ols.deserialize(config)
  assert message in str(raised.value)


BAD_CONFIGS = [
  (
    ols.FixedLossScale,
    [("loss_scale_value", 2.0)],
    TypeError,
    "takes a dict",
  ),
  (ols.FixedLossScale, {"loss_scale_value": 0.5}, ValueError, "at least 1"),
  (
    ols.DynamicLossScale,
    {"current_loss_scale": 8.0},
    ValueError,
    "unknown keys ['current_loss_scale']",
  ),
  (
    ols.DynamicLossScale,
    {"hysteresis_budget": 2},  # an unreleased 0.2.0 field
    ValueError,
    "unknown keys ['hysteresis_budget']",
  ),
  (ols.DynamicLossScale, {"multiplier": 1.0}, ValueError, "greater than 1"),
  (ols.DynamicLossScale, {"hysteresis": 1.5}, TypeError, "hysteresis"),
]


@pytest.mark.parametrize(
  "cls, config, error, message",
  BAD_CONFIGS,
  ids=[f"{c[0].__name__}-{c[3]}" for c in BAD_CONFIGS],
)
def test_from_config_raises_as_documented(cls, config, error, message):
  with pytest.raises(error) as raised:
    cls.from_config(config)
  assert message in str(raised.value)
  assert cls.__name__ in str(raised.value)


def test_from_config_names_unknown_keys_of_a_loss_scale_without_fields():
  with pytest.raises(ValueError, match=r"NoOpLossScale.from_config.*\['x'\]"):
    ols.NoOpLossScale.from_config({"x": 1})


def test_deserialize_builds_a_subclass_only_once_registered():
  class Halving(ols.NoOpLossScale):
    pass

  config = {"class_name": "Halving", "config": {}}
  with pytest.raises(ValueError, match="unknown loss scale class str 'Halvi"):
    ols.deserialize(config)
  assert ols.register_loss_scale(Halving) is Halving
  assert ols.register_loss_scale(Halving) is Halving  # the same class again
  assert type(ols.deserialize(config)) is Halving
  assert ols.serialize(Halving()) == config


def test_register_rejects_non_loss_scales_and_taken_names():
  with pytest.raises(TypeError, match="takes a subclass of LossScale, got"):
    ols.register_loss_scale(dict)  # type: ignore[arg-type]

  def make():
    class FixedLossScale(ols.NoOpLossScale):
      pass

    return FixedLossScale

  with pytest.raises(ValueError, match="'FixedLossScale' is already taken"):
    ols.register_loss_scale(make())

  def make_taken():
    class TakenOnce(ols.NoOpLossScale):
      pass

    return TakenOnce

  ols.register_loss_scale(make_taken())
  with pytest.raises(ValueError, match="'TakenOnce' is already taken by"):
    ols.register_loss_scale(make_taken())


def test_serialize_rejects_non_loss_scales():
  with pytest.raises(TypeError, match="takes a LossScale, got float"):
    ols.serialize(2.0)  # type: ignore[arg-type]
