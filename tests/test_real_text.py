"""The real-text example, short: float16 with scaling matches float32, the
float16-LayerNorm mistake is stopped, and an Orbax resume is bit for bit.

The full run (`python examples/real_text.py`, docs/real_text.md) is the same
code at a larger size; this test asserts results, never times.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

import optax_lossscale as ols

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")

pytestmark = pytest.mark.usefixtures("standard_promotion")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load_example():
  spec = importlib.util.spec_from_file_location(
    "real_text", EXAMPLE / "real_text.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules["real_text"] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def real_text():
  return _load_example()


def test_the_corpus_is_this_pythons_stdlib_sorted_and_split_by_file(
  real_text,
):
  files = real_text.stdlib_files()
  assert files == sorted(files, key=lambda p: p.as_posix())
  assert not any("site-packages" in p.parts for p in files)
  train, held_out, used = real_text.load_corpus(200_000)
  assert 0 < len(train) + len(held_out) <= 200_000 and used >= 10
  expected = b"".join(f.read_bytes() for f in files[:used][9::10])
  assert held_out.tobytes() == expected


def test_float16_with_scaling_matches_float32_and_the_mistake_is_stopped(
  real_text,
):
  cfg = real_text.QUICK
  result = real_text.run_all(cfg, None, log=lambda *args: None)
  rows = {r["index"]: r for r in result["summary"]["rows"]}
  assert set(rows) == set(cfg.runs)
  ours = rows[real_text.OURS]
  # Quality: float16 with LossScaleOptimizer within 1% of float32.
  assert abs(ours["vs_f32"] - 1) <= 0.01, ours["vs_f32"]
  # Resume: stopped mid-run, restored with Orbax, continued bit for bit.
  assert result["summary"]["resume"] is True
  # The conditional-only reference was compiled (its ratio is reported).
  assert np.isfinite(result["summary"]["cond_compile"])
  # The float16-LayerNorm mistake: every step overflows, and SkipMonitor
  # stops the run at its limit, naming the first block's LayerNorm.
  caught = result["caught"]
  assert isinstance(caught["error"], ols.ConsecutiveSkipsError)
  assert caught["stopped_at"] == cfg.stop_after
  assert caught["skipped"] == cfg.mistake_steps
  assert np.all(np.diff(caught["scales"]) < 0)  # halved at every step
  message = str(caught["error"])
  for leaf in ("['blocks'][0]['ln1']['scale']", "['embed']", "['pos']"):
    assert leaf in message
  assert "['head']" not in message  # after the last LayerNorm: finite
  assert "float32" in message  # the likely fix


def test_the_loss_divisor_underflows_float16_gradients(real_text):
  cfg = dataclasses.replace(real_text.QUICK, accumulation=1024)
  train, _, _ = real_text.load_corpus(cfg.corpus_bytes)
  batch = real_text.train_batches(train, cfg)[0]
  params = real_text.init_params(real_text.jax.random.PRNGKey(0), cfg)
  divided = real_text.underflow(cfg, params, batch)
  plain = real_text.underflow(
    dataclasses.replace(cfg, accumulation=1), params, batch
  )
  assert divided > 0.1 and plain < 0.01
