"""The demo runs end to end, writes its plot, and names missing extras."""

from __future__ import annotations

import builtins
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

from optax_lossscale import demo

pytestmark = pytest.mark.usefixtures("standard_promotion")

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow  # `.ci/run` runs it as its demo step
def test_the_readme_demo_runs_and_shows_its_point(tmp_path):
  # The README's second command, as a reader runs it, in a fresh directory,
  # on this checkout, with warnings as errors (as pytest makes them here).
  command = [sys.executable, "-m", "optax_lossscale.demo"]
  warnings = "error,ignore:Some donated buffers were not usable:UserWarning"
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS=warnings)
  run = subprocess.run(
    command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
  )
  assert run.returncode == 0, run.stdout + run.stderr
  out = tmp_path / "lossscale_demo.png"
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  command, machine, date, blank, *table = (
    out.with_suffix(".txt").read_text().splitlines()
  )
  assert command == "python -m optax_lossscale.demo"
  assert "cores" in machine and re.fullmatch(r"\d{4}-\d\d-\d\d", date)
  assert blank == "" and table[0].startswith("run") and len(table) == 6
  printed = run.stdout
  assert "\n".join(table) in printed
  rows = {}
  for line in table[2:]:
    name, numbers = line[:50].strip(), line[50:].split()
    rows[name] = [float(x.rstrip("%")) for x in numbers]
  assert list(rows) == [name for name, _, _ in demo.RUNS]
  (f32, f16, fixed, dynamic) = rows.values()  # loss, acc, underflow@0, ...
  # The setting's point: unscaled float16 loses gradient entries from the
  # first step and falls behind; both loss scales keep them all and train
  # as float32 does.
  assert f32[2] == fixed[2] == dynamic[2] == 0.0 and f16[2] > 1.0
  assert f16[0] > f32[0] + 0.5
  for scaled in (fixed, dynamic):
    assert abs(scaled[0] - f32[0]) < 0.05 and scaled[4] == 0  # none skipped
  assert "Setting:" in printed and "--quick" not in printed
  # The demo injects its faults a third and two thirds of the way through.
  steps = demo.parse_args([]).steps
  _check_failure_modes(
    printed, nan_step=steps // 3 - 1, overflow_step=2 * steps // 3 - 1
  )
  _check_dropped_batches(printed)


def test_quick_is_a_short_run_written_beside_the_full_one():
  quick, full = demo.parse_args(["--quick"]), demo.parse_args([])
  assert (quick.steps, quick.batch_size) == (demo.QUICK_STEPS, 32) == (15, 32)
  assert (full.steps, full.batch_size) == (400, 512)
  assert (quick.out, full.out) == (
    "lossscale_demo_quick.png",
    "lossscale_demo.png",
  )
  assert demo.parse_args(["--quick", "--steps", "3"]).steps == 3
  # Its numbers show nothing, and it says so.
  assert "--quick: a smoke run" in demo.setting(quick)
  assert "--quick" not in demo.setting(full)
  assert f"a batch of {demo.QUICK_BATCH_SIZE}," in demo.setting(quick)


def _check_failure_modes(printed, nan_step, overflow_step):
  # Two runs (hysteresis 1 and 2), each with NaN inputs at one step and an
  # overflowing batch at a later one, numbered as the skip reports number
  # them; a SkipMonitor logs each skip.
  assert printed.count(f"log: skipped step {nan_step} ") == 2
  assert printed.count("log: skipped step") == 4
  assert printed.count("loss NON-FINITE") == 2
  nan_steps = re.findall(
    rf"step {nan_step} \(NaN inputs, loss nan\): loss scale (\S+) -> (\S+)"
    r" \((\w+)",
    printed,
  )
  assert len(nan_steps) == 2
  for before, after, verdict in nan_steps:  # a NaN loss leaves the scale
    assert before == after and verdict == "unchanged"
  overflow = re.findall(
    rf"step {overflow_step} \(overflowing batch, loss (\S+)\): loss scale"
    r" (\S+) -> (\S+)",
    printed,
  )
  assert len(overflow) == 2
  (loss_1, before_1, after_1), (loss_2, before_2, after_2) = overflow
  assert float(loss_1) < float("inf") and float(loss_2) < float("inf")
  assert float(after_1) == float(before_1) / 2  # hysteresis=1 lowers it
  assert after_2 == before_2  # hysteresis=2 spends its budget instead
  skipped = re.findall(r"(\d+) steps skipped, (\d+) of them", printed)
  assert skipped == [("2", "1"), ("2", "1")]


def _check_dropped_batches(printed):
  assert "first 100 steps" in printed
  tf_dropped = re.search(r"apply_gradients: (\d+) dropped", printed)
  retry = re.search(
    r"minimize\(max_retries=16\): (\d+) dropped, (\d+) retries", printed
  )
  assert tf_dropped and retry
  assert int(tf_dropped.group(1)) > 0  # 2**15 overflows the summed loss
  assert int(retry.group(1)) == 0 and int(retry.group(2)) > 0


def test_demo_help_lists_the_flags(capsys):
  with pytest.raises(SystemExit) as exit_info:
    demo.main(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  for flag in ["--steps", "--seed", "--batch-size", "--quick", "--out"]:
    assert flag in text


def test_demo_names_the_extra_when_a_dependency_is_missing(monkeypatch):
  real_import = importlib.import_module

  def no_sklearn(name, *args, **kwargs):
    if name.startswith("sklearn"):
      raise ImportError(name)
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(importlib, "import_module", no_sklearn)
  with pytest.raises(SystemExit) as exit_info:
    demo.main(["--steps", "1"])
  assert "optax_lossscale[demo]" in str(exit_info.value.code)
  assert builtins  # the package itself never imports them at import time


def test_demo_rejects_non_positive_steps():
  with pytest.raises(SystemExit):
    demo.main(["--steps", "0"])


def test_the_readme_shows_the_table_the_demo_wrote():
  # The README's demo table is the one the demo wrote beside the committed
  # plot (`python -m optax_lossscale.demo --out docs/lossscale_demo.png`).
  written = (ROOT / "docs" / "lossscale_demo.txt").read_text().splitlines()
  assert written[0] == (
    "python -m optax_lossscale.demo --out docs/lossscale_demo.png"
  )
  readme = (ROOT / "README.md").read_text()
  shown = readme.split("<!-- demo-table -->\n```text\n")[1].split("```")[0]
  assert shown.splitlines() == written  # command, machine, date, table
