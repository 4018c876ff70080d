"""Replicas agree on every skip: pmap, shard_map and sharded jit on 8 CPUs.

The number of host devices is fixed when JAX starts, so the checks run in
subprocesses (`multidevice_checks.py`), one per axis type, all started at
once with the docs' sharded recipe on one device and the two processes of
the multi-process check. Every mesh check runs under `jax.make_mesh`'s
default axis types (Explicit). The sharded-jit step (every public function)
and the `vmap` ensemble sharded inside each member run under
`AxisType.Auto` too, where no sharding shows in the types and the library
takes its other path; the pmap checks, which use no mesh, share that
process.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

# About 35 s of wall time on 2 cores: in the slow suite, which `.ci/run` runs
# beside `pytest`.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT = 300

PMAP_CHECKS = [
  "pmap_replicas_agree",
  "pmap_docs_step",
  "pmap_minimize_retries_agree",
  "pmap_global_norm",
]
MESH_CHECKS = [
  "shard_map",
  "shard_map_spikes",
  "global_norm",
  "jmp_select_tree_in_shard_map",
  "every_function",
  "sharded_step_differentiates_in_reverse_mode",
  "vmap_members_sharded",
  "vmap_members_sharded_inside",
]
# Under Auto axes too: the library reads shardings from the types only under
# Explicit axes. (Inside `shard_map` every axis is Manual, whatever its
# type.)
UNDER_AUTO = ["every_function", "global_norm", "vmap_members_sharded_inside"]
RUNS = {"explicit": MESH_CHECKS, "auto": PMAP_CHECKS + UNDER_AUTO}


def _env(devices: int | None) -> dict[str, str]:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  if devices is not None:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env


def _start(args: list[str], env: dict[str, str], log: pathlib.Path):
  """Starts `python ARGS`, its output (stdout and stderr) going to `log`."""
  with log.open("w") as f:  # the child keeps its own copy of the file
    return subprocess.Popen(
      [sys.executable, *args], env=env, cwd=ROOT, stdout=f, stderr=f
    )


def _recipe(tmp: pathlib.Path) -> pathlib.Path:
  """The docs' sharded recipe, as a script."""
  page = (ROOT / "docs" / "multidevice.md").read_text()
  recipe = page.split("<!-- sharded-recipe -->\n```python\n")[1]
  script = tmp / "recipe.py"
  script.write_text(recipe.split("```")[0])
  return script


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
  """Every subprocess of this module, started at once.

  Returns `(tmp, {name: (returncode, output)})`; the two processes of the
  multi-process check write what they saw to `tmp/out0.json` and
  `tmp/out1.json`.
  """
  tmp = tmp_path_factory.mktemp("multidevice")
  checks = str(ROOT / "tests" / "multidevice_checks.py")
  commands = {
    axes: ([checks, axes, *names], _env(8)) for axes, names in RUNS.items()
  }
  # The docs run the recipe on 8 devices (test_docs_code.py); here on one.
  commands["recipe"] = ([str(_recipe(tmp))], _env(1))
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  worker = str(ROOT / "tests" / "multiprocess_worker.py")
  for rank in range(2):
    out = str(tmp / f"out{rank}.json")
    commands[f"rank{rank}"] = ([worker, str(port), str(rank), out], _env(2))
  procs = {
    name: _start(args, env, tmp / f"{name}.log")
    for name, (args, env) in commands.items()
  }
  deadline = time.monotonic() + TIMEOUT
  try:
    for p in procs.values():
      p.wait(timeout=max(deadline - time.monotonic(), 1))
  finally:
    for p in procs.values():
      p.kill()
  return tmp, {
    name: (p.returncode, (tmp / f"{name}.log").read_text())
    for name, p in procs.items()
  }


@pytest.mark.parametrize(
  "axes, check",
  [(axes, check) for axes, names in RUNS.items() for check in names],
)
def test_multidevice_check(outputs, axes, check):
  rc, output = outputs[1][axes]
  lines = output.splitlines()
  assert any(line.startswith(f"ok {check} ") for line in lines), output
  assert rc == 0, output


def test_sharded_recipe_runs_as_written_on_one_device(outputs):
  rc, output = outputs[1]["recipe"]
  assert rc == 0, output
  assert "loss " in output, output


def test_two_processes_agree_on_a_skip_and_stop(outputs):
  # An Explicit mesh over both processes, FSDP-sharded: a NaN in one
  # process's shard makes both skip twice with the same scale, both
  # monitors raise, and both apply the next step.
  tmp, results = outputs
  seen = []
  for rank in range(2):
    rc, output = results[f"rank{rank}"]
    assert rc == 0, output
    seen.append(json.loads((tmp / f"out{rank}.json").read_text()))
  assert seen[0] == seen[1], seen
  applied = seen[0].pop("applied")
  np.testing.assert_allclose(applied, 0.9, rtol=1e-5)  # Adam's first step
  assert seen[0] == {
    "raised": True,
    "nonfinite": ["['w']"],
    "scale": 2.0**8,
    "skipped": 2,
    "unchanged": True,
  }
