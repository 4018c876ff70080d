"""benchmarks/bad_batches.py, short: on real text, the spike rule skips each
injected bad batch for its reason, and with the rule off they are applied.

The quick mode's runs (b) and (c), without the held-out evaluation or the
timing, compiled with less LLVM optimisation (the HLO is the same). The full
run (`python benchmarks/bad_batches.py`, benchmarks/BAD_BATCHES.md) adds the
clean run, the held-out losses and the step time; this test asserts what
the rule does, never a loss or a time.
"""

from __future__ import annotations

import importlib
import pathlib

import pytest

pytestmark = pytest.mark.usefixtures("standard_promotion")

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture
def bad_batches(monkeypatch):
  monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports _timing
  return importlib.import_module("bad_batches")


@pytest.mark.slow  # a quick run of a benchmark script: `.ci/run` runs it
def test_each_bad_batch_is_skipped_for_its_reason_and_applied_without_the_rule(
  bad_batches,
):
  bb = bad_batches
  setup = bb.QUICK
  result = bb.run_all(
    setup,
    keys=(bb.BAD, bb.OFF),
    evaluate=False,
    timing=False,
    options=FAST_COMPILE,
    log=lambda *_: None,
  )
  bad, off = result["runs"][bb.BAD], result["runs"][bb.OFF]
  assert result["checks"] and all(ok for _, ok in result["checks"])
  injected = setup.injected
  assert list(injected.values()) == list(bb.INJECTED)
  assert min(injected) >= setup.spike_window // 2  # judged
  # Rule on: each injected batch skipped as a spike, and nothing else.
  assert sorted(bad.reports) == sorted(injected)
  for step, kind in injected.items():
    report = bad.reports[step]
    assert not bb.applied(bad, step)
    assert report.reason == "spike", report
    spiked = {name for name, *_ in report.spike}
    if kind == bb.GRADS:  # finite in float16, its loss unchanged
      assert spiked == {"grad_norm"}, report
      assert bb.retried(bad, step) == 0
    elif kind == bb.OVERFLOW:  # recomputed until it fit, then judged
      assert spiked == {"grad_norm", "loss"}, report
      assert bb.retried(bad, step) > 0
    else:  # random bytes: the loss jumps
      assert "loss" in spiked, report
      assert bb.retried(bad, step) == 0
    assert report.largest  # the leaves with the largest gradients named
  # Rule off: every injected batch applied, the overflowed one after its
  # retries; nothing skipped.
  assert not off.reports and int(off.state.skipped_steps) == 0
  for step in injected:
    assert bb.applied(off, step)
  overflow = next(s for s, k in injected.items() if k == bb.OVERFLOW)
  assert bb.retried(off, overflow) > 0
  # Either way the scale moved as for one overflowed step.
  for run in (bad, off):
    assert float(run.state.loss_scale()) == setup.initial_scale / 2
