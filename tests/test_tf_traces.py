"""Bit for bit against TensorFlow 2.21's own loss scales.

The ground truth is `tests/data/tf_traces.json` (see `tests/data/README.md`):
TensorFlow's scales, `should_apply` decisions and serialized configs, not a
model of them. Scales are compared as float32 bit patterns, decisions and
counters exactly, eagerly, under `jax.jit` and in `lax.scan`.
"""

from __future__ import annotations

import collections
import copy
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


def _run_id(run: dict) -> str:
  return (
    f"{run['initial_loss_scale']:g}-{run['increment_period']}"
    f"-{run['multiplier']:g}-{len(run['steps'])}steps"
  )


DYNAMIC_IDS = [f"{i}:{_run_id(r)}" for i, r in enumerate(DYNAMIC)]
FIXED_IDS = [f"{i}:{f['loss_scale_value']!r}" for i, f in enumerate(FIXED)]
MODES = ["eager", "jit", "scan"]


def _bits(scales) -> np.ndarray:
  """float32 bit patterns: `0.0 == -0.0` and NaNs cannot hide a difference."""
  return np.asarray(scales, np.float32).view(np.uint32)


def _dynamic(run: dict) -> ols.DynamicLossScale:
  return ols.DynamicLossScale(
    run["initial_loss_scale"], run["increment_period"], run["multiplier"]
  )


def _model(run: dict) -> list[tuple[np.float32, int, bool]]:
  return tf_dynamic_loss_scale(
    [trace_finite(s) for s in run["steps"]],
    run["initial_loss_scale"],
    run["increment_period"],
    run["multiplier"],
  )


def _expected(run: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """TensorFlow's scales and decisions, and the counter the traces omit."""
  scales = np.array([s["scale"] for s in run["steps"]], np.float32)
  applies = np.array([s["should_apply"] for s in run["steps"]])
  return scales, np.array([good for _, good, _ in _model(run)]), applies


def _stacked_grads(steps: list[dict]) -> list[np.ndarray]:
  """The traced leaves, each stacked over steps, for `lax.scan`."""
  per_step = [trace_grads(s) for s in steps]
  return [np.stack(leaf) for leaf in zip(*per_step, strict=True)]


def _drive(loss_scale, steps: list[dict], mode: str):
  """Feeds the traced gradients to `update`; returns per-step results."""

  def step(ls, grads):
    ls, should_apply = ls.update(grads)
    return ls, (ls(), ls.num_good_steps, should_apply)

  if mode == "scan":
    _, out = jax.jit(lambda ls, xs: lax.scan(step, ls, xs))(
      loss_scale, _stacked_grads(steps)
    )
    return [np.asarray(x) for x in out]
  traces = []

  def traced(ls, grads):
    traces.append(None)
    return step(ls, grads)

  update = jax.jit(traced) if mode == "jit" else step
  outs = []
  for s in steps:
    loss_scale, out = update(loss_scale, trace_grads(s))
    assert loss_scale.current_loss_scale.dtype == jnp.float32
    assert loss_scale.num_good_steps.dtype == jnp.int32
    outs.append(out)
  # Under jit, one trace for the whole run: only array state changes.
  assert len(traces) == (1 if mode == "jit" else 0)
  return [np.array([np.asarray(o[i]) for o in outs]) for i in range(3)]


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
  assert any(_refused_increases(r) for r in DYNAMIC)


def _refused_increases(run: dict) -> list[int]:
  """Steps where TensorFlow kept the scale because raising it overflowed."""
  top = float(np.finfo(np.float32).max)
  _, counters, applies = _expected(run)
  before = [run["initial_loss_scale"]] + [s["scale"] for s in run["steps"]]
  return [
    i
    for i, s in enumerate(run["steps"])
    if applies[i]
    and counters[i] == 0
    and before[i] * run["multiplier"] > top
    and s["scale"] == before[i]
  ]


def test_the_committed_traces_are_the_shared_ones():
  if not SHARED.exists():
    pytest.skip(f"no shared traces at {SHARED} to compare the copy with")
  digest = hashlib.sha256
  assert digest(TRACES.read_bytes()).digest() == (
    digest(SHARED.read_bytes()).digest()
  )


@pytest.mark.parametrize("run", DYNAMIC, ids=DYNAMIC_IDS)
def test_the_numpy_model_reproduces_tensorflow(run):
  # So the counter it gives (the traces omit it) wraps where TensorFlow's did.
  model = _model(run)
  np.testing.assert_array_equal(
    _bits([s for s, _, _ in model]),
    _bits([s["scale"] for s in run["steps"]]),
  )
  np.testing.assert_array_equal(
    [a for _, _, a in model], [s["should_apply"] for s in run["steps"]]
  )


# --- DynamicLossScale -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("run", DYNAMIC, ids=DYNAMIC_IDS)
def test_dynamic_loss_scale_matches_tensorflow_bit_for_bit(run, mode):
  scales, counters, applies = _drive(_dynamic(run), run["steps"], mode)
  want_scales, want_counters, want_applies = _expected(run)
  assert scales.dtype == np.float32 and counters.dtype == np.int32
  np.testing.assert_array_equal(_bits(scales), _bits(want_scales))
  np.testing.assert_array_equal(applies, want_applies)
  np.testing.assert_array_equal(counters, want_counters)


def _vmap_groups() -> list[list[dict]]:
  """Runs sharing hyperparameters and leaf count, two or more to a group."""
  groups = collections.defaultdict(list)
  for run in DYNAMIC:
    key = (*(run[k] for k in TF_DYNAMIC_KEYS), len(run["steps"][0]["grads"]))
    groups[key].append(run)
  return [g for g in groups.values() if len(g) > 1]


VMAP_GROUPS = [
  pytest.param(
    group,
    id=_run_id(group[0]),
  )
  for group in _vmap_groups()
]


@pytest.mark.parametrize("runs", VMAP_GROUPS)
def test_dynamic_loss_scale_matches_tensorflow_under_vmap(runs):
  # One loss scale per run, batched; every run cut to the shortest.
  n = min(len(r["steps"]) for r in runs)
  grads = [
    np.stack(leaf)
    for leaf in zip(
      *(_stacked_grads(r["steps"][:n]) for r in runs), strict=True
    )
  ]
  batched = jax.tree.map(
    lambda x: jnp.stack([x] * len(runs)), _dynamic(runs[0])
  )

  def step(ls, g):
    ls, should_apply = ls.update(g)
    return ls, (ls(), ls.num_good_steps, should_apply)

  def one_run(ls, xs):
    return lax.scan(step, ls, xs)[1]

  scales, counters, applies = jax.jit(jax.vmap(one_run))(batched, grads)
  for i, run in enumerate(runs):
    want_scales, want_counters, want_applies = _expected(run)
    np.testing.assert_array_equal(_bits(scales[i]), _bits(want_scales[:n]))
    np.testing.assert_array_equal(counters[i], want_counters[:n])
    np.testing.assert_array_equal(applies[i], want_applies[:n])


def _optimizer_runs() -> list[dict]:
  """For each multiplier and leaf count, the run with the most skips.

  Only runs whose scaled gradients stay finite wherever the traced ones are
  (not those near float32's top, where a scaled gradient of 3 overflows
  before TensorFlow's `update` would see it). A subset, because each run
  compiles its own step; the loss scale's arithmetic, which the optimizer
  calls, is checked on every run above.
  """
  best: dict[tuple, tuple[int, dict]] = {}
  with np.errstate(over="ignore"):
    for run in DYNAMIC:
      before = [run["initial_loss_scale"]] + [s["scale"] for s in run["steps"]]
      if not all(
        np.all(np.isfinite(np.float32(scale) * np.array(trace_grads(s))))
        for scale, s in zip(before, run["steps"], strict=False)
        if trace_finite(s)
      ):
        continue
      key = (run["multiplier"], len(run["steps"][0]["grads"]))
      skips = sum(not s["should_apply"] for s in run["steps"])
      if key not in best or skips > best[key][0]:
        best[key] = (skips, run)
  return [run for _, run in best.values()]


OPTIMIZER_RUNS = _optimizer_runs()


@pytest.mark.parametrize(
  "run", OPTIMIZER_RUNS, ids=[_run_id(r) for r in OPTIMIZER_RUNS]
)
def test_loss_scale_optimizer_skips_and_scales_as_tensorflow(run):
  # A train step's view: the gradients arrive scaled by the current scale.
  tx = ols.LossScaleOptimizer(optax.sgd(1.0), _dynamic(run))
  n = len(run["steps"][0]["grads"])
  params = [jnp.zeros((), jnp.float32) for _ in range(n)]

  def step(carry, grads):
    params, state = carry
    scale = state.loss_scale()
    scaled = [g * scale for g in grads]
    params, state = tx.apply_gradients(scaled, state, params)
    return (params, state), (state.loss_scale(), state.should_apply)

  (params, state), (scales, applies) = jax.jit(
    lambda p, xs: lax.scan(step, (p, tx.init(p)), xs)
  )(params, _stacked_grads(run["steps"]))
  want_scales, _, want_applies = _expected(run)
  np.testing.assert_array_equal(_bits(scales), _bits(want_scales))
  np.testing.assert_array_equal(applies, want_applies)
  assert int(state.skipped_steps) == int(np.sum(~want_applies))
  # Only the applied steps moved the parameters.
  applied = [trace_grads(s) for s in run["steps"] if s["should_apply"]]
  if applied:
    want = -np.sum(np.array(applied, np.float32), axis=0)
    np.testing.assert_allclose(np.array(params), want, rtol=1e-5, atol=1e-6)
  assert all(bool(jnp.isfinite(p)) for p in params)


def test_the_optimizer_check_covers_every_multiplier_and_leaf_count():
  covered = {
    (r["multiplier"], len(r["steps"][0]["grads"])) for r in OPTIMIZER_RUNS
  }
  traced = {(r["multiplier"], len(r["steps"][0]["grads"])) for r in DYNAMIC}
  assert covered == traced


# --- FixedLossScale ---------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("run", FIXED, ids=FIXED_IDS)
def test_fixed_loss_scale_matches_tensorflow_bit_for_bit(run, mode):
  loss_scale = ols.FixedLossScale(run["loss_scale_value"])

  def step(ls, grads):
    ls, should_apply = ls.update(grads)
    return ls, (ls(), should_apply)

  if mode == "scan":
    _, (scales, applies) = jax.jit(lambda ls, xs: lax.scan(step, ls, xs))(
      loss_scale, _stacked_grads(run["steps"])
    )
  else:
    update = jax.jit(step) if mode == "jit" else step
    outs = [update(loss_scale, trace_grads(s))[1] for s in run["steps"]]
    scales, applies = (np.array([o[i] for o in outs]) for i in range(2))
  want = np.array([s["scale"] for s in run["steps"]], np.float32)
  np.testing.assert_array_equal(_bits(scales), _bits(want))
  # TensorFlow's FixedLossScale applies NaN and inf gradients too.
  np.testing.assert_array_equal(
    applies, [s["should_apply"] for s in run["steps"]]
  )
  assert all(s["should_apply"] for s in run["steps"])


@pytest.mark.parametrize("run", FIXED, ids=FIXED_IDS)
def test_fixed_optimizer_without_skipping_applies_as_tensorflow(run):
  tx = ols.LossScaleOptimizer(
    optax.sgd(1.0),
    ols.FixedLossScale(run["loss_scale_value"]),
    skip_nonfinite=False,
  )
  params = [jnp.zeros((), jnp.float32) for _ in run["steps"][0]["grads"]]
  state = tx.init(params)
  update = jax.jit(tx.update)
  for s in run["steps"]:
    scaled = [g * state.loss_scale() for g in trace_grads(s)]
    _, state = update(scaled, state, params)
    assert bool(state.should_apply) is s["should_apply"]


@pytest.mark.parametrize("run", FIXED, ids=FIXED_IDS)
def test_fixed_config_is_tensorflow_s(run):
  # Keys, values and Python types: TensorFlow writes the value as a float
  # (1000 -> 1000.0) and keeps the double (12345.678), not the float32.
  config = ols.FixedLossScale(run["loss_scale_value"]).get_config()
  assert json.dumps(config) == json.dumps(run["config"])


# --- serialized configs -------------------------------------------------------------


def _tf_keys(config: dict) -> str:
  """TensorFlow's keys of a config, as JSON: floats and ints stay apart."""
  return json.dumps({k: config[k] for k in TF_DYNAMIC_KEYS})


@pytest.mark.parametrize("entry", SERIALIZED, ids=lambda e: e["class_name"])
@pytest.mark.parametrize("read", ["deserialize", "get"])
def test_tensorflow_s_serialized_configs_load(entry, read):
  loss_scale = getattr(ols, read)(copy.deepcopy(entry))
  assert type(loss_scale).__name__ == entry["class_name"]
  config = ols.serialize(loss_scale)
  assert config["class_name"] == entry["class_name"]
  if entry["class_name"] == "FixedLossScale":
    assert json.dumps(config) == json.dumps(entry)
    value = entry["config"]["loss_scale_value"]
  else:
    assert _tf_keys(config["config"]) == json.dumps(entry["config"])
    # The bounds TensorFlow lacks hold its fixed behaviour: the defaults.
    assert (loss_scale.min_loss_scale, loss_scale.max_loss_scale) == (1.0, None)
    assert int(loss_scale.num_good_steps) == 0
    value = entry["config"]["initial_loss_scale"]
  np.testing.assert_array_equal(_bits(loss_scale()), _bits(np.float32(value)))
  # And back again, unchanged.
  assert ols.serialize(ols.deserialize(config)) == config


@pytest.mark.parametrize(
  "entry",
  [e for e in SERIALIZED if e["class_name"] == "DynamicLossScale"],
  ids=lambda e: "{initial_loss_scale:g}-{increment_period}".format(
    **e["config"]
  ),
)
def test_serialize_writes_tensorflow_s_dynamic_config_exactly(entry):
  loss_scale = ols.deserialize(copy.deepcopy(entry))
  assert json.dumps(ols.serialize(loss_scale)) == json.dumps(entry)


def test_get_dynamic_is_tensorflow_s_default():
  defaults = [
    e
    for e in SERIALIZED
    if e["class_name"] == "DynamicLossScale"
    and e["config"]["increment_period"] == 2000
  ]
  assert defaults
  config = ols.serialize(ols.get("dynamic"))["config"]
  for entry in defaults:
    assert _tf_keys(config) == json.dumps(entry["config"])


@pytest.mark.parametrize(
  "entry",
  [e for e in SERIALIZED if e["class_name"] == "FixedLossScale"],
  ids=lambda e: f"{e['config']['loss_scale_value']:g}",
)
@pytest.mark.parametrize("kind", [int, float, np.float32])
def test_get_number_serializes_as_tensorflow(entry, kind):
  value = kind(entry["config"]["loss_scale_value"])
  assert json.dumps(ols.serialize(ols.get(value))) == json.dumps(entry)
