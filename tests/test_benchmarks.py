"""The benchmark scripts' quick modes run and write well-formed tables.

Structure only: the rows and columns each table must have, and ratios that
are finite positive numbers. Never a time: the figures of a quick run mean
nothing.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
HEADER_LINES = ("command", "backend", "device", "host", "versions", "date")
PLAIN_MODEL = "plain adam: value_and_grad + apply_updates"
OURS_MODEL = (
  "LossScaleOptimizer.minimize",
  "scaled_value_and_grad + apply_gradients",
)
STEP_ROWS = (
  "plain adam",
  "loss_scale_optimizer + apply_gradients",
  "chain(unscale_gradients, adam)",
  "loss_scale_optimizer",
)
COND_OR_SELECT = (
  "loss_scale_optimizer + apply_gradients",
  "fused step, per-leaf select (optax.tree.where)",
)


def _run(*command: str) -> None:
  env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
    command,
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _table(text: str, header_start: str) -> tuple[list[str], list[list[str]]]:
  """The markdown table whose header starts with `header_start`."""
  lines = text.splitlines()
  start = next(i for i, x in enumerate(lines) if x.startswith(header_start))
  split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
  header = split(lines[start])
  assert set(lines[start + 1].replace("|", "")) == {"-"}
  rows = []
  for line in lines[start + 2 :]:
    if not line.startswith("|"):
      break
    rows.append(split(line))
    assert len(rows[-1]) == len(header), line
  return header, rows


def _ratio(cell: str) -> float:
  match = re.fullmatch(r"(\d+\.\d\d)x", cell)
  assert match, cell
  value = float(match.group(1))
  assert math.isfinite(value) and value > 0, cell
  return value


def _environment(text: str) -> None:
  for key in HEADER_LINES:
    assert re.search(rf"^- {key}: \S", text, re.M), key


def test_accelerator_script_quick_mode_writes_one_table(tmp_path):
  out = tmp_path / "accelerator.md"
  # The sweep has a quick mode of its own; here it would only add minutes.
  script = str(BENCHMARKS / "accelerator.sh")
  _run("bash", script, str(out), "--quick", "--no-sweep")
  text = out.read_text()
  _environment(text)
  assert "- backend: cpu" in text
  sweep = text.split("## Finiteness-check sweep")[1].split("## Steps")[0]
  assert "Not run (`--no-sweep`)." in sweep
  header, rows = _table(text, "| part |")
  assert header == [
    "part",
    "workload",
    "configuration",
    "vs",
    "step",
    "first compile",
    "temporary memory",
    "step (ms)",
  ]
  by_part: dict[str, list[list[str]]] = {}
  for row in rows:
    by_part.setdefault(row[0], []).append(row)
  assert list(by_part) == ["step_overhead", "cond or select", "model step"]
  for part, names in [
    ("step_overhead", STEP_ROWS),
    ("cond or select", COND_OR_SELECT),
  ]:
    workloads = {row[1] for row in by_part[part]}
    assert len(workloads) == 3, workloads
    for workload in workloads:
      got = [row[2] for row in by_part[part] if row[1] == workload]
      assert got == list(names), (part, workload, got)
  assert [row[2] for row in by_part["model step"]] == [
    PLAIN_MODEL,
    *OURS_MODEL,
  ]
  for row in rows:
    base = row[2] == row[3]
    for cell in row[4:6]:
      assert _ratio(cell) == 1.0 or not base, row
    temp = re.fullmatch(r"(\d+\.\d\dx|-) \((\d+\.\d) MiB\)", row[6])
    assert temp, row
    if temp.group(1) != "-":
      _ratio(temp.group(1))
    assert float(row[7]) > 0, row


def test_model_step_quick_mode_checks_the_bounds(tmp_path):
  out = tmp_path / "model_step.md"
  _run(
    sys.executable,
    str(BENCHMARKS / "model_step.py"),
    "--quick",
    "--out",
    str(out),
  )
  text = out.read_text()
  _environment(text)
  assert "149 leaves" not in text  # the quick model is smaller
  header, rows = _table(text, "| configuration |")
  assert header == [
    "configuration",
    "step",
    "first compile",
    "temporary memory",
    "within 1.05x / 1.10x / 1.05x",
    "steps skipped while timed",
  ]
  assert [row[0] for row in rows] == [PLAIN_MODEL, *OURS_MODEL]
  for row in rows:
    ratios = [_ratio(cell) for cell in row[1:4]]
    if row[0] == PLAIN_MODEL:
      assert ratios == [1.0, 1.0, 1.0]
      assert row[4] == "-"
    else:
      bounds = (1.05, 1.10, 1.05)
      within = all(r <= b for r, b in zip(ratios, bounds, strict=True))
      assert row[4] == ("yes" if within else "no"), row
    assert int(row[5]) >= 0


def test_accelerator_takes_the_sweeps_printed_table(tmp_path, monkeypatch):
  # A table printed row by row, without the line under its header, among
  # other output.
  printed = tmp_path / "sweep.txt"
  printed.write_text(
    "jax, cpu\n| case | dtype | ratio |\n| 4 x (10,) | float32 | 0.90x |\n"
  )
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  import accelerator

  lines = accelerator.sweep_section(str(printed), "")
  header, rows = _table("\n".join(lines), "| case |")
  assert header == ["case", "dtype", "ratio"]
  assert rows == [["4 x (10,)", "float32", "0.90x"]]
  missing = accelerator.sweep_section(None, "Not run: no sweep here.")
  assert "Not run: no sweep here." in missing
