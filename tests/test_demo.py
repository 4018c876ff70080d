"""The demo runs end to end, writes its plot, and names missing extras."""

from __future__ import annotations

import builtins
import importlib
import pathlib
import re

import pytest

from optax_lossscale import demo

pytestmark = pytest.mark.usefixtures("standard_promotion")


@pytest.mark.slow  # `.ci/run` runs the full demo too, beside this
def test_demo_runs_and_writes_a_png(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  results = demo.main(["--quick", "--seed", "1"])
  # Beside a full run's plot (lossscale_demo.png), not over it.
  out = tmp_path / "lossscale_demo_quick.png"
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  command, machine, date, blank, *table = (
    out.with_suffix(".txt").read_text().splitlines()
  )
  assert command == "python -m optax_lossscale.demo --quick --seed 1"
  assert "cores" in machine and re.fullmatch(r"\d{4}-\d\d-\d\d", date)
  assert blank == "" and table[0].startswith("run") and len(table) == 6
  assert [r["name"] for r in results] == [name for name, _, _ in demo.RUNS]
  for r in results:
    assert len(r["history"]["loss"]) == demo.QUICK_STEPS == 15
    assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["underflow"] <= 1.0
  assert results[0]["underflow"] == 0.0  # float32 loses nothing
  # The setting's point: unscaled float16 loses gradient entries from the
  # first step, and both loss scales keep them all.
  assert results[1]["first_underflow"] > 0.01
  assert results[2]["first_underflow"] == results[3]["first_underflow"] == 0.0
  printed = capsys.readouterr().out
  assert "Setting:" in printed and "loss scale" in printed
  assert "--quick: a smoke run" in printed  # its numbers show nothing
  assert f"a batch of {demo.QUICK_BATCH_SIZE}," in printed
  _check_failure_modes(printed)
  _check_dropped_batches(printed)


def _check_failure_modes(printed):
  # Two runs (hysteresis 1 and 2), each with NaN inputs at step 4 and an
  # overflowing batch at step 9 of steps 0 to 14, numbered as the skip
  # reports number them; a SkipMonitor logs each skip.
  assert printed.count("log: skipped step 4 ") == 2
  assert printed.count("log: skipped step") == 4
  assert printed.count("loss NON-FINITE") == 2
  nan_steps = re.findall(
    r"step 4 \(NaN inputs, loss nan\): loss scale (\S+) -> (\S+) \((\w+)",
    printed,
  )
  assert len(nan_steps) == 2
  for before, after, verdict in nan_steps:  # a NaN loss leaves the scale
    assert before == after and verdict == "unchanged"
  overflow = re.findall(
    r"step 9 \(overflowing batch, loss (\S+)\): loss scale (\S+) -> (\S+)",
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
  assert "first 15 steps" in printed
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
  root = pathlib.Path(__file__).resolve().parent.parent
  written = (root / "docs" / "lossscale_demo.txt").read_text().splitlines()
  assert written[0] == (
    "python -m optax_lossscale.demo --out docs/lossscale_demo.png"
  )
  readme = (root / "README.md").read_text()
  shown = readme.split("<!-- demo-table -->\n```text\n")[1].split("```")[0]
  assert shown.splitlines() == written  # command, machine, date, table
