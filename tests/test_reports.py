"""Skip reports, `SkipMonitor` and the stop rule, read on the host."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

pytestmark = pytest.mark.usefixtures("standard_promotion")

NAN, INF = float("nan"), float("inf")
# One optimizer, its step compiled once with and once without `value=`; the
# tests set the scale they need in the state.
TX = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0))
STEP = jax.jit(TX.apply_gradients)
PARAMS = {"w": jnp.ones(3), "v": jnp.ones(2)}
GOOD = {"w": jnp.ones(3), "v": jnp.ones(2)}
BAD_W = {"w": jnp.array([1.0, NAN, INF]), "v": jnp.ones(2)}


def _at(scale, state=None):
  """A fresh state (or `state`) with its loss scale set to `scale`."""
  state = TX.init(PARAMS) if state is None else state
  ls = dataclasses.replace(
    state.loss_scale, current_loss_scale=jnp.float32(scale)
  )
  return state._replace(loss_scale=ls)


def _run(state, steps):
  """`steps` are (grads, loss or None); returns the last state."""
  for grads, loss in steps:
    extra = {} if loss is None else {"value": jnp.float32(loss)}
    _, state = STEP(grads, state, PARAMS, **extra)
  return state


def _only(state):
  """The one report of an unbatched state, or None."""
  reports = ols.skip_reports(state)
  assert len(reports) <= 1 and all(r.member is None for r in reports)
  return reports[0] if reports else None


# --- skip_reports and SkipReport --------------------------------------------------


def test_skip_reports_record_skipped_steps_only_and_name_the_leaves():
  state = TX.init(PARAMS)
  assert ols.skip_reports(state) == []
  reports = []
  for step in [(GOOD, 1), (BAD_W, 1), (GOOD, NAN), (GOOD, 1), (BAD_W, None)]:
    state = _run(state, [step])
    reports.append(_only(state))
  # Numbered as a Python loop numbers them: the steps before each.
  new = {"optimizer_step": 1, "skipped_optimizer_steps": 1}
  first = ols.SkipReport(1, 8.0, 4.0, 1, 1, True, ("['w']",), **new)
  second = ols.SkipReport(  # the loss: kept
    2,
    4.0,
    4.0,
    2,
    2,
    False,
    (),
    reason="non-finite loss",
    optimizer_step=2,
    skipped_optimizer_steps=2,
  )
  assert reports == [
    None,
    first,
    second,
    second,
    ols.SkipReport(
      4,
      4.0,
      2.0,
      3,
      1,
      None,
      ("['w']",),
      optimizer_step=4,
      skipped_optimizer_steps=3,
    ),
  ]
  assert state.last_skip.names() == ("['v']", "['w']")


def test_a_skip_report_prints_as_one_line():
  report = ols.SkipReport(41, 1024.0, 512.0, 3, 2, False, ("['a']", "['b']"))
  assert str(report) == (
    "skipped step 41 (2 in a row, 3 in all): loss scale 1024 -> 512; loss"
    " NON-FINITE; non-finite gradients: ['a'], ['b']"
  )
  member = report._replace(member=5, loss_finite=None, nonfinite=())
  assert str(member) == (
    "member 5: skipped step 41 (2 in a row, 3 in all): loss scale 1024 ->"
    " 512; no loss given; non-finite gradients: none"
  )
  names = tuple(f"['blocks'][{i}]['fc1']" for i in range(38))
  assert str(report._replace(nonfinite=names)).endswith(
    "non-finite gradients: 38 leaves: ['blocks'][0]['fc1'],"
    " ['blocks'][1]['fc1'], ['blocks'][2]['fc1'], ... and 35 more"
  )
  assert str(report._replace(nonfinite=names[:4])).endswith(
    "['blocks'][2]['fc1'], ['blocks'][3]['fc1']"  # four: all named
  )


def test_skip_reports_name_leaves_of_every_dtype_once_unscaled():
  # A scale below 1: a finite float16 40000 overflows once unscaled, and is
  # named; zero-size, bfloat16 and complex leaves are checked too.
  tx = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(0.5, min_loss_scale=0.25)
  )
  grads = {
    "half": jnp.array([40000.0, 1.0, 1.0], jnp.float16),
    "brain": jnp.array([1.0, INF], jnp.bfloat16),
    "complex": jnp.array([1 + 1j, complex(NAN, 0)], jnp.complex64),
    "empty": jnp.zeros((0, 3), jnp.float32),
    "fine": jnp.ones(5, jnp.float32),
  }
  params = jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), grads)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert _only(state).nonfinite == ("['brain']", "['complex']", "['half']")


def test_skip_reports_name_a_bare_array_and_nothing_without_params():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = jnp.zeros(3)
  _, state = tx.update(jnp.array([1.0, NAN, 1.0]), tx.init(params), params)
  assert _only(state).nonfinite == ("<root>",)
  tx = ols.LossScaleOptimizer(optax.identity(), ols.DynamicLossScale())
  _, state = tx.update({"w": jnp.array([NAN])}, tx.init(None))
  assert _only(state).nonfinite == ()  # no leaf to name


def test_skip_reports_need_exactly_one_optimizer_state():
  state = TX.init(PARAMS)
  assert ols.skip_reports(optax.chain(TX, optax.identity()).init(PARAMS)) == []
  for call in [ols.skip_reports, ols.SkipMonitor()]:
    name = "skip_reports" if call is ols.skip_reports else "SkipMonitor"
    with pytest.raises(ValueError, match=rf"`{name}\(opt_state\)`.*found 0"):
      call(optax.sgd(0.1).init(PARAMS))
    with pytest.raises(ValueError, match=rf"`{name}\(opt_state\)`.*found 2"):
      call((state, state))


# --- SkipMonitor ------------------------------------------------------------------


def test_skip_monitor_logs_each_new_skip_once_as_a_warning(caplog):
  monitor = ols.SkipMonitor()
  state = TX.init(PARAMS)
  with caplog.at_level("WARNING", logger="optax_lossscale"):
    assert monitor(state) is None
    state = _run(state, [(BAD_W, None)])
    assert monitor(state).nonfinite == ("['w']",)
    assert monitor(state) is None  # nothing new: not logged again
    state = _run(state, [(BAD_W, None), (BAD_W, None)])
    assert monitor(state).skipped_steps == 3  # the last of the two
  lines = [
    r.getMessage() for r in caplog.records if r.name == "optax_lossscale"
  ]
  assert lines == [
    "skipped step 0 (1 in a row, 1 in all): loss scale 8 -> 4; no loss"
    " given; non-finite gradients: ['w']",
    "skipped step 2 (3 in a row, 3 in all): loss scale 2 -> 1; no loss"
    " given; non-finite gradients: ['w']",
  ]
  assert all(r.levelname == "WARNING" for r in caplog.records)


def test_skip_monitor_with_log_none_logs_nothing_and_a_callable_gets_reports(
  caplog,
):
  state = _run(TX.init(PARAMS), [(BAD_W, None)])
  with caplog.at_level("WARNING", logger="optax_lossscale"):
    assert ols.SkipMonitor(log=None)(state).skipped_steps == 1
  assert caplog.text == ""
  logged = []
  assert ols.SkipMonitor(log=logged.append)(state) == logged[0] == _only(state)


def test_skip_monitor_names_a_bad_argument():
  with pytest.raises(
    ValueError, match=r"SkipMonitor\(max_consecutive_skips=...\)"
  ):
    ols.SkipMonitor(max_consecutive_skips=0)
  with pytest.raises(
    TypeError, match=r"SkipMonitor\(max_consecutive_skips=...\)"
  ):
    ols.SkipMonitor(max_consecutive_skips=2.0)
  with pytest.raises(
    TypeError,
    match=r"SkipMonitor\(log=...\)` must be a callable or None, got str",
  ):
    ols.SkipMonitor(log="print")


def test_skip_monitor_logs_again_after_a_restore_to_fewer_skips():
  monitor = ols.SkipMonitor(log=None)
  early = _run(TX.init(PARAMS), [(BAD_W, None)])
  late = _run(early, [(BAD_W, None), (BAD_W, None)])
  assert monitor(late).skipped_steps == 3
  after = _run(early, [(BAD_W, None)])  # an earlier checkpoint, stepped on
  assert monitor(after).skipped_steps == 2  # news, though 2 < 3
  assert monitor(after) is None  # and only once


# --- the stop rule -----------------------------------------------------------------


@pytest.mark.parametrize("donate", [False, True])
def test_the_stop_rule_raises_at_the_limit_and_only_reads_the_state(donate):
  step = jax.jit(TX.apply_gradients, donate_argnums=(1, 2)) if donate else STEP
  monitor = ols.SkipMonitor(max_consecutive_skips=3, log=None)
  state, params = _at(4.0), PARAMS
  for i in range(3):
    params, state = step(
      BAD_W, state, jax.tree.map(jnp.copy, params), value=jnp.float32(2)
    )
    if i == 1:
      assert monitor(state).consecutive_skipped_steps == 2
  kept = jax.device_get(state)
  with pytest.raises(ols.ConsecutiveSkipsError) as error:
    monitor(state)
  assert isinstance(error.value, RuntimeError)
  assert type(error.value).__module__ == "optax_lossscale"
  message = str(error.value)
  assert message.startswith(
    "LossScaleOptimizer: 3 consecutive steps skipped"
    " (max_consecutive_skips=3); training has stopped making progress. The"
    " loss scale is now 1."
  )
  assert (
    "The last skipped step ran at loss scale 1, at its floor (min_loss_scale)."
    " Leaves with non-finite gradients: ['w']." in message
  )
  assert "lower min_loss_scale" in message and "float32" in message
  assert error.value.report == ols.SkipReport(
    2,
    1.0,
    1.0,
    3,
    3,
    True,
    ("['w']",),
    optimizer_step=2,
    skipped_optimizer_steps=3,
  )
  # The monitor only reads: the state is intact, and it raises again as
  # long as the streak lasts.
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), kept)
  with pytest.raises(ols.ConsecutiveSkipsError):
    monitor(state)


def test_the_stop_rule_s_advice_for_a_nonfinite_loss_is_not_the_scale():
  state = _run(
    TX.init(PARAMS), [({"w": jnp.full(3, NAN), "v": jnp.ones(2)}, NAN)] * 2
  )
  with pytest.raises(ols.ConsecutiveSkipsError) as error:
    ols.SkipMonitor(max_consecutive_skips=2, log=None)(state)
  message = str(error.value)
  assert "the loss itself was not finite, which no loss scale fixes" in message
  assert "lower min_loss_scale" not in message
  assert error.value.report == ols.SkipReport(
    1,
    8.0,
    8.0,
    2,
    2,
    False,
    ("['w']",),
    reason="non-finite loss",
    optimizer_step=1,
    skipped_optimizer_steps=2,
  )


def test_the_stop_rule_s_advice_above_the_floor_is_not_to_lower_it():
  state = _run(_at(2.0**20), [(BAD_W, None)] * 3)  # still falling
  with pytest.raises(ols.ConsecutiveSkipsError) as error:
    ols.SkipMonitor(max_consecutive_skips=3, log=None)(state)
  message = str(error.value)
  assert "The loss scale is now 131072." in message
  assert "ran at loss scale 262144, above its floor" in message
  assert (
    "the scale was still falling" in message and "initial_loss_scale" in message
  )
  assert "lower min_loss_scale" not in message
  report = error.value.report
  assert (report.loss_scale, report.next_loss_scale) == (2.0**18, 2.0**17)


def test_the_stop_rule_reads_counters_that_a_fresh_record_does_not_match():
  # A 0.1.0 checkpoint restored into `init`'s state: its counters, and the
  # fresh record of no skip. The counters still stop it; nothing is logged.
  state = TX.init(PARAMS)._replace(
    skipped_steps=jnp.int32(5), consecutive_skipped_steps=jnp.int32(3)
  )
  assert _only(state) is None
  logged = []
  with pytest.raises(
    ols.ConsecutiveSkipsError, match="holds no record"
  ) as error:
    ols.SkipMonitor(max_consecutive_skips=3, log=logged.append)(state)
  assert error.value.report is None and logged == []
  assert "3 consecutive steps skipped" in str(error.value)


# --- ensembles: one report per member -----------------------------------------------

MEMBERS = 4
VPARAMS = {"w": jnp.ones((MEMBERS, 3)), "v": jnp.ones((MEMBERS, 2))}
VSTEP = jax.jit(jax.vmap(TX.apply_gradients))


def _vgrads(*bad):
  """Ensemble gradients with a NaN in `w` of the members `bad`."""
  w = jnp.ones((MEMBERS, 3))
  for m in bad:
    w = w.at[m, 0].set(NAN)
  return {"w": w, "v": jnp.ones((MEMBERS, 2))}


def test_skip_reports_and_the_monitor_read_each_member(caplog):
  state = jax.vmap(TX.init)(VPARAMS)
  _, state = VSTEP(_vgrads(0, 1), state, VPARAMS)  # two members, one step
  with caplog.at_level("WARNING", logger="optax_lossscale"):
    assert ols.SkipMonitor()(state).member == 0
  line = (
    "skipped step 0 (1 in a row, 1 in all): loss scale 8 -> 4; no loss given"
  )
  assert [r.getMessage() for r in caplog.records] == [
    f"member 0: {line}; non-finite gradients: ['w']",
    f"member 1: {line}; non-finite gradients: ['w']",
  ]
  assert [r.member for r in ols.skip_reports(state)] == [0, 1]
  member = ols.skip_reports(jax.tree.map(lambda x: x[1], state))
  assert member == [ols.skip_reports(state)[1]._replace(member=None)]


def test_the_stop_rule_names_the_member_with_the_longest_streak():
  state = jax.vmap(TX.init)(VPARAMS)
  monitor = ols.SkipMonitor(max_consecutive_skips=3, log=None)
  for t in range(3):
    _, state = VSTEP(_vgrads(3) if t else _vgrads(1, 3), state, VPARAMS)
    if t == 1:
      assert monitor(state).member == 3
  with pytest.raises(
    ols.ConsecutiveSkipsError, match=r"LossScaleOptimizer \(member 3\): 3"
  ) as error:
    monitor(state)
  assert error.value.report.member == 3
  assert "The loss scale is now 1." in str(error.value)


def test_members_that_skip_together_then_apart_log_each_skip_once():
  state = jax.vmap(TX.init)(VPARAMS)
  logged = []
  monitor = ols.SkipMonitor(log=logged.append)
  seen = np.zeros(MEMBERS, np.int32)
  for bad in [(0, 1, 2, 3), (0, 1, 2, 3), (1,), (), (2, 3), (3,)]:
    _, state = VSTEP(_vgrads(*bad), state, VPARAMS)
    monitor(state)
    skipped = np.asarray(state.skipped_steps)
    expected = [(m, int(skipped[m])) for m in np.flatnonzero(skipped != seen)]
    assert [(r.member, r.skipped_steps) for r in logged] == expected
    recorded = {r.member: r for r in ols.skip_reports(state)}
    assert all(recorded[r.member] == r for r in logged)
    logged.clear()
    seen = skipped
  assert skipped.tolist() == [2, 3, 3, 4]


def test_a_restored_ensemble_is_logged_again_member_by_member():
  # A member whose count differs from what the monitor saw is news; one
  # whose count matches is not.
  early = VSTEP(_vgrads(0, 1), jax.vmap(TX.init)(VPARAMS), VPARAMS)[1]
  late = VSTEP(_vgrads(0), VSTEP(_vgrads(0), early, VPARAMS)[1], VPARAMS)[1]
  logged = []
  monitor = ols.SkipMonitor(log=logged.append)
  monitor(late)
  assert [(r.member, r.skipped_steps) for r in logged] == [(0, 3), (1, 1)]
  logged.clear()
  after = VSTEP(_vgrads(0), early, VPARAMS)[1]  # restored, stepped on
  assert monitor(after).skipped_steps == 2
  assert [(r.member, r.skipped_steps) for r in logged] == [(0, 2)]
  assert monitor(after) is None


def test_a_state_stacked_over_two_axes_reports_row_major_members():
  # A (2, 3) stack (vmap over vmap, or pmap over vmap): [1, 2] is member 5.
  params = {"w": jnp.ones((2, 3, 4))}
  state = jax.vmap(jax.vmap(TX.init))(params)
  grads = {"w": jnp.ones((2, 3, 4)).at[1, 2, 0].set(INF)}
  step = jax.jit(jax.vmap(jax.vmap(TX.apply_gradients)))
  logged = []
  monitor = ols.SkipMonitor(max_consecutive_skips=2, log=logged.append)
  _, state = step(grads, state, params)
  assert monitor(state).member == 5
  _, state = step(grads, state, params)
  assert [r.member for r in ols.skip_reports(state)] == [5]
  with pytest.raises(ols.ConsecutiveSkipsError, match=r"\(member 5\): 2"):
    monitor(state)
  assert [(r.member, r.skipped_steps) for r in logged] == [(5, 1), (5, 2)]


def _float16_adam():
  """The issue's case: float16 parameters and Adam, whose `eps` is 0 there."""
  tx = ols.LossScaleOptimizer(optax.adam(1e-3), ols.DynamicLossScale(2.0**10))
  params = {"w": jnp.ones(4, jnp.float16), "b": jnp.ones(2, jnp.float16)}
  with pytest.warns(UserWarning, match="float16 parameters"):
    state = tx.init(params)
  return tx, params, state


def _loss(params):
  w, b = (params[k].astype(jnp.float32) for k in ("w", "b"))
  return jnp.sum(w * jnp.arange(4.0)) + jnp.sum(b)  # w[0]'s gradient is 0


def test_the_monitor_names_parameters_that_an_applied_update_made_nonfinite():
  tx, params, state = _float16_adam()
  step = jax.jit(lambda p, s: tx.minimize(_loss, p, s), donate_argnums=(0, 1))
  _, params, state = step(params, state)  # finite gradients; 0 / 0 in w[0]
  assert bool(state.should_apply) and np.isnan(params["w"][0])
  monitor = ols.SkipMonitor(log=None)
  assert monitor(state) is None  # nothing is read on an applied step
  for _ in range(4):  # the loss is NaN: skipped, and the monitor not read
    loss, params, state = step(params, state)
  assert not bool(state.should_apply) and int(state.steps) == 5
  assert int(state.last_nonfinite_write.step) == 0  # the step that wrote it
  with pytest.raises(FloatingPointError) as raised:
    monitor(state)
  message = str(raised.value)
  for part in ["Step 0 ", "before step 0", "['w']", "float16", "`eps`"]:
    assert part in message, (part, message)
  assert "['b']" not in message
  _, params, state = step(params, state)
  with pytest.raises(FloatingPointError):  # every step since has skipped
    monitor(state)
  with pytest.raises(FloatingPointError):
    ols.SkipMonitor(log=None)(state)  # a fresh monitor raises too


def test_a_skipped_step_with_finite_parameters_records_no_write():
  state = _run(TX.init(PARAMS), [(BAD_W, None), (GOOD, NAN)])
  assert int(state.skipped_steps) == 2 and int(state.steps) == 2
  assert int(state.last_nonfinite_write.step) == -1
  assert not np.asarray(state.last_nonfinite_write.nonfinite).any()
  assert ols.SkipMonitor(log=None)(state) is not None  # a skip, no raise


def test_the_monitor_names_the_members_whose_parameters_are_nonfinite():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  params = {"w": jnp.ones((3, 2))}
  state = jax.vmap(tx.init)(params)
  step = jax.jit(jax.vmap(tx.update))
  _, state = step({"w": jnp.ones((3, 2))}, state, params)  # applied: step 0
  nan = {"w": params["w"].at[1:, 0].set(NAN)}  # members 1 and 2
  _, state = step(nan, state, nan)  # skipped by 1 and 2
  assert np.asarray(state.last_nonfinite_write.step).tolist() == [-1, 0, 0]
  with pytest.raises(FloatingPointError, match=r"members \[1, 2\].*\['w'\]"):
    ols.SkipMonitor(log=None)(state)


def test_a_report_names_no_leaf_whose_gradient_is_none():
  tx = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  state = tx.init({"a": jnp.ones(2), "b": jnp.ones(3)})
  grads = {"a": jnp.array([INF, 1.0]), "b": None}
  _, state = jax.jit(tx.update)(grads, state)
  assert _only(state).nonfinite == ("['a']",)
  with pytest.raises(
    ValueError,
    match=r"the gradients \(None included\) have 1 leaves \(.*\), `init` had 2\.$",
  ):
    tx.update({"a": jnp.array([INF, 1.0])}, state)


@pytest.mark.parametrize("reader", ["skip_reports", "SkipMonitor"])
def test_reading_the_state_inside_jit_says_it_runs_on_the_host(reader):
  call = ols.skip_reports if reader == "skip_reports" else ols.SkipMonitor()
  state = TX.init(PARAMS)
  with pytest.raises(TypeError, match=rf"`{reader}\(opt_state\)`.*on the host"):
    jax.jit(call)(state)


def _nan_write_run(monitor, restore=None):
  """A run whose step 1 writes inf (finite gradients, a large learning
  rate), and whose step 2 skips on the NaN it makes."""
  tx = ols.LossScaleOptimizer(optax.sgd(1e3), ols.DynamicLossScale(8.0))
  step = jax.jit(tx.apply_gradients)
  params = {"w": jnp.ones(2)}
  state = tx.init(params) if restore is None else restore[1]
  params = params if restore is None else restore[0]
  checkpoint = (params, state)
  raised = []
  for i in range(int(state.steps), 3):
    grads = {"w": jnp.full(2, -1e36 if i == 1 else 1e-4) * 8.0}
    if i == 2:
      grads = {"w": jnp.full(2, NAN)}
    params, state = step(grads, state, params)
    try:
      monitor(state)
    except FloatingPointError as error:
      raised.append(str(error))
    if i == 0:
      checkpoint = (params, state)
  return raised, checkpoint


def test_the_monitor_raises_again_after_a_rollback_in_the_same_process():
  monitor = ols.SkipMonitor(log=None)
  raised, checkpoint = _nan_write_run(monitor)
  assert len(raised) == 1 and "Step 1 (0-based)" in raised[0]
  # Restarted from the checkpoint taken before step 1, as the error
  # advises: the same write at the same step raises again, also when the
  # monitor is called only once the run skips again.
  raised, _ = _nan_write_run(monitor, restore=checkpoint)
  assert len(raised) == 1 and "Step 1 (0-based)" in raised[0]
  raised, _ = _nan_write_run(lambda s: s.steps < 3 or monitor(s), checkpoint)
  assert len(raised) == 1 and "Step 1 (0-based)" in raised[0]


def test_the_monitor_logs_a_skip_whose_count_returns_after_a_rollback():
  logged = []
  monitor = ols.SkipMonitor(log=logged.append)
  step = jax.jit(TX.apply_gradients)
  state = TX.init(PARAMS)
  bad = {"w": jnp.full(3, NAN), "v": jnp.ones(2)}
  good = {"w": jnp.ones(3), "v": jnp.ones(2)}
  _, checkpoint = step(good, state, PARAMS)
  _, state = step(bad, checkpoint, PARAMS)
  monitor(state)
  monitor(checkpoint)  # restored: the step count went back
  _, state = step(bad, checkpoint, PARAMS)  # the same count, 1, again
  monitor(state)
  assert [r.skipped_steps for r in logged] == [1, 1]


def test_the_monitor_names_a_loss_scaler_inside_multisteps():
  inner = ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale())
  multi = optax.MultiSteps(inner.gradient_transformation(), 2)
  with pytest.raises(ValueError, match="gradient_accumulation_steps=k"):
    ols.SkipMonitor()(multi.init(PARAMS))
