"""Replicas agree on every skip: pmap, shard_map and sharded jit on 8 CPUs.

Each check runs in a subprocess, because the number of host devices is fixed
when JAX starts. The mesh checks run under `jax.make_mesh`'s default axis
types (Explicit) and under `AxisType.Auto`.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(*checks: str, timeout: int = 600) -> None:
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=8",
    PYTHONPATH=str(ROOT),
    JAX_PLATFORMS="cpu",
  )
  result = subprocess.run(
    [sys.executable, str(ROOT / "tests" / "multidevice_checks.py"), *checks],
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
    cwd=ROOT,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  for check in checks:
    assert f"ok {check}" in result.stdout


def test_replicas_agree_under_pmap():
  _run(
    "pmap",
    "pmap_readme_step",
    "nan_loss_on_one_replica",
    "minimize_retries_agree",
  )


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_sharded_meshes(axes):
  _run(
    *(
      f"{check}:{axes}"
      for check in [
        "shard_map",
        "sharded_jit",
        "sharded_leaves_are_checked_in_place",
        "orbax_sharded_state",
        "vmap_members_sharded",
        "vmap_members_sharded_inside",
        "vmap_members_sharded_with_integer_leaves",
        "sharded_step_differentiates_in_reverse_mode",
      ]
    )
  )


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_every_public_function_on_sharded_trees(axes):
  _run(f"every_function:{axes}")


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_jmp_select_tree_takes_leaves_varying_along_other_axes(axes):
  # Inside `shard_map`: jmp's values, dtypes and varying axes.
  _run(f"jmp_select_tree_in_shard_map:{axes}")


@pytest.mark.parametrize("devices", [1, 8])
def test_sharded_recipe_runs_as_written(tmp_path, devices):
  page = (ROOT / "docs" / "multidevice.md").read_text()
  recipe = page.split("<!-- sharded-recipe -->\n```python\n")[1]
  script = tmp_path / "recipe.py"
  script.write_text(recipe.split("```")[0])
  env = dict(
    os.environ,
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    PYTHONPATH=str(ROOT),
    JAX_PLATFORMS="cpu",
  )
  result = subprocess.run(
    [sys.executable, str(script)],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.startswith("loss "), result.stdout


def test_two_processes_agree_on_a_skip_and_stop(tmp_path):
  import socket

  import numpy as np

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        str(ROOT / "tests" / "multiprocess_worker.py"),
        str(port),
        str(rank),
        str(tmp_path / f"out{rank}.npy"),
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for rank in range(2)
  ]
  try:
    outputs = [p.communicate(timeout=110)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, output in zip(procs, outputs, strict=True):
    assert p.returncode == 0, output
  a, b = (np.load(tmp_path / f"out{rank}.npy") for rank in range(2))
  np.testing.assert_array_equal(a, b)  # bit-equal params, scale, counters
  np.testing.assert_allclose(a[:3], -0.2, rtol=1e-6)
  assert a[3] == 2.0**9 and a[4] == 1
  # The Explicit mesh over both processes, FSDP-sharded: both skipped twice
  # with the same scale, and both monitors raised.
  import json

  explicit = [
    json.loads((tmp_path / f"out{rank}.npy.explicit.json").read_text())
    for rank in range(2)
  ]
  assert explicit[0] == explicit[1], explicit
  assert explicit[0] == {
    "raised": True,
    "scale": 2.0**8,
    "skipped": 2,
    "nonfinite": ["['w']"],
    "unchanged": True,
  }
