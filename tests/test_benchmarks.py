"""The benchmark scripts' quick modes run and write well-formed tables.

Structure only: the rows and columns each table must have, ratios that are
finite positive numbers, and the header that names the command, machine and
date of every results file. Never a time: the figures of a quick run mean
nothing.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
HEADER_LINES = ("command", "backend", "device", "host", "versions", "date")
# Written since 0.3.0 between `versions` and `date`; required where noise
# decides the verdict (the sweep's bar), optional in older files.
LOAD = "load average"
REAL_TEXT = ROOT / "docs" / "real_text.md"
REAL_TEXT_MARKERS = ("<!-- real_text:begin -->", "<!-- real_text:end -->")
# What the command in each committed results file must contain: the script
# that writes it, and the option that makes it write that file.
WRITERS = {
  "RESULTS.md": ("benchmarks/step_overhead.py",),
  "FAILURE_MODES.md": ("benchmarks/step_overhead.py", "--failure-modes"),
  "SHARDED.md": ("benchmarks/step_overhead.py", "--sharded"),
  "BASELINE_STEP.md": ("benchmarks/step_overhead.py", "--baseline"),
  "TRAIN_STEP.md": ("benchmarks/train_step.py",),
  "FINITE_SWEEP.md": ("benchmarks/finite_sweep.py",),
  "COMPILE.md": ("benchmarks/first_compile.py",),
  "LLM_STACK.md": ("benchmarks/llm_stack.py",),
  "WHOLE_STEP.md": ("benchmarks/whole_step.py",),
  "BAD_BATCHES.md": ("benchmarks/bad_batches.py",),
  "JMP.md": ("benchmarks/jmp_select_tree.py",),
  "JMP_HAIKU.md": ("benchmarks/jmp_haiku_resnet.py",),
  "MODEL_STEP.md": ("benchmarks/model_step.py",),
  # accelerator.sh, or accelerator.py run by hand.
  "ACCELERATOR_*.md": ("benchmarks/accelerator.",),
  "docs/real_text.md": ("examples/real_text.py",),
}
PLAIN_MODEL = "plain adam: value_and_grad + apply_updates"
OURS_MODEL = (
  "LossScaleOptimizer.minimize",
  "scaled_value_and_grad + apply_gradients",
)
STEP_ROWS = (
  "plain adam",
  "LossScaleOptimizer.apply_gradients",
  "chain(unscale_gradients, adam)",
  "LossScaleOptimizer.update",
)
COND_OR_SELECT = (
  "LossScaleOptimizer.apply_gradients",
  "fused step, per-leaf select (optax.tree.where)",
)


# The slow tests' script runs, by test: a function of the run's folder that
# gives the command (None: not run), its environment's additions and its
# timeout. `script_runs` starts them.
SCRIPT_RUNS: dict[str, tuple[Any, dict[str, str], int]] = {}
# A quick run's figures mean nothing, and the tests read the tables' form:
# less LLVM optimisation (the HLO is the same) makes the quick runs about
# 0.7x as long on XLA:CPU. It replaces any XLA_FLAGS of the environment.
FAST_COMPILE = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}
CPU_ONLY = {"PYTHON": sys.executable, "JAX_PLATFORMS": "cpu", **FAST_COMPILE}


def _script_run(command: Any, env: dict[str, str] = CPU_ONLY, timeout=600):
  """Registers the decorated test's script run (see `SCRIPT_RUNS`)."""

  def register(test: Any) -> Any:
    SCRIPT_RUNS[test.__name__] = (command, env, timeout)
    return test

  return register


@pytest.fixture(scope="module")
def script_runs(request, tmp_path_factory):
  """The script runs of the slow tests this session runs, started together.

  As many run at once as there are CPUs (at least two): a script spends most
  of its time importing and compiling, on about one core. Yields `{test:
  (future of its CompletedProcess, its folder)}`.
  """
  selected = [
    item.originalname
    for item in request.session.items
    if getattr(item, "module", None) is request.module
    and item.originalname in SCRIPT_RUNS
  ]
  workers = max(2, os.cpu_count() or 1)
  runs = {}
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for name in selected:
      command_of, env, timeout = SCRIPT_RUNS[name]
      out = tmp_path_factory.mktemp("script")
      command = command_of(out)
      if command is None:
        continue
      run = pool.submit(
        subprocess.run,
        command,
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
      )
      runs[name] = (run, out)
    yield runs
    pool.shutdown(cancel_futures=True)


def _ran(script_runs, request) -> pathlib.Path:
  """The folder of this test's script run, which must have succeeded."""
  run, out = script_runs[request.node.originalname]
  done = run.result()
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return out


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


def _header_problems(text: str, writer: tuple[str, ...]) -> list[str]:
  """What is wrong with the header `_timing.header()` writes, if anything.

  Args:
    text: a results file.
    writer: what its command must contain (a `WRITERS` value).

  Returns:
    One message per problem: a missing line, lines out of their order or
    apart, a command that does not name `writer`, a date not `YYYY-MM-DD`.
  """
  lines = [x for x in text.splitlines() if not x.startswith(f"- {LOAD}: ")]
  if "FINITE_SWEEP" in " ".join(writer) or "finite_sweep" in " ".join(writer):
    if not re.search(rf"^- {LOAD}: \d+\.\d\d, ", text, re.M):
      return [f"no '- {LOAD}:' line"]
  found = {
    key: [i for i, x in enumerate(lines) if re.match(rf"- {key}: \S", x)]
    for key in HEADER_LINES
  }
  problems = [f"no '- {key}:' line" for key, at in found.items() if not at]
  problems += [
    f"{len(at)} '- {key}:' lines (one description per file)"
    for key, at in found.items()
    if len(at) > 1
  ]
  if problems:
    return problems
  start = found["command"][0]
  if [found[key][0] for key in HEADER_LINES] != list(
    range(start, start + len(HEADER_LINES))
  ):
    problems.append(f"the lines are not together, in the order {HEADER_LINES}")
  command = re.fullmatch(r"- command: `([^`]+)`", lines[start])
  if not command or not all(part in command.group(1) for part in writer):
    problems.append(f"{lines[start]!r} does not name {' '.join(writer)}")
  date = lines[found["date"][0]]
  if not re.fullmatch(r"- date: \d{4}-\d\d-\d\d", date):
    problems.append(f"{date!r} is not a YYYY-MM-DD date")
  return problems


def _environment(text: str, *writer: str) -> None:
  problems = _header_problems(text, writer)
  assert not problems, problems


def _results_files() -> dict[str, str]:
  """Every committed results file (the generated block of a docs page)."""
  files = {p.name: p.read_text() for p in sorted(BENCHMARKS.glob("*.md"))}
  begin, end = REAL_TEXT_MARKERS
  page = REAL_TEXT.read_text()
  assert page.count(begin) == 1 and page.count(end) == 1, REAL_TEXT
  files["docs/real_text.md"] = page.split(begin)[1].split(end)[0]
  return files


def _writer(name: str) -> tuple[str, ...] | None:
  for pattern, writer in WRITERS.items():
    if pathlib.PurePosixPath(name).match(pattern):
      return writer
  return None


@pytest.mark.slow
@_script_run(
  # The sweep has a quick mode of its own; here it would only add minutes.
  lambda out: [
    "bash",
    str(BENCHMARKS / "accelerator.sh"),
    str(out / "accelerator.md"),
    "--quick",
    "--no-sweep",
  ]
)
def test_accelerator_script_quick_mode_writes_one_table(script_runs, request):
  text = (_ran(script_runs, request) / "accelerator.md").read_text()
  _environment(text, "benchmarks/accelerator.sh", "--quick", "--no-sweep")
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


@pytest.mark.slow
@_script_run(
  lambda out: [
    sys.executable,
    str(BENCHMARKS / "llm_stack.py"),
    "--quick",
    "--out",
    str(out / "llm_stack.md"),
  ]
)
def test_llm_stack_quick_mode_writes_every_row(script_runs, request):
  text = (_ran(script_runs, request) / "llm_stack.md").read_text()
  _environment(text, "benchmarks/llm_stack.py", "--quick")
  for row in (
    "clip + norm logged",
    "loss scaling alone",
    "accumulation, per micro-step",
  ):
    assert re.search(rf"\| {re.escape(row)}: .*\| \d+\.\d\dx \(", text), row
  assert "the library's own cost, over the floor | +" in text


@pytest.mark.slow
@_script_run(
  lambda out: [
    sys.executable,
    str(BENCHMARKS / "whole_step.py"),
    "--quick",
    "--out",
    str(out / "whole_step.md"),
  ]
)
def test_whole_step_quick_mode_writes_every_row(script_runs, request):
  text = (_ran(script_runs, request) / "whole_step.md").read_text()
  _environment(text, "benchmarks/whole_step.py", "--quick")
  assert "- model: `Transformer(layers=1, d_model=64)`: 1 layer," in text
  assert " 17 leaves, " in text  # the quick model's
  header, rows = _table(text, "| configuration |")
  assert header == ["configuration", "first compile / plain's", "seconds"]
  assert [row[0] for row in rows] == [
    "plain",
    "floor",
    "ours",
    "ours - floor: the library's own cost",
  ]
  for row in rows[:3]:
    median, spread = row[1].split(" ", 1)
    _ratio(median)
    assert re.fullmatch(r"\(\d+\.\d\d-\d+\.\d\d\)", spread), row
    assert float(row[2].split(" ")[0]) > 0, row
  assert rows[0][1] == "1.00x (1.00-1.00)"  # plain's own ratio
  assert re.fullmatch(r"[+-]\d+\.\d\dx", rows[3][1]), rows[3]


@pytest.mark.slow
@_script_run(
  lambda out: [
    sys.executable,
    str(BENCHMARKS / "model_step.py"),
    "--quick",
    "--out",
    str(out / "model_step.md"),
  ]
)
def test_model_step_quick_mode_checks_the_bounds(script_runs, request):
  text = (_ran(script_runs, request) / "model_step.md").read_text()
  _environment(text, "python benchmarks/model_step.py --quick")
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


def test_every_results_file_names_its_command_machine_and_date():
  # Fails on files written before `_timing.header()` existed, until they are
  # regenerated.
  problems = []
  for name, text in _results_files().items():
    writer = _writer(name)
    if writer is None:
      problems.append(f"{name}: no script in WRITERS writes it")
      continue
    problems += [f"{name}: {p}" for p in _header_problems(text, writer)]
  assert not problems, "\n".join(problems)


@pytest.fixture
def regenerate(monkeypatch):
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  import regenerate

  return regenerate


def test_regenerate_reruns_the_command_each_committed_file_names(regenerate):
  # A results file rewritten by another command than regenerate.py's (a
  # script run by hand with other options) fails here: update its `Run`.
  runs = {run.file: run for run in regenerate.RUNS}
  files = {
    name if "/" in name else f"benchmarks/{name}": text
    for name, text in _results_files().items()
    if not pathlib.PurePosixPath(name).match("ACCELERATOR_*.md")
  }
  assert sorted(runs) == sorted(files)
  for name, text in files.items():
    command = re.search(r"^- command: `([^`]+)`$", text, re.M)
    assert command, name
    assert command.group(1) == regenerate.shell(runs[name].command), name
  # What it lists after a full run: none now (test_docs_code.py's rule).
  assert regenerate.stale_ratios() == {}


def test_regenerate_quick_runs_write_only_into_their_folder(regenerate, capsys):
  assert regenerate.main(["--quick", "--dry-run"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == len(regenerate.RUNS)
  for line, run in zip(lines, regenerate.RUNS, strict=True):
    args = shlex.split(line)
    assert args[:2] == ["python", run.quick[0]], line
    assert "--quick" in args or "--compiles" in args, line
    outs = [b for a, b in zip(args, args[1:], strict=False) if a == "--out"]
    assert all(out.startswith("TMP") for out in outs), line
  assert regenerate.main(["--dry-run", "--only", "COMPILE.md"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("python benchmarks/first_compile.py --compiles 3")
  assert len(out.splitlines()) == 2  # the command, then the estimate


@pytest.fixture
def timing(monkeypatch):
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  import _timing

  return _timing


def test_header_names_the_command_machine_versions_and_date(timing):
  before = datetime.datetime.now(datetime.UTC).date()
  text = timing.header(
    "python benchmarks/train_step.py --quick",
    packages=("numpy", "no-such-package"),
  )
  after = datetime.datetime.now(datetime.UTC).date()
  lines = text.splitlines()
  keys = [*HEADER_LINES[:-1], LOAD, HEADER_LINES[-1]]
  assert [x.split(":")[0] for x in lines] == [f"- {k}" for k in keys]
  assert re.fullmatch(r"- load average: \d+\.\d\d, .*", lines[5]), lines[5]
  lines.pop(5)
  assert not _header_problems(text, ("benchmarks/train_step.py",))
  assert lines[0] == "- command: `python benchmarks/train_step.py --quick`"
  assert lines[1] == f"- backend: {jax.default_backend()}"
  kind = jax.devices()[0].device_kind
  assert lines[2] == f"- device: {kind} x {jax.device_count()}"
  assert re.fullmatch(r"- host: \S+, \d+ cores, \S+", lines[3]), lines[3]
  versions = lines[4].removeprefix("- versions: ").split(", ")
  names = [v.split(" ", 1)[0] for v in versions]
  assert names[:6] == [
    "jax",
    "jaxlib",
    "optax",
    "optax_lossscale",
    "numpy",
    "no-such-package",
  ]
  assert versions[0] == f"jax {jax.__version__}"
  assert versions[4] == f"numpy {np.__version__}"
  assert versions[5] == "no-such-package not installed"
  date = lines[5].removeprefix("- date: ")
  assert date in (before.isoformat(), after.isoformat())


def test_header_names_this_process_command_by_default(timing, monkeypatch):
  script = BENCHMARKS / "step_overhead.py"
  monkeypatch.setattr(sys, "argv", [str(script), "--sharded"])
  command = "python benchmarks/step_overhead.py --sharded"
  assert timing.command_line() == command
  assert timing.header().splitlines()[0] == f"- command: `{command}`"


def test_command_line_reads_the_same_from_any_directory(timing, monkeypatch):
  monkeypatch.chdir(BENCHMARKS)
  assert (
    timing.command_line(["model_step.py", "--note", "a b"])
    == "python benchmarks/model_step.py --note 'a b'"
  )
  script = str(BENCHMARKS / "accelerator.sh")
  assert (
    timing.command_line([script, "--quick"])
    == "benchmarks/accelerator.sh --quick"
  )
  outside = "/nonexistent/elsewhere.py"
  assert timing.command_line([outside]) == f"python {outside}"


@pytest.fixture
def first_compile(monkeypatch):
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  import first_compile

  return first_compile


# Lines as XLA writes them with TF_CPP_VMODULE=hlo_pass_pipeline=1 (the log
# prefix shortened): two modules, and `simplification`, a pipeline nested in
# the step's, whose time includes its own passes'.
XLA_LOG = """\
I1204 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_stage: cpu
I1204 hlo_pass_pipeline.cc:176] HLO pass: copy-insertion time: 9 ms (9 ms) (cumulative: 9 ms, max: 9 ms, #called: 1)
I1204 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_step: cpu
I1204 hlo_pass_pipeline.cc:176] HLO pass: copy-insertion time: 1.5 ms (1.5 ms) (cumulative: 2 ms, max: 2 ms, #called: 2)
I1204 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_step: simplification
I1204 hlo_pass_pipeline.cc:176] HLO pass: algsimp time: 250 us (250 us) (cumulative: 3 ms, max: 2 ms, #called: 3)
I1204 hlo_pass_pipeline.cc:176] HLO pass: simplification time: 300 us (300 us) (cumulative: 3 ms, max: 2 ms, #called: 4)
I1204 hlo_pass_pipeline.cc:176] HLO pass: copy-insertion time: 2 s (2 s) (cumulative: 2 s, max: 2 s, #called: 5)
"""


def test_first_compile_reads_xla_pass_times_counting_nothing_twice(
  first_compile,
):
  times = first_compile.pass_times(XLA_LOG)
  assert times == {"copy-insertion": 2001.5, "algsimp": 0.25}
  assert first_compile.pass_times(XLA_LOG, module="jit_stage") == {
    "copy-insertion": 9.0
  }
  assert not first_compile.pass_times("no pass lines at all")


# The issue-37 bar's commit, which the baseline run compares with.
BASELINE_REV = "18f90f4"


def _in_this_clone(rev: str) -> bool:
  known = subprocess.run(
    ["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}^{{commit}}"],
    capture_output=True,
    check=False,
  )
  return known.returncode == 0


@pytest.mark.slow
@_script_run(
  lambda out: (
    [
      sys.executable,
      str(BENCHMARKS / "step_overhead.py"),
      "--baseline",
      BASELINE_REV,
      "--quick",
      "--out",
      str(out),
    ]
    if _in_this_clone(BASELINE_REV)
    else None
  )
)
def test_step_overhead_baseline_quick_run_writes_the_ratios(
  script_runs, request
):
  # The issue-37 bar's table: the fused step and update now against a
  # commit's. A clone without the commit (a shallow one) skips.
  rev = BASELINE_REV
  if request.node.originalname not in script_runs:
    pytest.skip(f"commit {rev} is not in this clone")
  text = (_ran(script_runs, request) / "BASELINE_STEP.md").read_text()
  _environment(text, "benchmarks/step_overhead.py", "--baseline", rev)
  header, rows = _table(text, "| workload |")
  assert header == ["workload", "step", "vs plain adam", f"now / {rev}"]
  names = [
    "plain adam",
    f"LossScaleOptimizer.apply_gradients at {rev}",
    "LossScaleOptimizer.apply_gradients",
    f"LossScaleOptimizer.update at {rev}",
    "LossScaleOptimizer.update",
  ]
  assert len({row[0] for row in rows}) == 2
  assert [row[1] for row in rows] == names * 2
  for row in rows:
    for cell in row[2:]:
      if cell != "-":
        _ratio(cell.split(" (")[0])
    assert (row[3] != "-") == (row[1] in names[2::2]), row  # the rows now
  assert all(row[2].startswith("1.00x") for row in rows if row[1] == names[0])


@pytest.mark.slow
@_script_run(
  lambda out: [
    sys.executable,
    str(BENCHMARKS / "first_compile.py"),
    "--compiles=1",
    "--leaves=8",
    "--baseline=",
    f"--out={out}",
  ],
  env={"PYTHONPATH": str(ROOT), **FAST_COMPILE},
  timeout=300,
)
def test_first_compile_quick_run_writes_both_tables(script_runs, request):
  # The real script on 8 leaves, one compile each, the passes read from
  # XLA's own log in child processes: a change of the log's format fails
  # here, not silently in the committed table.
  text = (_ran(script_runs, request) / "COMPILE.md").read_text()
  assert not _header_problems(text, ("benchmarks/first_compile.py",))
  header, rows = _table(text, "| workload |")
  assert header[2:] == [
    "adam in one lax.cond",
    "adam in one lax.cond, unscaled",
    "fused",
  ]
  assert [r[0] for r in rows] == ["8 leaves x 1000"]
  header, rows = _table(text, "| pass (ms) |")
  assert header[1:] == ["plain adam", *_table(text, "| workload |")[0][2:]]
  assert rows[-1][0] == "all passes"
  assert all(float(x) > 0 for x in rows[-1][1:])


def test_first_compile_leaves_out_a_commit_it_cannot_read(timing, tmp_path):
  assert not timing.extract_baseline("no-such-commit", str(tmp_path))
  assert timing.import_baseline(None) is None


def test_first_compile_builds_the_baseline_commits_fused_step(
  first_compile, timing, tmp_path
):
  # The committed table's `fused at 7f7800e` column: that commit still
  # extracts, imports and lowers under today's JAX and Optax. A clone
  # without it (a shallow one) leaves the column out, and this test too.
  if not timing.extract_baseline(first_compile.BASELINE, str(tmp_path)):
    pytest.skip(f"commit {first_compile.BASELINE} is not in this clone")
  baseline = timing.import_baseline(str(tmp_path))
  assert baseline is not None
  config = first_compile.configs(baseline, first_compile.BASELINE)
  init, step = config[f"fused at {first_compile.BASELINE}"](1e-3)
  params = {"a": jax.numpy.ones(3), "b": jax.numpy.zeros((2, 2))}
  grads = {"a": jax.numpy.array([1.0, jax.numpy.inf, 0.0]), "b": params["b"]}
  # Under JAX's default promotion, as the script runs it: that commit's
  # code predates the suite's strict promotion.
  with jax.numpy_dtype_promotion("standard"):
    new_params, _ = jax.jit(step)(params, init(params), grads)
  assert np.array_equal(new_params["a"], params["a"])  # skipped: not finite


def test_first_compile_unscaled_column_is_adam_on_unscaled_gradients(
  first_compile, standard_promotion
):
  import optax
  import step_overhead

  named = first_compile.configs(None, "")
  init, step = named["adam in one lax.cond, unscaled"](1e-3)
  params = {"a": jax.numpy.ones(3), "b": jax.numpy.zeros((2, 2))}
  # Near Adam's epsilon, where its update tells scaled from unscaled.
  grads = {
    "a": jax.numpy.array([1.0, -2.0, 0.5]) * 1e-8,
    "b": params["b"] + 3e-9,
  }
  scaled = jax.tree.map(lambda g: g * step_overhead.SCALE, grads)
  new_params, (_, scale) = jax.jit(step)(params, init(params), scaled)
  tx = optax.adam(1e-3)
  updates, _ = tx.update(grads, tx.init(params), params)
  expected = optax.apply_updates(params, updates)
  assert scale == step_overhead.SCALE
  for k in params:  # left scaled, the update would be 1.5x to 4.3x larger
    np.testing.assert_allclose(new_params[k], expected[k], rtol=1e-6)
  bad = dict(scaled, a=scaled["a"].at[0].set(np.nan))
  skipped, _ = jax.jit(step)(params, init(params), bad)
  assert all(np.array_equal(skipped[k], params[k]) for k in params)
