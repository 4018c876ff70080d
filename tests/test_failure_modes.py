"""Hysteresis, loss-aware skips, skip reports and the stop rule."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_lossscale as ols

pytestmark = pytest.mark.usefixtures("standard_promotion")


# --- hysteresis: against an independent reference -----------------------------


def _last_skip(state):
  """The last skip an unbatched state records, or None."""
  reports = ols.skip_reports(state)
  assert len(reports) <= 1 and all(r.member is None for r in reports)
  return reports[0] if reports else None


def _reference(config, finite_steps):
  """Megatron-LM's DynamicGradScaler with DeepSpeed's consecutive option, in
  plain NumPy float32, as the issue states the semantics."""
  f32 = np.float32
  scale = f32(config["initial_loss_scale"])
  mult = f32(config["multiplier"])
  low = f32(config["min_loss_scale"])
  high = config["max_loss_scale"]
  good, budget = 0, config["hysteresis"]
  trace = []
  for finite in finite_steps:
    if finite:
      good += 1
      if config["consecutive_hysteresis"]:
        budget = config["hysteresis"]
      if good >= config["increment_period"]:
        good = 0
        budget = config["hysteresis"]
        with np.errstate(over="ignore"):
          raised = f32(scale * mult)
        if np.isfinite(raised) and (high is None or raised <= f32(high)):
          scale = raised
    else:
      good = 0
      budget = max(budget - 1, 0)
      if budget == 0:
        scale = max(f32(scale / mult), low)
    trace.append((scale, good, budget, finite))
  return trace


def test_hysteresis_matches_an_independent_reference():
  rng = np.random.default_rng(0)
  for _ in range(50):
    config = dict(
      initial_loss_scale=float(2.0 ** rng.integers(0, 20)),
      increment_period=int(rng.integers(1, 8)),
      multiplier=float(rng.choice([2.0, 3.0, 1.5, 10.0])),
      min_loss_scale=float(rng.choice([1.0, 0.5])),
      max_loss_scale=rng.choice([None, 2.0**24]),
      hysteresis=int(rng.integers(1, 5)),
      consecutive_hysteresis=bool(rng.integers(0, 2)),
    )
    if config["max_loss_scale"] is not None:
      config["max_loss_scale"] = float(config["max_loss_scale"])
    config["initial_loss_scale"] = max(
      config["initial_loss_scale"], config["min_loss_scale"]
    )
    finite = rng.random(2000) < rng.uniform(0.3, 0.95)
    ls = ols.DynamicLossScale(**config)

    def step(ls, ok):
      new, apply = ls.adjust(ok)
      budget = (
        new.hysteresis_budget
        if new.hysteresis_budget is not None
        else jnp.int32(0)
      )
      return new, (new(), new.num_good_steps, budget, apply)

    _, (scales, goods, budgets, applies) = jax.jit(
      lambda ls, f: lax.scan(step, ls, f)
    )(ls, jnp.asarray(finite))
    ref = _reference(config, finite.tolist())
    np.testing.assert_array_equal(scales, [r[0] for r in ref], str(config))
    np.testing.assert_array_equal(goods, [r[1] for r in ref])
    if config["hysteresis"] > 1:
      np.testing.assert_array_equal(budgets, [r[2] for r in ref])
    np.testing.assert_array_equal(applies, finite)


def test_hysteresis_budget_refills_even_when_growth_is_capped():
  ls = ols.DynamicLossScale(4.0, 1, max_loss_scale=4.0, hysteresis=2)
  ls, _ = ls.adjust(jnp.array(False))
  assert int(ls.hysteresis_budget) == 1 and float(ls()) == 4
  ls, _ = ls.adjust(jnp.array(True))  # capped: no growth, but a refill
  assert int(ls.hysteresis_budget) == 2 and float(ls()) == 4


def test_default_dynamic_loss_scale_keeps_its_leaves_and_config_keys():
  ls = ols.DynamicLossScale()
  paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ls)
  ]
  assert paths == [".current_loss_scale", ".num_good_steps"]
  # TensorFlow's keys: the bounds and the hysteresis are written only when
  # they are not the defaults.
  assert list(ls.get_config()) == [
    "initial_loss_scale",
    "increment_period",
    "multiplier",
  ]


def test_hysteresis_validation_and_round_trip():
  with pytest.raises(ValueError, match="hysteresis"):
    ols.DynamicLossScale(hysteresis=0)
  with pytest.raises(TypeError, match="hysteresis"):
    ols.DynamicLossScale(hysteresis=2.0)
  with pytest.raises(TypeError, match="consecutive_hysteresis"):
    ols.DynamicLossScale(consecutive_hysteresis=1)
  ls = ols.DynamicLossScale(8.0, hysteresis=3, consecutive_hysteresis=True)
  back = ols.deserialize(ols.serialize(ls))
  assert back.hysteresis == 3 and back.consecutive_hysteresis is True
  assert int(back.hysteresis_budget) == 3


# --- loss-aware steps -----------------------------------------------------------


@pytest.mark.parametrize(
  "loss_scale",
  [ols.DynamicLossScale(8.0, 1), ols.FixedLossScale(8), ols.NoOpLossScale()],
  ids=["dynamic", "fixed", "noop"],
)
@pytest.mark.parametrize("entry", ["update", "apply_gradients"])
def test_nonfinite_loss_skips_and_leaves_the_scale_unchanged(loss_scale, entry):
  tx = ols.LossScaleOptimizer(optax.adam(0.1), loss_scale)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  step = jax.jit(getattr(tx, entry))
  out, state = step({"w": jnp.ones(3)}, state, params, value=jnp.float32(1))
  before = state
  for bad in [jnp.nan, jnp.inf]:
    # Finite gradients, non-finite loss: skipped, scale untouched.
    out, state = step({"w": jnp.ones(3)}, state, params, value=jnp.float32(bad))
    chex.assert_trees_all_equal(state.loss_scale, before.loss_scale)
    chex.assert_trees_all_equal(state.inner_state, before.inner_state)
    assert not bool(state.should_apply)
  assert int(state.skipped_steps) == 2
  assert int(state.consecutive_skipped_steps) == 2
  assert int(state.nonfinite_loss_steps) == 2
  # A gradient overflow with a finite loss counts apart.
  _, state = step(
    {"w": jnp.full(3, jnp.inf)}, state, params, value=jnp.float32(1)
  )
  assert int(state.skipped_steps) == 3 and int(state.nonfinite_loss_steps) == 2


def test_value_absent_is_todays_behaviour_and_value_reaches_inner():
  seen = []

  def update(updates, state, params=None, *, value=None):
    seen.append(value)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(), update
  )
  tx = ols.LossScaleOptimizer(inner, ols.DynamicLossScale(4.0))
  params = {"w": jnp.ones(2)}
  tx.update({"w": jnp.ones(2)}, tx.init(params), params, value=jnp.float32(3))
  assert float(seen[-1]) == 3
  a = jax.make_jaxpr(tx.update)({"w": jnp.ones(2)}, tx.init(params), params)
  plain = ols.LossScaleOptimizer(optax.identity(), ols.DynamicLossScale(4.0))
  b = jax.make_jaxpr(plain.update)(
    {"w": jnp.ones(2)}, plain.init(params), params
  )
  assert str(a).count("cond") == str(b).count("cond") == 1


def test_unscale_gradients_with_a_nonfinite_loss():
  tx = ols.unscale_gradients(ols.DynamicLossScale(8.0))
  _, state = tx.update(
    {"w": jnp.ones(2)}, tx.init(None), value=jnp.float32(jnp.nan)
  )
  assert not bool(state.should_apply) and float(state.loss_scale()) == 8


def test_scaled_value_and_grad_feeds_value():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**4))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  loss_fn = lambda p, x: jnp.sum(p["w"] * x)  # noqa: E731
  loss, grads = ols.scaled_value_and_grad(loss_fn)(
    state, params, jnp.array([1.0, jnp.nan])
  )
  _, state = tx.apply_gradients(grads, state, params, value=loss)
  assert (
    int(state.nonfinite_loss_steps) == 1 and float(state.loss_scale()) == 16
  )


def test_a_0_1_0_state_without_the_new_counters_still_steps():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(4.0))
  params = {"w": jnp.ones(2)}
  old = tx.init(params)._replace(nonfinite_loss_steps=None, retries=None)
  _, state = jax.jit(tx.apply_gradients)(
    {"w": jnp.ones(2)}, old, params, value=jnp.float32(jnp.nan)
  )
  assert state.nonfinite_loss_steps is None and int(state.skipped_steps) == 1
  _, _, state = tx.minimize(
    lambda p: jnp.sum(p["w"]), params, old, max_retries=2
  )
  assert state.retries is None


# --- skip reports -------------------------------------------------------------------


def _reports(tx, step, batches, params):
  """The state's skip report after each step, read on the host."""
  state, reports = tx.init(params), []
  for grads, extra in batches:
    params, state = step(grads, state, params, **extra)
    reports.append(_last_skip(state))
  return reports, state


def test_skip_report_records_skipped_steps_only_naming_the_leaves():
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
  params = {"a": jnp.ones(3), "b": {"c": jnp.ones((2, 2))}}
  good = jax.tree.map(jnp.ones_like, params)
  bad = {"a": jnp.array([1.0, jnp.nan, jnp.inf]), "b": {"c": jnp.ones((2, 2))}}
  one, nan = dict(value=jnp.float32(1)), dict(value=jnp.float32(jnp.nan))
  reports, state = _reports(
    tx,
    jax.jit(tx.apply_gradients),
    [(good, one), (bad, one), (good, nan), (good, one), (bad, {})],
    params,
  )
  first = ols.SkipReport(8.0, 4.0, 1, 1, True, ("['a']",))
  second = ols.SkipReport(4.0, 4.0, 2, 2, False, ())
  assert reports[:4] == [None, first, second, second]
  assert reports[4] == ols.SkipReport(4.0, 2.0, 3, 1, None, ("['a']",))
  assert state.last_skip.names() == ("['a']", "['b']['c']")


def test_no_compiled_step_contains_a_host_callback():
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  loss = lambda p: jnp.sum(p["w"] ** 2)  # noqa: E731
  for jaxpr in [
    jax.make_jaxpr(tx.update)(params, state, params),
    jax.make_jaxpr(tx.apply_gradients)(params, state, params),
    jax.make_jaxpr(lambda p, s: tx.minimize(loss, p, s, max_retries=2))(
      params, state
    ),
  ]:
    text = str(jaxpr)
    assert "callback" not in text and "cond" in text


def test_skip_report_names_every_nonfinite_leaf_of_a_large_mixed_tree():
  # Hundreds of small leaves of two dtypes (checked in stacks) and large
  # ones (checked in place), with non-finite values at random positions.
  rng = np.random.default_rng(0)
  grads = {}
  for i in range(150):
    dtype = np.float16 if i % 3 else np.float32
    grads[f"s{i:03d}"] = rng.normal(size=int(rng.integers(1, 300))).astype(
      dtype
    )
  grads["big16"] = rng.normal(size=(40, 1000)).astype(np.float16)
  grads["big32"] = rng.normal(size=20_000).astype(np.float32)
  for name in rng.choice(sorted(grads), size=40, replace=False):
    flat = grads[name].reshape(-1)
    hits = rng.choice(flat.size, size=int(rng.integers(1, 4)), replace=False)
    flat[hits] = rng.choice([np.nan, np.inf, -np.inf], size=hits.size)
  expected = tuple(
    f"['{k}']" for k, v in sorted(grads.items()) if not np.isfinite(v).all()
  )
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(1.0))
  params = jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), grads)
  _, state = jax.jit(tx.update)(
    jax.tree.map(jnp.asarray, grads), tx.init(params), params
  )
  assert _last_skip(state).nonfinite == expected


def test_skip_report_names_unscaled_leaves_of_every_dtype_and_size():
  # A scale below 1: a finite float16 40000 overflows once unscaled, and is
  # named; zero-size, bfloat16 and complex leaves are checked too.
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(0.5, min_loss_scale=0.25)
  )
  grads = {
    "half": jnp.array([40000.0, 1.0, 1.0], jnp.float16),
    "brain": jnp.array([1.0, jnp.inf], jnp.bfloat16),
    "complex": jnp.array([1 + 1j, complex(jnp.nan, 0)], jnp.complex64),
    "empty": jnp.zeros((0, 3), jnp.float32),
    "fine": jnp.ones(5, jnp.float32),
  }
  params = jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), grads)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert _last_skip(state).nonfinite == ("['brain']", "['complex']", "['half']")


def test_skip_record_names_no_float0_gradient():
  tx = ols.LossScaleOptimizer(optax.identity(), ols.DynamicLossScale(4.0))
  params = {"n": jnp.arange(3), "w": jnp.ones(2)}

  def loss(p):
    return jnp.sum(p["w"] * p["n"][:2].astype(jnp.float32)) * jnp.inf

  state = tx.init(params)
  grads = jax.grad(loss, allow_int=True)(params)
  _, state = jax.jit(tx.update)(grads, state, params)
  assert _last_skip(state).nonfinite == ("['w']",)


def _temp_bytes_with_and_without_record(params):
  """Temporary memory of the donated fused step, with and without a record."""
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale())
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients, donate_argnums=(1, 2))
  return [
    step.lower(params, s, params).compile().memory_analysis().temp_size_in_bytes
    for s in (state, state._replace(last_skip=None))
  ]


def test_skip_records_need_little_memory_beyond_a_step_without_them():
  # The record's buffers count in the step's temporary memory, also on
  # applied steps: they are about the size of the small leaves, never
  # (leaves x elements).
  params = {f"p{i:03d}": jnp.zeros(1000) for i in range(200)}
  with_record, without = _temp_bytes_with_and_without_record(params)
  small_bytes = 200 * 1000 * 4
  assert with_record <= without + 2 * small_bytes


def test_an_applied_step_transfers_nothing():
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(8.0))
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients)
  grads, value = {"w": jnp.ones(4)}, jnp.float32(1)
  step(grads, state, params, value=value)  # compile outside the guard
  with jax.transfer_guard("disallow"):
    for _ in range(3):
      params, state = step(grads, state, params, value=value)
    jax.block_until_ready(params)
  assert int(state.skipped_steps) == 0


def test_skip_monitor_logs_each_skip_once_as_a_warning(caplog):
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.FixedLossScale(2))
  params = {"w": jnp.ones(2)}
  step = jax.jit(tx.update)
  monitor = ols.SkipMonitor()
  state = tx.init(params)
  with caplog.at_level("WARNING", logger="optax_lossscale"):
    assert monitor(state) is None
    _, state = step({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    assert monitor(state).nonfinite == ("['w']",)
    assert monitor(state) is None  # nothing new: not logged again
    for _ in range(2):
      _, state = step({"w": jnp.array([jnp.nan, jnp.inf])}, state, params)
    assert monitor(state).skipped_steps == 3  # the last of the two
  lines = [r for r in caplog.records if r.name == "optax_lossscale"]
  assert len(lines) == 2
  assert lines[0].getMessage().startswith("skipped step (1 in a row, 1 in all)")
  assert not any("member" in line.getMessage() for line in lines)
  assert "non-finite gradients: ['w']" in lines[0].getMessage()
  assert "skipped step (3 in a row, 3 in all)" in lines[1].getMessage()


def test_skip_monitor_with_log_none_logs_nothing(caplog):
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.FixedLossScale(2))
  params = {"w": jnp.ones(2)}
  _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, tx.init(params))
  with caplog.at_level("WARNING", logger="optax_lossscale"):
    assert ols.SkipMonitor(log=None)(state).skipped_steps == 1
  assert caplog.text == ""


def test_skip_monitor_validates_its_arguments():
  with pytest.raises(ValueError, match="max_consecutive_skips"):
    ols.SkipMonitor(max_consecutive_skips=0)
  with pytest.raises(TypeError, match="max_consecutive_skips"):
    ols.SkipMonitor(max_consecutive_skips=2.0)
  with pytest.raises(TypeError, match="log"):
    ols.SkipMonitor(log="print")
  with pytest.raises(ValueError, match="LossScaleOptimizerState"):
    ols.SkipMonitor()(ols.unscale_gradients(ols.FixedLossScale(2)).init(None))


# --- the stop rule ---------------------------------------------------------------------


def _stop_run(donate, steps):
  tx = ols.LossScaleOptimizer(
    optax.adam(0.1), ols.DynamicLossScale(4.0, min_loss_scale=1.0)
  )
  params = {"w": jnp.ones(3), "v": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients, donate_argnums=(1, 2) if donate else ())
  bad = {"w": jnp.array([jnp.inf, 1.0, 1.0]), "v": jnp.ones(2)}
  for _ in range(steps):
    params, state = step(bad, state, params, value=jnp.float32(2))
  return params, state


@pytest.mark.parametrize("donate", [False, True])
def test_skip_monitor_raises_when_the_limit_is_reached(donate):
  monitor = ols.SkipMonitor(max_consecutive_skips=3, log=None)
  params, state = _stop_run(donate, 2)
  assert monitor(state).consecutive_skipped_steps == 2
  params, state = _stop_run(donate, 3)
  kept = jax.device_get((params, state))
  with pytest.raises(ols.ConsecutiveSkipsError) as error:
    monitor(state)
  assert isinstance(error.value, RuntimeError)
  message = str(error.value)
  assert "3 consecutive steps skipped (max_consecutive_skips=3)" in message
  assert (
    "The last skipped step ran at loss scale 1, at its floor (min_loss_scale),"
    " so it could not go lower; the loss scale is now 1." in message
  )
  assert "The loss was finite" in message
  assert "non-finite gradients: ['w']" in message
  assert "lower min_loss_scale" in message and "float32" in message
  # The monitor only reads: the state it was given is intact, and it raises
  # again as long as the streak lasts.
  for x, k in zip(
    jax.tree.leaves(state), jax.tree.leaves(kept[1]), strict=True
  ):
    np.testing.assert_array_equal(x, k)
  with pytest.raises(ols.ConsecutiveSkipsError):
    monitor(state)


def test_stop_rule_gives_the_skipped_steps_scale_and_the_scale_now():
  # Three overflows from 2**15: the last skipped step ran at 8192 and left
  # the scale at 4096; the message says both.
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**15))
  params = {"w": jnp.ones(2)}
  step = jax.jit(tx.apply_gradients)
  state = tx.init(params)
  for _ in range(3):
    _, state = step({"w": jnp.array([jnp.inf, 1.0])}, state, params)
  with pytest.raises(ols.ConsecutiveSkipsError) as error:
    ols.SkipMonitor(max_consecutive_skips=3, log=None)(state)
  assert (
    "LossScaleOptimizer: 3 consecutive steps skipped (max_consecutive_skips=3)"
    "; training has stopped making progress. The last skipped step ran at"
    " loss scale 8192, above its floor (min_loss_scale); the loss scale is"
    " now 4096." in str(error.value)
  )


def test_unbatched_reports_name_no_member():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(4.0))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  assert ols.skip_reports(state) == []
  _, state = jax.jit(tx.apply_gradients)(
    {"w": jnp.array([jnp.nan, 1.0])}, state, params
  )
  report = _last_skip(state)
  assert report == ols.SkipReport(4.0, 2.0, 1, 1, None, ("['w']",), None)
  assert ols.skip_reports(state) == [report]
  assert ols.SkipMonitor(log=None)(state) == report
  assert "member" not in str(report)


def test_skip_monitor_says_when_the_loss_itself_was_not_finite():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(4.0))
  params = {"w": jnp.ones(2)}
  _, state = jax.jit(tx.apply_gradients)(
    {"w": jnp.ones(2)}, tx.init(params), params, value=jnp.float32(jnp.nan)
  )
  with pytest.raises(ols.ConsecutiveSkipsError, match="NOT finite"):
    ols.SkipMonitor(max_consecutive_skips=1)(state)


def test_skip_record_names_a_bare_array_and_a_state_without_params():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = jnp.zeros(3)
  _, state = tx.update(jnp.array([1.0, jnp.nan, 1.0]), tx.init(params), params)
  assert _last_skip(state).nonfinite == ("<root>",)
  assert ols.SkipMonitor(log=None)(state).nonfinite == ("<root>",)
  tx = ols.LossScaleOptimizer(optax.identity(), ols.DynamicLossScale())
  _, state = tx.update({"w": jnp.array([jnp.nan])}, tx.init(None))
  assert _last_skip(state).nonfinite == ()  # no leaf to name


def test_all_float0_gradients_step():
  tx = ols.LossScaleOptimizer(optax.identity(), ols.DynamicLossScale(4.0))
  params = {"n": jnp.arange(3)}
  grads = jax.grad(lambda p: jnp.float32(1.0), allow_int=True)(params)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert bool(state.should_apply)


def test_skip_monitor_logs_again_after_a_restore_to_fewer_skips():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.FixedLossScale(2))
  params = {"w": jnp.ones(2)}
  bad = {"w": jnp.array([jnp.nan, 1.0])}
  monitor = ols.SkipMonitor(log=None)
  early = tx.update(bad, tx.init(params), params)[1]
  late = tx.update(bad, tx.update(bad, early, params)[1], params)[1]
  assert monitor(late).skipped_steps == 3
  restored = early  # an earlier checkpoint: its count is lower
  after = tx.update(bad, restored, params)[1]
  assert monitor(after).skipped_steps == 2  # news, though 2 < 3
  assert monitor(after) is None  # and only once


def test_skip_monitor_stops_a_state_without_a_record():
  # A 0.1.0 state stepped without a record: the counters still stop it.
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)._replace(last_skip=None)
  for _ in range(3):
    _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
  assert state.last_skip is None
  with pytest.raises(ols.ConsecutiveSkipsError, match="3 consecutive") as error:
    ols.SkipMonitor(max_consecutive_skips=2, log=None)(state)
  assert "no record of the skipped steps; the loss scale is now 1." in str(
    error.value
  )


def test_skip_monitor_reads_counters_that_a_fresh_record_does_not_match():
  # A 0.1.0 checkpoint restored into `tx.init(params)`: the record is a
  # fresh one, of no skip; the counters still log and stop.
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)._replace(
    skipped_steps=jnp.int32(5), consecutive_skipped_steps=jnp.int32(3)
  )
  assert _last_skip(state) is None
  reports = []
  with pytest.raises(ols.ConsecutiveSkipsError, match="no record"):
    ols.SkipMonitor(max_consecutive_skips=3, log=reports.append)(state)
  assert reports == [ols.SkipReport(8.0, 8.0, 5, 3, None, ())]


def test_skip_records_of_large_leaves_need_no_buffer_of_their_size():
  # The record's flags are the check's own: the skip branch needs no
  # temporary buffer of the gradients' size.
  params = {f"p{i}": jnp.zeros(300_000) for i in range(4)}
  with_record, without = _temp_bytes_with_and_without_record(params)
  assert with_record <= without + 2**20
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale())
  state = tx.init(params)
  grads = {k: v.at[12_345 * int(k[1])].set(jnp.nan) for k, v in params.items()}
  grads["p3"] = grads["p3"].at[-1].set(jnp.inf)  # in the tail
  _, state = jax.jit(tx.apply_gradients)(grads, state, params)
  assert _last_skip(state).nonfinite == ("['p0']", "['p1']", "['p2']", "['p3']")


def test_the_stop_rule_s_advice_for_a_nonfinite_loss_is_not_the_scale():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients)
  for _ in range(2):  # a failed forward pass: NaN loss and gradients
    params, state = step(
      {"w": jnp.full(2, jnp.nan)}, state, params, value=jnp.float32(jnp.nan)
    )
  with pytest.raises(ols.ConsecutiveSkipsError) as error:
    ols.SkipMonitor(max_consecutive_skips=2, log=None)(state)
  message = str(error.value)
  assert "non-finite loss, which no loss scale fixes" in message
  assert "lower min_loss_scale" not in message
  assert error.value.report == ols.SkipReport(8.0, 8.0, 2, 2, False, ("['w']",))


def test_the_stop_rule_s_advice_above_the_floor_is_not_to_lower_it():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**20))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients)
  for _ in range(3):  # overflows while the scale is still falling
    params, state = step({"w": jnp.array([jnp.inf, 1.0])}, state, params)
  with pytest.raises(ols.ConsecutiveSkipsError) as error:
    ols.SkipMonitor(max_consecutive_skips=3, log=None)(state)
  message = str(error.value)
  assert "above its floor" in message and "still falling" in message
  assert "lower min_loss_scale" not in message
  assert "initial_loss_scale" in message
  report = error.value.report
  assert (report.loss_scale, report.next_loss_scale) == (2.0**18, 2.0**17)
  assert report.nonfinite == ("['w']",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class _OwnVerdict(ols.DynamicLossScale):
  """A loss scale whose `grads_finite` is its own: it sees only one leaf."""

  def grads_finite(self, scaled_grads, *, axis_name=None):
    return ols.all_finite(scaled_grads["w"], axis_name=axis_name)


def test_a_loss_scale_s_own_grads_finite_decides_and_the_record_names_leaves():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), _OwnVerdict(8.0))
  params = {"b": jnp.ones(3), "n": jnp.arange(2), "w": jnp.ones((40, 50))}
  state = tx.init(params)
  grads = {"b": jnp.array([1.0, jnp.nan, 1.0]), "n": jnp.zeros(2, jnp.int32)}
  # Its verdict ignores `b`: the step applies, and nothing is recorded.
  ok = {**grads, "w": jnp.ones((40, 50))}
  new_params, new_state = jax.jit(tx.apply_gradients)(ok, state, params)
  assert bool(new_state.should_apply) and _last_skip(new_state) is None
  # A NaN it sees skips; the record names every non-finite leaf.
  bad = {**grads, "w": jnp.ones((40, 50)).at[3, 4].set(jnp.inf)}
  step = jax.jit(jax.vmap(tx.apply_gradients, in_axes=(0, None, None)))
  stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), ok, bad)
  _, states = step(stacked, state, params)
  assert np.asarray(states.should_apply).tolist() == [True, False]
  reports = ols.skip_reports(states)
  assert [(r.member, r.nonfinite) for r in reports] == [(1, ("['b']", "['w']"))]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class _AlwaysFinite(ols.FixedLossScale):
  """A loss scale whose `grads_finite` returns a Python bool."""

  verdict: object = dataclasses.field(default=True, metadata=dict(static=True))

  def grads_finite(self, scaled_grads, *, axis_name=None):
    return self.verdict


def test_a_loss_scale_s_own_grads_finite_may_return_a_python_bool():
  params = {"w": jnp.ones(2)}
  grads = {"w": jnp.array([jnp.nan, 1.0])}
  for verdict, applies in [(True, True), (np.bool_(False), False)]:
    tx = ols.LossScaleOptimizer(optax.sgd(0.1), _AlwaysFinite(2.0, verdict))
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert bool(state.should_apply) is applies
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), _AlwaysFinite(2.0, (True, True)))
  with pytest.raises(ValueError, match=r"grads_finite\(scaled_grads\)` must"):
    tx.update(grads, tx.init(params), params)
