"""The wheel and the sdist build; the wheel installs and imports alone."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What the package must not import: the extras (demo, test, docs, bench).
EXTRAS = [
  "pytest",
  "hypothesis",
  "flax",
  "orbax",
  "equinox",
  "haiku",
  "jmp",
  "matplotlib",
  "sklearn",
  "tqdm",
]

pytest.importorskip("build", reason="the `build` package builds the wheel")


def _run(*args: str, **kwargs) -> str:
  result = subprocess.run(
    args, capture_output=True, text=True, check=False, **kwargs
  )
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


def _build(dist: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """The wheel and the sdist, built from the checkout into `dist`."""
  command = [sys.executable, "-m", "build", "--wheel", "--sdist"]
  if importlib.util.find_spec("hatchling"):  # the build backend is here
    command.append("--no-isolation")
  _run(*command, "--outdir", str(dist), str(ROOT), timeout=300)
  (wheel,) = dist.glob("optax_lossscale-*.whl")
  (sdist,) = dist.glob("optax_lossscale-*.tar.gz")
  return wheel, sdist


def test_wheel_and_sdist_build_and_the_wheel_installs_and_imports(tmp_path):
  from optax_lossscale import __version__

  wheel, sdist = _build(tmp_path / "dist")
  with zipfile.ZipFile(wheel) as z:
    files = z.namelist()
    metadata = z.read(f"optax_lossscale-{__version__}.dist-info/METADATA")
  assert "optax_lossscale/py.typed" in files
  assert not any(f.startswith(("tests/", "examples/")) for f in files)
  # The runtime dependencies are JAX and Optax; the rest are extras.
  requires = re.findall(r"^Requires-Dist: (.*)$", metadata.decode(), re.M)
  runtime = [r for r in requires if "extra ==" not in r]
  assert sorted(re.split(r"[<>=!~ ;]", r)[0] for r in runtime) == [
    "jax",
    "jaxlib",
    "optax",
  ], requires
  with tarfile.open(sdist) as t:
    names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
  for needed in ["tests/conftest.py", "examples/real_text.py", "LICENSE"]:
    assert needed in names, needed

  # Installed by pip, without its dependencies (this environment has them),
  # outside the checkout; imported in isolated mode (no PYTHONPATH, no
  # current directory), it imports none of the extras.
  site = tmp_path / "site"
  _run(
    sys.executable,
    "-m",
    "pip",
    "install",
    "--quiet",
    "--no-deps",
    "--no-index",
    "--target",
    str(site),
    str(wheel),
    timeout=120,
  )
  code = (
    f"import sys; sys.path.insert(0, {str(site)!r});"
    "import pathlib, optax_lossscale as o;"
    "print(o.__version__, o.__file__);"
    "print((pathlib.Path(o.__file__).parent / 'py.typed').exists());"
    f"print([m for m in {EXTRAS!r} if m in sys.modules])"
  )
  out = _run(sys.executable, "-I", "-c", code, cwd=tmp_path, timeout=120)
  version_line, typed, extras = out.strip().splitlines()
  version, path = version_line.split()
  assert version == __version__
  assert path.startswith(str(site))  # the installed copy, not the checkout
  assert typed == "True"
  assert extras == "[]"  # no extra is needed to import the package
