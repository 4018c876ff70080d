"""The docs hold true: their code runs, their tables match the code.

Each page's python blocks run in a fresh process, in the order they appear,
as a reader would paste them; the pages run side by side. A page that uses
a deprecated name of optax_lossscale fails: the docs show the current API
only. The multi-device page runs on 8 host CPU devices and the LLM stack's on
4, the others under JAX's defaults.
"""

from __future__ import annotations

import ast
import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

import optax_lossscale

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "optax_lossscale"
# Pages whose code needs several devices, and how many.
DEVICES = {"docs/multidevice.md": 8, "docs/guides/llm_stack.md": 4}
# Any DeprecationWarning that optax_lossscale gives is an error in a page.
NO_DEPRECATED = "error:`optax_lossscale.:DeprecationWarning"
# The pages test what their code does, not how fast it runs: less LLVM
# optimisation makes XLA:CPU compile about a quarter faster.
XLA_FLAGS = "--xla_backend_optimization_level=0"


def python_blocks(text: str) -> list[str]:
  """The ```python fenced blocks of a markdown page, in order."""
  return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def read(page: str) -> str:
  return (ROOT / page).read_text(encoding="utf-8")


def pages() -> list[str]:
  found = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").rglob("*.md")),
  ]
  return [
    str(p.relative_to(ROOT))
    for p in found
    if python_blocks(p.read_text(encoding="utf-8"))
  ]


def run_page(page: str, directory: pathlib.Path) -> subprocess.CompletedProcess:
  script = directory / "page.py"
  script.write_text("\n\n".join(python_blocks(read(page))), encoding="utf-8")
  env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=XLA_FLAGS)
  if page in DEVICES:
    env["XLA_FLAGS"] += (
      f" --xla_force_host_platform_device_count={DEVICES[page]}"
    )
  return subprocess.run(
    [sys.executable, "-W", NO_DEPRECATED, str(script)],
    env=env,
    cwd=directory,
    capture_output=True,
    text=True,
    timeout=600,
  )


@pytest.fixture(scope="module")
def page_runs(request, tmp_path_factory):
  """The runs of the pages this session tests, started together.

  As many run at once as there are CPUs (at least two): a page spends most
  of its time importing and compiling, on one core.
  """
  selected = [
    item.callspec.params["page"]
    for item in request.session.items
    if getattr(item, "function", None) is test_page_code_runs_in_order
  ]
  # The pages with the most code first, so that they do not start last.
  selected.sort(key=lambda page: -len(python_blocks(read(page))))
  workers = max(2, os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    yield {
      page: pool.submit(run_page, page, tmp_path_factory.mktemp("page"))
      for page in selected
    }
    pool.shutdown(cancel_futures=True)


def test_the_readme_and_the_guides_have_code_to_run():
  listed = pages()
  assert "README.md" in listed
  assert sum(p.startswith("docs/guides/") for p in listed) >= 5


# About 100 s of CPU for all pages (55 s of wall time on 2 cores): in the
# slow suite, which `.ci/run` runs beside `pytest`.
@pytest.mark.slow
@pytest.mark.parametrize("page", pages())
def test_page_code_runs_in_order(page, page_runs):
  result = page_runs[page].result()
  assert result.returncode == 0, f"{page}:\n{result.stdout}{result.stderr}"


def api_pages() -> dict[str, set[str]]:
  """Each reference page of docs/api/ and the names it documents."""
  return {
    page.stem: {
      line.removeprefix("::: optax_lossscale.").strip()
      for line in page.read_text(encoding="utf-8").splitlines()
      if line.startswith("::: optax_lossscale.")
    }
    for page in (ROOT / "docs" / "api").glob("*.md")
    if page.stem != "index"
  }


def test_the_api_reference_has_one_page_per_public_name():
  public = set(optax_lossscale.__all__) - {"__version__"}
  documented = api_pages()
  assert set(documented) == public | {"jmp"}
  for name in public:
    assert documented[name] == {name}
  nav = yaml.safe_load(read("mkdocs.yml"))["nav"]
  (reference,) = [
    item["API reference"] for item in nav if "API reference" in item
  ]
  listed = {path for item in reference for path in item.values()}
  assert listed == {"api/index.md"} | {f"api/{n}.md" for n in documented}


def test_the_api_index_names_each_deprecated_name_and_its_replacement():
  index = read("docs/api/index.md")
  deprecated = index.split("## Deprecated names")[1]
  for name in ("apply_gradients", "loss_scale_optimizer", "get_loss_scale"):
    assert f"`{name}(" in deprecated
  assert "`get(identifier)`" in deprecated
  assert (
    "`LossScaleOptimizer(inner, loss_scale).gradient_transformation()`"
    in (deprecated)
  )
  assert "`opt_state.loss_scale`" in deprecated


def test_contributing_lists_every_module_with_its_first_docstring_line():
  rows = dict(
    re.findall(r"^\| `([\w.]+\.py)` \| (.*) \|$", read("CONTRIBUTING.md"), re.M)
  )
  modules = sorted(p.name for p in PACKAGE.glob("*.py"))
  assert sorted(rows) == modules
  for name in modules:
    docstring = ast.get_docstring(ast.parse((PACKAGE / name).read_text()))
    if docstring is not None:
      assert rows[name] == docstring.splitlines()[0], name


def test_every_ratio_in_the_docs_is_one_a_benchmark_wrote():
  # No hand-typed figure: a ratio quoted in the README or a docs page is
  # one that a script in benchmarks/ wrote into its results file.
  written = "\n".join(
    p.read_text("utf-8") for p in (ROOT / "benchmarks").glob("*.md")
  )
  written_ratios = set(re.findall(r"\b\d+\.\d+x", written))
  generated = {"docs/real_text.md"}  # written whole by examples/real_text.py
  prose = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")]
  for page in ["README.md", *sorted(prose)]:
    if page in generated:
      continue
    quoted = set(re.findall(r"\b\d+\.\d+x", read(page)))
    assert quoted <= written_ratios, (page, sorted(quoted - written_ratios))
