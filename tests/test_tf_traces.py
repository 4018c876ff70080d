"""Bit for bit against TensorFlow 2.21's own loss scales.

The ground truth is `tests/data/tf_traces.json` (see `tests/data/README.md`):
TensorFlow's scales, `should_apply` decisions and serialized configs, not a
model of them. Every run is replayed eagerly, under `jax.jit` (one compiled
step per configuration, reused), in `lax.scan` and under `vmap` (the runs of
one configuration stacked as members). Scales are compared as float32 bit
patterns, decisions and counters exactly.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_lossscale as ols
from tests.tf_reference import (
  TRACES,
  hysteresis_loss_scale,
  load_tf_traces,
  tf_dynamic_loss_scale,
  trace_finite,
  trace_grads,
)

_DATA = load_tf_traces()
DYNAMIC = _DATA["dynamic"]
FIXED = _DATA["fixed"]
SERIALIZED = _DATA["serialized"]
# Where CI puts a read-only copy of `shared/`, beside the repository.
SHARED = (
  pathlib.Path(__file__).parents[1] / ".." / "shared" / "tf_traces"
).resolve() / "tf_traces.json"
TF_DYNAMIC_KEYS = ("initial_loss_scale", "increment_period", "multiplier")
LEAVES = 5  # the most leaves a traced step has
LONGEST = max(len(r["steps"]) for r in DYNAMIC + FIXED)


def _bits(scales) -> np.ndarray:
  """float32 bit patterns: `0.0 == -0.0` and NaNs cannot hide a difference."""
  return np.asarray(scales, np.float32).view(np.uint32)


def _name(run: dict) -> str:
  return (
    f"run {DYNAMIC.index(run)} ({run['initial_loss_scale']:g},"
    f" {run['increment_period']}, {run['multiplier']:g})"
  )


def _expected(run: dict) -> dict[str, np.ndarray]:
  """TensorFlow's scales and decisions, and the counters the traces omit.

  The good-step counter is the NumPy model's, which reproduces every traced
  scale (see the test below), so it wraps where TensorFlow's does; the bad
  steps are counted by the hysteresis rule with `hysteresis=1`.
  """
  finite = [trace_finite(s) for s in run["steps"]]
  config = {k: run[k] for k in TF_DYNAMIC_KEYS}
  bad = hysteresis_loss_scale(
    finite,
    scale=run["initial_loss_scale"],
    increment_period=run["increment_period"],
    multiplier=run["multiplier"],
  )
  return {
    "scale": np.array([s["scale"] for s in run["steps"]], np.float32),
    "good": np.array(
      [g for _, g, _ in tf_dynamic_loss_scale(finite, **config)]
    ),
    "bad": np.array([b for _, _, b in bad]),
    "apply": np.array([s["should_apply"] for s in run["steps"]]),
  }


def _assert_matches(run: dict, got: dict[str, np.ndarray]) -> None:
  want = _expected(run)
  n = len(want["scale"])
  for key, value in got.items():
    value = np.asarray(value)[:n]
    if key == "scale":
      assert value.dtype == np.float32
      value, want[key] = _bits(value), _bits(want[key])
    elif key in ("good", "bad"):
      assert value.dtype == np.int32, key
    np.testing.assert_array_equal(value, want[key], f"{key} of {_name(run)}")


def _outputs(ls: ols.DynamicLossScale, should_apply) -> dict:
  return {
    "scale": ls(),
    "good": ls.num_good_steps,
    "bad": ls.num_bad_steps,
    "apply": should_apply,
  }


def _members(runs: list[dict]) -> ols.DynamicLossScale:
  """The runs' loss scales, stacked, their initial scales given as the state.

  Runs of one configuration then share their (static) hyperparameters, so
  they share a compiled step and are the members of one `vmap`.
  """
  n = len(runs)
  return ols.DynamicLossScale(
    1.0,
    runs[0]["increment_period"],
    runs[0]["multiplier"],
    current_loss_scale=np.array(
      [r["initial_loss_scale"] for r in runs], np.float32
    ),
    num_good_steps=np.zeros(n, np.int32),
    num_bad_steps=np.zeros(n, np.int32),
  )


def _member(run: dict) -> ols.DynamicLossScale:
  return jax.tree.map(lambda x: x[0], _members([run]))


def _padded(run: dict, length: int = LONGEST) -> np.ndarray:
  """The run's gradients, one row of `LEAVES` per step: missing leaves are
  0, steps past the run's end finite. (How `update` reads leaves of every
  kind is `test_numerics.py`'s subject; here one vector per step keeps every
  run on one compiled step.)"""
  grads = np.zeros((length, LEAVES), np.float32)
  for i, step in enumerate(run["steps"]):
    grads[i, : len(step["grads"])] = trace_grads(step)
  return grads


def _configurations() -> dict[tuple, list[dict]]:
  groups = collections.defaultdict(list)
  for run in DYNAMIC:
    groups[run["increment_period"], run["multiplier"]].append(run)
  return dict(groups)


CONFIGURATIONS = _configurations()


def _step(ls, grads):
  ls, should_apply = ls.update(grads)
  return ls, _outputs(ls, should_apply)


# --- the traces themselves ----------------------------------------------------


def test_traces_are_tensorflow_s_and_reach_the_edge_cases():
  assert _DATA["tensorflow"] == "2.21.0"
  steps = [s for r in DYNAMIC for s in r["steps"]]
  assert (len(DYNAMIC), len(steps)) == (120, 3037)
  values = collections.Counter(
    g for s in steps for g in s["grads"] if isinstance(g, str)
  )
  assert set(values) == {"nan", "inf", "-inf"}
  # A non-finite value in every leaf position of the 1-, 2- and 5-leaf runs.
  positions = {
    (len(s["grads"]), i)
    for s in steps
    for i, g in enumerate(s["grads"])
    if isinstance(g, str)
  }
  assert positions == {(n, i) for n in (1, 2, 5) for i in range(n)}
  # TensorFlow applies exactly the finite steps.
  assert all(s["should_apply"] == trace_finite(s) for s in steps)
  # The floor at 1 and the refused increase at float32's top are both hit.
  assert any(s["scale"] == 1.0 and not trace_finite(s) for s in steps)
  top = float(np.finfo(np.float32).max)
  assert any(
    s["should_apply"] and prev * r["multiplier"] > top and s["scale"] == prev
    for r in DYNAMIC
    for prev, s in zip(
      [r["initial_loss_scale"]] + [s["scale"] for s in r["steps"]],
      r["steps"],
      strict=False,
    )
  )
  # Multipliers that are not powers of two, whose division must be exact.
  assert {r["multiplier"] for r in DYNAMIC} == {1.5, 2.0, 3.0, 4.0, 10.0}


def test_the_committed_traces_are_the_shared_ones():
  if not SHARED.exists():
    pytest.skip(f"no shared traces at {SHARED} to compare the copy with")
  digest = hashlib.sha256
  assert digest(TRACES.read_bytes()).digest() == (
    digest(SHARED.read_bytes()).digest()
  )


def test_the_numpy_models_reproduce_tensorflow():
  # So the counters they give (the traces omit them) wrap where TensorFlow's
  # did; and the hysteresis rule with `hysteresis=1` is TensorFlow's rule.
  for run in DYNAMIC:
    finite = [trace_finite(s) for s in run["steps"]]
    tf = tf_dynamic_loss_scale(finite, *(run[k] for k in TF_DYNAMIC_KEYS))
    rule = hysteresis_loss_scale(
      finite,
      scale=run["initial_loss_scale"],
      increment_period=run["increment_period"],
      multiplier=run["multiplier"],
    )
    want = _bits([s["scale"] for s in run["steps"]])
    np.testing.assert_array_equal(_bits([s for s, _, _ in tf]), want)
    np.testing.assert_array_equal(_bits([s for s, _, _ in rule]), want)
    assert [g for _, g, _ in rule] == [g for _, g, _ in tf]
    assert [a for _, _, a in tf] == [s["should_apply"] for s in run["steps"]]


# --- DynamicLossScale -----------------------------------------------------------


def test_dynamic_matches_tensorflow_eagerly():
  # Each run with its own configuration; a step's leaves as one vector.
  for run in DYNAMIC:
    ls = ols.DynamicLossScale(*(run[k] for k in TF_DYNAMIC_KEYS))
    outs = []
    for step in run["steps"]:
      ls, out = _step(ls, np.array(trace_grads(step)))
      outs.append(out)
    _assert_matches(run, jax.tree.map(lambda *x: np.stack(x), *outs))


def test_dynamic_matches_tensorflow_under_jit_without_retracing():
  traces = []

  def traced(ls, grads):
    traces.append(None)
    return _step(ls, grads)

  step = jax.jit(traced)
  for run in DYNAMIC:
    ls, outs = _member(run), []
    for grads in _padded(run, len(run["steps"])):
      ls, out = step(ls, grads)
      outs.append(out)
    _assert_matches(run, jax.tree.map(lambda *x: np.stack(x), *outs))
  # One trace per configuration, whatever the scale or the step.
  assert len(traces) == len(CONFIGURATIONS)


def _scanned(ls, grads):
  return lax.scan(_step, ls, grads)[1]


def _stacked(runs: list[dict]) -> tuple[ols.DynamicLossScale, np.ndarray]:
  """The runs' loss scales and gradients, stacked: one row per run."""
  return _members(runs), np.stack([_padded(run) for run in runs])


def _assert_runs_match(runs: list[dict], outs: dict) -> None:
  """Each run against its row of `outs`, stacked over the runs."""
  outs = jax.tree.map(np.asarray, outs)
  for i, run in enumerate(runs):
    _assert_matches(run, jax.tree.map(lambda x, i=i: x[i], outs))


def test_dynamic_matches_tensorflow_in_scan_and_under_vmap():
  # For every configuration, in one compiled program: its runs one after
  # the other (`lax.map` is a scan), each scanned over its steps; and its
  # runs as the members of one loss scale under `vmap`.
  def both(members, grads):
    scanned = lax.map(lambda run: _scanned(*run), (members, grads))
    return scanned, jax.vmap(_scanned)(members, grads)

  configurations = list(CONFIGURATIONS.values())
  outs = jax.jit(lambda args: [both(*a) for a in args])(
    [_stacked(runs) for runs in configurations]
  )
  for runs, (scanned, batched) in zip(configurations, outs, strict=True):
    _assert_runs_match(runs, scanned)
    _assert_runs_match(runs, batched)
  multipliers = {m for (_, m), runs in CONFIGURATIONS.items() if len(runs) > 1}
  assert {1.5, 3.0, 10.0} <= multipliers


def _optimizer_groups() -> list[list[dict]]:
  """Per multiplier that is not a power of two, the configuration with the most runs whose scaled
  gradients stay finite wherever the traced ones are (not those near
  float32's top, where a scaled gradient of 3 overflows before TensorFlow's
  `update` would see it)."""
  best: dict[float, list[dict]] = {}
  with np.errstate(over="ignore"):
    for (_, multiplier), runs in CONFIGURATIONS.items():
      if multiplier in (2.0, 4.0):
        continue
      kept = [
        run
        for run in runs
        if all(
          np.all(np.isfinite(np.float32(scale) * np.array(trace_grads(s))))
          for scale, s in zip(
            [run["initial_loss_scale"]] + [s["scale"] for s in run["steps"]],
            run["steps"],
            strict=False,
          )
          if trace_finite(s)
        )
      ]
      if len(kept) > len(best.get(multiplier, [])):
        best[multiplier] = kept
  return list(best.values())


def _optimizer_run(loss_scale, grads):
  """One run through `LossScaleOptimizer.apply_gradients`, in `lax.scan`."""
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), loss_scale)

  def step(carry, grads):
    params, state = carry
    # A train step's view: the gradients arrive scaled by the current scale.
    scaled = list(grads * state.loss_scale())
    params, state = tx.apply_gradients(scaled, state, params)
    return (params, state), _outputs(state.loss_scale, state.should_apply)

  params = [jnp.zeros((), jnp.float32)] * LEAVES
  (params, state), outs = lax.scan(step, (params, tx.init(params)), grads)
  return params, state.skipped_steps, outs


def test_loss_scale_optimizer_skips_and_scales_as_tensorflow():
  # Each multiplier's runs are the members of one `vmap`. (The loss
  # scale's arithmetic, which the optimizer calls, is checked on every run
  # above; here, that the optimizer skips and scales with it.)
  groups = _optimizer_groups()
  assert sorted(runs[0]["multiplier"] for runs in groups) == [1.5, 3, 10]
  results = jax.jit(lambda args: [jax.vmap(_optimizer_run)(*a) for a in args])(
    [_stacked(runs) for runs in groups]
  )
  for runs, (params, skips, outs) in zip(groups, results, strict=True):
    _assert_runs_match(runs, outs)
    for i, run in enumerate(runs):
      skipped = np.array([not s["should_apply"] for s in run["steps"]])
      assert int(skips[i]) == skipped.sum()
      # Only the applied steps moved the parameters.
      grads = _padded(run, len(skipped))
      np.testing.assert_allclose(
        [p[i] for p in params],
        -grads[~skipped].sum(axis=0),
        rtol=1e-5,
        atol=1e-6,
      )


# --- FixedLossScale ---------------------------------------------------------------


def _fixed_steps(run: dict) -> list[np.ndarray]:
  steps = map(trace_grads, run["steps"])
  return [np.stack(leaf) for leaf in zip(*steps, strict=True)]


def _fixed_update(ls, grads):
  ls, should_apply = ls.update(grads)
  return ls, (ls(), should_apply)


def _fixed_eager(loss_scales, grads, step=_fixed_update):
  return [
    [step(ls, list(g))[1] for g in zip(*steps, strict=True)]
    for ls, steps in zip(loss_scales, grads, strict=True)
  ]


def _fixed_jit(loss_scales, grads):
  traces = []

  def traced(ls, grads):
    traces.append(None)
    return _fixed_update(ls, grads)

  out = _fixed_eager(loss_scales, grads, jax.jit(traced))
  # One trace per value (static, as a float: 1 and 1.0 are one).
  assert len(traces) == len({float(r["loss_scale_value"]) for r in FIXED})
  return out


def _fixed_scan(loss_scales, grads):
  return jax.jit(
    lambda xs: [
      lax.scan(_fixed_update, ls, x)[1]
      for ls, x in zip(loss_scales, xs, strict=True)
    ]
  )(grads)


def _fixed_vmap(loss_scales, grads):
  # The steps as members: the loss scale, without leaves, is shared.
  return jax.jit(
    lambda xs: [
      jax.vmap(lambda g, ls=ls: _fixed_update(ls, g)[1])(x)
      for ls, x in zip(loss_scales, xs, strict=True)
    ]
  )(grads)


@pytest.mark.parametrize(
  "drive",
  [_fixed_eager, _fixed_jit, _fixed_scan, _fixed_vmap],
  ids=["eager", "jit", "scan", "vmap"],
)
def test_fixed_matches_tensorflow(drive):
  loss_scales = [ols.FixedLossScale(r["loss_scale_value"]) for r in FIXED]
  outs = drive(loss_scales, [_fixed_steps(r) for r in FIXED])
  for run, out in zip(FIXED, outs, strict=True):
    scales, applies = np.asarray(out).T if isinstance(out, list) else out
    want = [s["scale"] for s in run["steps"]]
    np.testing.assert_array_equal(_bits(scales), _bits(want))
    # TensorFlow's FixedLossScale applies NaN and inf gradients too.
    assert np.asarray(applies).tolist() == [True] * len(want)
    assert [s["should_apply"] for s in run["steps"]] == [True] * len(want)


def test_fixed_optimizer_without_skipping_applies_as_tensorflow():
  assert any(not trace_finite(s) for r in FIXED for s in r["steps"])

  @jax.jit
  def applies_of_every_run(grads_per_run):
    out = []
    for run, grads in zip(FIXED, grads_per_run, strict=True):
      tx = ols.LossScaleOptimizer(
        optax.sgd(1.0),
        ols.FixedLossScale(run["loss_scale_value"]),
        skip_nonfinite=False,
      )

      def step(state, g, tx=tx):
        scaled = [x * state.loss_scale() for x in g]
        _, state = tx.update(scaled, state, [jnp.float32(0)] * len(g))
        return state, state.should_apply

      params = [jnp.float32(0)] * len(grads)
      out.append(lax.scan(step, tx.init(params), grads)[1])
    return out

  got = applies_of_every_run([_fixed_steps(r) for r in FIXED])
  for run, applies in zip(FIXED, got, strict=True):
    assert applies.tolist() == [s["should_apply"] for s in run["steps"]]


def test_fixed_config_is_tensorflow_s():
  # Keys, values and Python types: TensorFlow writes the value as a float
  # (1000 -> 1000.0) and keeps the double (12345.678), not the float32.
  for run in FIXED:
    config = ols.FixedLossScale(run["loss_scale_value"]).get_config()
    assert json.dumps(config) == json.dumps(run["config"])


# --- serialized configs -------------------------------------------------------------


@pytest.mark.parametrize(
  "entry",
  SERIALIZED,
  ids=lambda e: "{class_name}-{config}".format(**e).replace(" ", ""),
)
def test_tensorflow_s_serialized_configs_round_trip(entry):
  loss_scale = ols.deserialize(json.loads(json.dumps(entry)))
  assert type(loss_scale).__name__ == entry["class_name"]
  # Keys, values and their JSON types, exactly as TensorFlow wrote them.
  assert json.dumps(ols.serialize(loss_scale)) == json.dumps(entry)
  config = entry["config"]
  value = config.get("loss_scale_value", config.get("initial_loss_scale"))
  np.testing.assert_array_equal(_bits(loss_scale()), _bits(value))
  if isinstance(loss_scale, ols.DynamicLossScale):
    # The bounds TensorFlow lacks hold its fixed behaviour: the defaults.
    assert (loss_scale.min_loss_scale, loss_scale.max_loss_scale) == (1.0, None)
    assert (loss_scale.hysteresis, loss_scale.consecutive_hysteresis) == (
      1,
      False,
    )
    assert int(loss_scale.num_good_steps) == int(loss_scale.num_bad_steps) == 0
    if config["increment_period"] == 2000:  # TensorFlow's defaults
      assert ols.serialize(ols.DynamicLossScale()) == entry
  else:
    for kind in (int, float, np.float32):
      same = ols.FixedLossScale(kind(config["loss_scale_value"]))
      assert json.dumps(ols.serialize(same)) == json.dumps(entry)
