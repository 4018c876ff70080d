"""Regenerates every committed results file, one script after another.

Usage: python benchmarks/regenerate.py [--quick] [--dry-run] [--only FILE ...]

Runs each script that writes a results file the docs include, with the
command that file names under its title, each in a process of its own and
one at a time, so that no two share the machine; prints each run's wall
time and the total. Every file records its command, machine, versions,
load average at start and date (`_timing.header()`): run this on an
otherwise idle machine. The full run takes about 50 minutes on a 2-core
x86_64 CPU machine (`--dry-run` lists each run's estimate); afterwards it
lists the ratios the docs' prose quotes that no results file holds any
more (`tests/test_docs_code.py` fails on them until the prose is updated).

`--quick` runs each script's quick mode instead, writing into a fresh
temporary folder, so that the committed files stay as they are: a check
that every script still runs, whose figures mean nothing (about 10
minutes on that machine idle, 25 on a busy one). `--only` runs
the named files' scripts alone (`--only COMPILE.md LLM_STACK.md`).
`--dry-run` prints the commands without running them. The accelerator's
file (`accelerator.sh`) is not among them: it needs a GPU or TPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where the folder of a quick run goes in a command.
TMP = "{tmp}"


@dataclasses.dataclass(frozen=True)
class Run:
  """One results file and the commands that write it.

  Attributes:
    file: the file, from the repository's root.
    command: the command the committed file names under its title, the
      script first, from the repository's root.
    quick: the script's quick mode, writing under `TMP` (or nothing).
    minutes: about how long `command` takes on a 2-core x86_64 CPU machine.
  """

  file: str
  command: tuple[str, ...]
  quick: tuple[str, ...]
  minutes: float


# In the order docs/performance.md shows them, then the real-text page.
RUNS = (
  Run(
    "benchmarks/FINITE_SWEEP.md",
    ("benchmarks/finite_sweep.py",),
    # Its quick mode prints its table and writes nothing.
    ("benchmarks/finite_sweep.py", "--quick", "--out", TMP),
    3,
  ),
  Run(
    "benchmarks/COMPILE.md",
    ("benchmarks/first_compile.py", "--compiles", "3", "--baseline", "3691750"),
    (
      "benchmarks/first_compile.py",
      "--compiles",
      "1",
      "--leaves",
      "8",
      "--baseline",
      "",
      "--out",
      TMP,
    ),
    8,
  ),
  Run(
    "benchmarks/RESULTS.md",
    ("benchmarks/step_overhead.py", "--quick"),
    ("benchmarks/step_overhead.py", "--quick", "--out", TMP),
    3,
  ),
  Run(
    "benchmarks/BASELINE_STEP.md",
    ("benchmarks/step_overhead.py", "--baseline", "18f90f4"),
    ("benchmarks/step_overhead.py", "--baseline", "18f90f4", "--quick")
    + ("--out", TMP),
    3,
  ),
  Run(
    "benchmarks/TRAIN_STEP.md",
    ("benchmarks/train_step.py",),
    ("benchmarks/train_step.py", "--quick", "--out", f"{TMP}/TRAIN_STEP.md"),
    6,
  ),
  Run(
    "benchmarks/MODEL_STEP.md",
    (
      "benchmarks/model_step.py",
      "--peers",
      "--rounds=3",
      "--steps=10",
      "--compiles=3",
    ),
    ("benchmarks/model_step.py", "--quick", "--out", f"{TMP}/MODEL_STEP.md"),
    4,
  ),
  Run(
    "benchmarks/FAILURE_MODES.md",
    ("benchmarks/step_overhead.py", "--failure-modes", "--quick"),
    ("benchmarks/step_overhead.py", "--failure-modes", "--quick")
    + ("--out", TMP),
    2,
  ),
  Run(
    "benchmarks/SHARDED.md",
    ("benchmarks/step_overhead.py", "--sharded", "--quick"),
    ("benchmarks/step_overhead.py", "--sharded", "--quick", "--out", TMP),
    2,
  ),
  Run(
    "benchmarks/JMP.md",
    ("benchmarks/jmp_select_tree.py",),
    ("benchmarks/jmp_select_tree.py", "--quick", "--out", f"{TMP}/JMP.md"),
    3,
  ),
  Run(
    "benchmarks/JMP_HAIKU.md",
    ("benchmarks/jmp_haiku_resnet.py",),
    ("benchmarks/jmp_haiku_resnet.py", "--quick")
    + ("--out", f"{TMP}/JMP_HAIKU.md"),
    2,
  ),
  Run(
    "benchmarks/LLM_STACK.md",
    ("benchmarks/llm_stack.py",),
    ("benchmarks/llm_stack.py", "--quick", "--out", f"{TMP}/LLM_STACK.md"),
    4,
  ),
  Run(
    "benchmarks/WHOLE_STEP.md",
    ("benchmarks/whole_step.py",),
    ("benchmarks/whole_step.py", "--quick", "--out", f"{TMP}/WHOLE_STEP.md"),
    4,
  ),
  Run(
    "benchmarks/BAD_BATCHES.md",
    ("benchmarks/bad_batches.py",),
    ("benchmarks/bad_batches.py", "--quick", "--out", f"{TMP}/BAD_BATCHES.md"),
    4,
  ),
  Run(
    "docs/real_text.md",
    ("examples/real_text.py",),
    # Its quick mode writes nothing.
    ("examples/real_text.py", "--quick"),
    4,
  ),
)
RATIO = re.compile(r"\b\d+\.\d+x")


def shell(command: tuple[str, ...]) -> str:
  """`command` as the results files write it: `python script args`."""
  return shlex.join(["python", *command])


def stale_ratios() -> dict[str, list[str]]:
  """Ratios the docs' prose quotes that no results file in benchmarks/ has.

  The rule of `tests/test_docs_code.py`: the README and every docs page but
  the generated real-text page.
  """
  written = "\n".join(
    p.read_text("utf-8") for p in (ROOT / "benchmarks").glob("*.md")
  )
  have = set(RATIO.findall(written))
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  stale = {}
  for page in pages:
    if page == ROOT / "docs" / "real_text.md":
      continue
    missing = sorted(set(RATIO.findall(page.read_text("utf-8"))) - have)
    if missing:
      stale[page.relative_to(ROOT).as_posix()] = missing
  return stale


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick",
    action="store_true",
    help="each script's quick mode, into a temporary folder",
  )
  parser.add_argument(
    "--dry-run", action="store_true", help="print the commands, run nothing"
  )
  parser.add_argument(
    "--only",
    nargs="+",
    metavar="FILE",
    choices=[pathlib.PurePosixPath(r.file).name for r in RUNS],
    help="only the scripts of these files",
  )
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  runs = [
    r
    for r in RUNS
    if not args.only or pathlib.PurePosixPath(r.file).name in args.only
  ]
  tmp = "TMP"
  if args.quick and not args.dry_run:
    tmp = tempfile.mkdtemp(prefix="regenerate-")
    print(f"quick runs, written to {tmp}", flush=True)
  # This checkout's package, whatever else is installed.
  path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
  failed = []
  start = time.perf_counter()
  for run in runs:
    command = run.quick if args.quick else run.command
    command = tuple(x.replace(TMP, tmp) for x in command)
    if args.dry_run:
      estimate = "" if args.quick else f"  # about {run.minutes:g} min"
      print(f"{shell(command)}{estimate}")
      continue
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n$ {shell(command)}  (load average {load})", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(
      [sys.executable, *command], cwd=ROOT, env=env, check=False
    )
    seconds = time.perf_counter() - t0
    print(f"{run.file}: {seconds / 60:.1f} min, exit {done.returncode}")
    if done.returncode:
      failed.append(run.file)
  if args.dry_run:
    if not args.quick:
      total = sum(r.minutes for r in runs)
      print(f"# about {total:g} min in all on a 2-core x86_64 CPU machine")
    return 0
  print(f"\ntotal wall time: {(time.perf_counter() - start) / 60:.1f} min")
  if failed:
    print(f"failed: {', '.join(failed)}")
  if not args.quick:
    for page, missing in stale_ratios().items():
      print(f"{page} quotes ratios no results file has now: {missing}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
