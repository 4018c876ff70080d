"""The demo runs end to end, writes its plot, and names missing extras."""

from __future__ import annotations

import builtins
import importlib

import pytest

from optax_lossscale import demo

pytestmark = pytest.mark.usefixtures("standard_promotion")


def test_demo_runs_and_writes_a_png(tmp_path, capsys, monkeypatch):
  # Chunks of 10 steps: 15 steps take a full chunk and a partial one.
  monkeypatch.setattr(demo, "CHUNK", 10)
  out = tmp_path / "demo.png"
  results = demo.main(
    ["--steps", "15", "--batch-size", "32", "--seed", "1", "--out", str(out)]
  )
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert [r["name"] for r in results] == [name for name, _, _ in demo.RUNS]
  for r in results:
    assert len(r["history"]["loss"]) == 15
    assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["underflow"] <= 1.0
  assert results[0]["underflow"] == 0.0  # float32 loses nothing
  # The setting's point: unscaled float16 loses gradient entries from the
  # first step, and both loss scales keep them all.
  assert results[1]["first_underflow"] > 0.01
  assert results[2]["first_underflow"] == results[3]["first_underflow"] == 0.0
  printed = capsys.readouterr().out
  assert "Setting:" in printed and "loss scale" in printed


def test_demo_help_lists_the_flags(capsys):
  with pytest.raises(SystemExit) as exit_info:
    demo.main(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  for flag in ["--steps", "--seed", "--batch-size", "--out"]:
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
