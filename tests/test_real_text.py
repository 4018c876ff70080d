"""The real-text example, short: float16 with scaling matches float32, and
the float16-LayerNorm mistake is stopped.

The full run (`python examples/real_text.py`, docs/real_text.md) is the same
code at a larger size, with every run, the compile times and an Orbax resume
(`test_integrations.py` resumes mid-run bit for bit); this test asserts
results, never times.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols

pytest.importorskip("flax")

pytestmark = pytest.mark.usefixtures("standard_promotion")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def real_text():
  spec = importlib.util.spec_from_file_location(
    "real_text", EXAMPLE / "real_text.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules["real_text"] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  yield module
  del sys.modules["real_text"]


@pytest.fixture(scope="module")
def corpus(real_text):
  """The quick configuration's training and held-out bytes."""
  train, held_out, used = real_text.load_corpus(real_text.QUICK.corpus_bytes)
  return train, held_out, used


def test_the_corpus_is_this_pythons_stdlib_sorted_and_split_by_file(
  real_text, corpus
):
  files = real_text.stdlib_files()
  assert files == sorted(files, key=lambda p: p.as_posix())
  assert not any("site-packages" in p.parts for p in files)
  train, held_out, used = corpus
  assert 0 < len(train) + len(held_out) <= real_text.QUICK.corpus_bytes
  assert used >= 10
  expected = b"".join(f.read_bytes() for f in files[:used][9::10])
  assert held_out.tobytes() == expected


@pytest.mark.slow  # run by `.ci/run` beside the suite
def test_float16_with_scaling_matches_float32_and_the_mistake_is_stopped(
  real_text, corpus
):
  rt, cfg = real_text, real_text.QUICK
  train, held_out, _ = corpus
  batches = jnp.asarray(rt.train_batches(train, cfg))
  held_out = jnp.asarray(rt.eval_batches(held_out, cfg))
  params0 = rt.init_params(jax.random.PRNGKey(cfg.seed), cfg)
  runs = []
  for i in (0, rt.OURS):  # float32, and float16 with LossScaleOptimizer
    name, dtype, factory = rt.RUNS[i]
    init, step, _ = rt.compile_step(factory, cfg, dtype, params0)
    params = jax.tree.map(jnp.copy, params0)
    runs.append(rt.Run(i, name, step, params, init(params)))
  rt.train_in_turns(runs, cfg, batches, held_out)
  f32, ours = map(rt.final_loss, runs)
  assert abs(ours / f32 - 1) <= 0.01, (ours, f32)  # within 1%

  # The float16-LayerNorm mistake: every step overflows, and SkipMonitor
  # stops the run at its limit, naming the first block's LayerNorm.
  caught = rt.mistake(cfg, batches)
  assert isinstance(caught["error"], ols.ConsecutiveSkipsError)
  assert caught["stopped_at"] == cfg.stop_after
  assert caught["skipped"] == cfg.mistake_steps
  assert np.all(np.diff(caught["scales"]) < 0)  # halved at every step
  message, named = str(caught["error"]), caught["error"].report.nonfinite
  for leaf in ("['blocks'][0]['ln1']['scale']", "['embed']", "['pos']"):
    assert leaf in named
  assert "['head']" not in named  # after the last LayerNorm: finite
  assert f"{len(named)} leaves: {named[0]}, " in message  # the first named
  assert "float32" in message  # the likely fix
