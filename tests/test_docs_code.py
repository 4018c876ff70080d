"""The python blocks of the README and of every docs page run, in order.

Each page runs in a fresh process, its blocks in the order they appear, as a
reader would paste them. The multi-device page runs on 8 host CPU devices;
the others under JAX's defaults.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Pages whose code needs several devices, and how many.
DEVICES = {"docs/multidevice.md": 8}


def python_blocks(text: str) -> list[str]:
  """The ```python fenced blocks of a markdown page, in order."""
  return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def pages() -> list[str]:
  found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  return [
    str(p.relative_to(ROOT))
    for p in found
    if python_blocks(p.read_text(encoding="utf-8"))
  ]


def test_the_readme_and_the_guides_have_code_to_run():
  listed = pages()
  assert "README.md" in listed
  assert sum(p.startswith("docs/guides/") for p in listed) >= 5


@pytest.mark.parametrize("page", pages())
def test_page_code_runs_in_order(page, tmp_path):
  source = "\n\n".join(python_blocks((ROOT / page).read_text("utf-8")))
  script = tmp_path / "page.py"
  script.write_text(source, encoding="utf-8")
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  if page in DEVICES:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES[page]}"
  result = subprocess.run(
    [sys.executable, str(script)],
    env=env,
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, f"{page}:\n{result.stdout}{result.stderr}"


def test_every_ratio_in_the_docs_is_one_a_benchmark_wrote():
  # No hand-typed figure: a ratio quoted in the README or a docs page is
  # one that a script in benchmarks/ wrote into its results file.
  written = "\n".join(
    p.read_text("utf-8") for p in (ROOT / "benchmarks").glob("*.md")
  )
  written_ratios = set(re.findall(r"\b\d+\.\d+x", written))
  generated = {"docs/real_text.md"}  # written whole by examples/real_text.py
  for page in ["README.md", *pages_with_prose()]:
    if page in generated:
      continue
    text = (ROOT / page).read_text("utf-8")
    quoted = set(re.findall(r"\b\d+\.\d+x", text))
    assert quoted <= written_ratios, (page, sorted(quoted - written_ratios))


def pages_with_prose() -> list[str]:
  return [
    str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md"))
  ]
