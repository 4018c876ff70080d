"""The wheel installs into a clean virtual environment and imports."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest.importorskip("build", reason="the `build` package builds the wheel")


def _run(*args: str, **kwargs) -> str:
  result = subprocess.run(
    args, capture_output=True, text=True, check=False, **kwargs
  )
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


def test_wheel_and_sdist_build_and_the_wheel_imports_without_extras(tmp_path):
  dist = tmp_path / "dist"
  _run(
    sys.executable,
    "-m",
    "build",
    "--wheel",
    "--sdist",
    "--outdir",
    str(dist),
    str(ROOT),
    timeout=300,
  )
  wheels = list(dist.glob("optax_lossscale-*.whl"))
  assert len(wheels) == 1 and list(dist.glob("optax_lossscale-*.tar.gz"))

  env_dir = tmp_path / "venv"
  venv.create(env_dir, with_pip=True)
  python = str(env_dir / "bin" / "python")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  _run(
    python,
    "-m",
    "pip",
    "install",
    "--quiet",
    str(wheels[0]),
    env=env,
    timeout=600,
  )
  out = _run(
    python,
    "-c",
    "import importlib.util as u, optax_lossscale as o;"
    "print(o.__version__, o.__file__);"
    "print([m for m in ('pytest', 'chex', 'hypothesis', 'flax')"
    " if u.find_spec(m)])",
    env=env,
    cwd=tmp_path,
    timeout=120,
  )
  version_line, extras_line = out.strip().splitlines()
  from optax_lossscale import __version__

  assert version_line.split()[0] == __version__
  assert str(env_dir) in version_line  # the installed copy, not the checkout
  assert extras_line == "[]"  # the test extras are not runtime dependencies
  typed = _run(
    python,
    "-c",
    "import optax_lossscale, pathlib;"
    "print((pathlib.Path(optax_lossscale.__file__).parent /"
    " 'py.typed').exists())",
    env=env,
    cwd=tmp_path,
  )
  assert typed.strip() == "True"
