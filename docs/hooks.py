"""MkDocs hook: every public name (and every name of `optax_lossscale.jmp`) has
a reference page."""

from __future__ import annotations

import pathlib
from typing import Any

from mkdocs.exceptions import PluginError


def on_config(config: Any) -> Any:
  import optax_lossscale
  from optax_lossscale import jmp

  docs = pathlib.Path(config["docs_dir"])
  documented = set()
  for page in (docs / "api").glob("*.md"):
    for line in page.read_text().splitlines():
      if line.startswith("::: optax_lossscale."):
        documented.add(line.removeprefix("::: optax_lossscale.").strip())
  public = set(optax_lossscale.__all__) - {"__version__"}
  public |= {f"jmp.{name}" for name in jmp.__all__}
  missing = sorted(public - documented)
  if missing:
    raise PluginError(f"No API reference page for {missing}: add docs/api/.")
  return config
