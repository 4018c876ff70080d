"""float16 on a real model with real data: a byte-level GPT on Python's stdlib.

Run from the repository root:

    python examples/real_text.py            # the full run (docs/real_text.md)
    python examples/real_text.py --quick    # a short run, nothing written

The full run trains a small causal transformer six ways on the same batches
from the same initialisation, and writes the table into docs/real_text.md
(between marker comments) and the figure to docs/real_text.png. The data is
this Python's own standard library (`*.py` files, bytes), so nothing is
downloaded; the file list differs slightly between Python versions, so the
figures do too.

The mixed-precision recipe is the one users follow: float32 master weights,
compute (matmuls, activations) in float16 or bfloat16, and the loss, the
softmax and the LayerNorm statistics in float32. Each place the code makes
one of these choices says why.

This file is an example, not part of the package (the wheel ships only
`optax_lossscale/`); it uses the public API only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import os
import pathlib
import platform
import sysconfig
import tempfile
import textwrap
import time
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols
from optax_lossscale import jmp

VOCAB = 256  # bytes
BEGIN, END = "<!-- real_text:begin -->", "<!-- real_text:end -->"
# Named in the page's header beside jax and optax: the flax pattern (run 6)
# and the resume use them.
PACKAGES = ("flax", "orbax-checkpoint")


@dataclasses.dataclass(frozen=True)
class Config:
  """One experiment's sizes; `QUICK` and `FULL` below are the two we run."""

  layers: int = 2
  width: int = 128
  heads: int = 4
  seq_len: int = 128
  batch_size: int = 8
  steps: int = 320
  chunk: int = 5  # steps timed together; the runs take turns by chunks
  eval_every: int = 20
  eval_batches: int = 16
  # Adam with a linear warmup over the first tenth of the steps and a cosine
  # decay to a tenth of the peak: the usual transformer schedule. The decay
  # also settles the end of the run, where the runs are compared.
  learning_rate: float = 2e-3
  corpus_bytes: int = 4_000_000
  # The failure that loss scaling exists for: the loss of one micro-batch of
  # a step accumulated over `accumulation` micro-batches is its mean divided
  # by `accumulation` (as Megatron-LM and DeepSpeed normalise it), so each
  # token's gradient is that much smaller.
  accumulation: int = 1
  # The float16-LayerNorm mistake is run for this many steps, and the stop
  # rule set at `stop_after` consecutive skips.
  mistake_steps: int = 24
  stop_after: int = 8
  compile_rounds: int = 3
  # Which of RUNS to train (by index); run 3 (index 2) is the cost baseline.
  runs: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
  seed: int = 0


FULL = Config()
QUICK = Config(
  layers=1,
  width=64,
  heads=2,
  seq_len=64,
  batch_size=8,
  steps=40,
  eval_every=20,
  eval_batches=4,
  corpus_bytes=1_000_000,
  mistake_steps=12,
  stop_after=4,
  compile_rounds=1,
  runs=(0, 2, 3),
)


# --- data -------------------------------------------------------------------


def stdlib_files() -> list[pathlib.Path]:
  """This Python's standard-library sources, sorted; no installed packages."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages"}
  return sorted(
    (
      p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)
    ),
    key=lambda p: p.relative_to(root).as_posix(),
  )


def load_corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Bytes of the first files up to `max_bytes`: (train, held-out, files).

  Every tenth file is held out, so the split is by file (no window spans
  both) and deterministic for a given Python.
  """
  train, held_out, total = [], [], 0
  files = stdlib_files()
  used = 0
  for i, path in enumerate(files):
    data = path.read_bytes()
    if total + len(data) > max_bytes:
      break
    total += len(data)
    used += 1
    (held_out if i % 10 == 9 else train).append(data)
  as_array = lambda parts: np.frombuffer(b"".join(parts), np.uint8)  # noqa: E731
  return as_array(train), as_array(held_out), used


def windows(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  """`length + 1` bytes from each start, as int32: inputs and targets."""
  return data[starts[..., None] + np.arange(length + 1)].astype(np.int32)


def train_batches(data: np.ndarray, cfg: Config) -> np.ndarray:
  """(steps, batch, seq_len + 1) windows at random starts; one seed for all."""
  rng = np.random.default_rng(cfg.seed)
  starts = rng.integers(
    0, len(data) - cfg.seq_len - 1, (cfg.steps, cfg.batch_size)
  )
  return windows(data, starts, cfg.seq_len)


def eval_batches(data: np.ndarray, cfg: Config) -> np.ndarray:
  """Evenly spaced held-out windows, the same for every run."""
  n = cfg.eval_batches * cfg.batch_size
  starts = np.linspace(0, len(data) - cfg.seq_len - 2, n).astype(np.int64)
  return windows(data, starts, cfg.seq_len).reshape(
    cfg.eval_batches, cfg.batch_size, cfg.seq_len + 1
  )


# --- the model --------------------------------------------------------------


def init_params(key: jax.Array, cfg: Config) -> dict[str, Any]:
  """GPT-2's initialisation: normal(0.02), residual projections scaled down."""
  d = cfg.width
  keys = iter(jax.random.split(key, 3 + 4 * cfg.layers))

  def normal(shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(next(keys), shape, jnp.float32)

  def norm() -> dict[str, jax.Array]:
    return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

  residual = 0.02 / math.sqrt(2 * cfg.layers)
  blocks = [
    {
      "ln1": norm(),
      "qkv": normal((d, 3 * d), 0.02),
      "proj": normal((d, d), residual),
      "ln2": norm(),
      "up": normal((d, 4 * d), 0.02),
      "down": normal((4 * d, d), residual),
    }
    for _ in range(cfg.layers)
  ]
  return {
    "embed": normal((VOCAB, d), 0.02),
    "pos": normal((cfg.seq_len, d), 0.01),
    "blocks": blocks,
    "ln_f": norm(),
    "head": normal((d, VOCAB), 0.02),
  }


def layer_norm(x: jax.Array, p: Any, stats: Any) -> jax.Array:
  """LayerNorm whose mean and variance are computed in `stats`.

  In float32 (the recipe). In float16 (the mistake), the backward pass of
  `rsqrt(var + eps)` computes `rsqrt(var) / var`, which overflows float16
  (65504) once the variance is below about 6e-4: GPT-2's initialisation
  (embeddings of standard deviation 0.02, a variance of 4e-4) gets there at
  the first step, whatever the loss scale, so every step is skipped.
  """
  h = x.astype(stats)
  mean = jnp.mean(h, -1, keepdims=True)
  var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
  y = ((h - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)
  return y * p["scale"][None, None] + p["bias"][None, None]


def attention(x: jax.Array, p: Any, heads: int) -> jax.Array:
  b, t, d = x.shape
  q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
  q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
  # Queries scaled before the product, not the scores after it: in float16,
  # the unscaled scores of long sequences can overflow.
  scores = jnp.einsum("bthd,bshd->bhts", q * (d // heads) ** -0.5, k)
  # Softmax in float32: float16's exp and its sum over a long row lose the
  # small weights (and the row sum loses precision).
  scores = scores.astype(jnp.float32)
  causal = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(causal[None, None], scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
  out = jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, d)
  return out @ p["proj"]


def logits_fn(
  params: Any, tokens: jax.Array, cfg: Config, dtype: Any, stats: Any
) -> jax.Array:
  """The transformer, computed in `dtype` from float32 master weights."""
  # The master weights stay float32 (Adam's small updates would round away
  # in float16); each step computes with a `dtype` copy.
  p = jax.tree.map(lambda w: w.astype(dtype), params)
  x = p["embed"][tokens] + p["pos"][None, : tokens.shape[1]]
  for block in p["blocks"]:
    x = x + attention(layer_norm(x, block["ln1"], stats), block, cfg.heads)
    h = layer_norm(x, block["ln2"], stats) @ block["up"]
    x = x + jax.nn.gelu(h) @ block["down"]
  return layer_norm(x, p["ln_f"], stats) @ p["head"]


def make_loss(
  cfg: Config, dtype: Any, stats: Any = jnp.float32
) -> Callable[[Any, jax.Array], jax.Array]:
  """The mean next-byte cross-entropy (divided by `cfg.accumulation`)."""

  def loss(params: Any, batch: jax.Array) -> jax.Array:
    logits = logits_fn(params, batch[:, :-1], cfg, dtype, stats)
    # The loss in float32: a log-sum-exp over 256 classes and a mean over
    # thousands of tokens lose precision in float16. The cast's backward
    # pass still hands float16 cotangents to the network: that is where
    # small per-token gradients underflow.
    ce = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch[:, 1:]
    )
    return jnp.mean(ce) / cfg.accumulation

  return loss


def adam(cfg: Config) -> optax.GradientTransformation:
  """Adam with the warmup and cosine decay `Config.learning_rate` describes."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    cfg.learning_rate,
    warmup_steps=max(cfg.steps // 10, 1),
    decay_steps=cfg.steps,
    end_value=cfg.learning_rate / 10,
  )
  return optax.adam(schedule)


# --- six ways to take a step ------------------------------------------------
# Each factory returns (init(params) -> state, step(params, state, batch) ->
# (params, state, metrics)); metrics hold the loss, the scale and whether the
# step was applied.

Step = tuple[Callable[[Any], Any], Callable[..., Any]]


def plain(loss: Callable[..., jax.Array], tx: Any) -> Step:
  """No loss scaling (float32, bfloat16, and float16 unscaled)."""

  def step(params: Any, state: Any, batch: jax.Array) -> Any:
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    metrics = {"loss": value, "scale": jnp.ones(()), "applied": jnp.bool_(1)}
    return optax.apply_updates(params, updates), state, metrics

  return tx.init, step


def library(loss: Callable[..., jax.Array], tx: Any) -> Step:
  """This library: `LossScaleOptimizer.minimize` (it passes `value=`)."""
  opt = ols.LossScaleOptimizer(tx, ols.DynamicLossScale())

  def step(params: Any, state: Any, batch: jax.Array) -> Any:
    value, params, state = opt.minimize(loss, params, state, batch)
    scale = state.loss_scale()
    return params, state, {"loss": value, "scale": scale, "applied": state[2]}

  return opt.init, step


def jmp_pattern(loss: Callable[..., jax.Array], tx: Any) -> Step:
  """jmp's README pattern, with `optax_lossscale.jmp` as the jmp module."""

  def init(params: Any) -> Any:
    return tx.init(params), jmp.DynamicLossScale(jnp.float32(2**15))

  def step(params: Any, state: Any, batch: jax.Array) -> Any:
    opt_state, scale = state
    scaled = lambda p: scale.scale(loss(p, batch))  # noqa: E731
    value, grads = jax.value_and_grad(scaled)(params)
    grads = scale.unscale(grads)
    finite = jmp.all_finite(grads)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    params, opt_state = jmp.select_tree(
      finite,
      (optax.apply_updates(params, updates), new_opt_state),
      (params, opt_state),
    )
    new_scale = scale.adjust(finite)
    metrics = {
      "loss": scale.unscale(value),
      "scale": new_scale.loss_scale,
      "applied": finite,
    }
    return params, (opt_state, new_scale), metrics

  return init, step


def flax_pattern(loss: Callable[..., jax.Array], tx: Any) -> Step:
  """flax's `DynamicScale` pattern (its ImageNet example), defaults kept."""
  from flax.training.dynamic_scale import DynamicScale

  def init(params: Any) -> Any:
    scale = DynamicScale(fin_steps=jnp.int32(0), scale=jnp.float32(2**16))
    return tx.init(params), scale

  def step(params: Any, state: Any, batch: jax.Array) -> Any:
    opt_state, scale = state
    scale, finite, value, grads = scale.value_and_grad(loss)(params, batch)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    keep = functools.partial(jax.tree.map, functools.partial(jnp.where, finite))
    params = keep(optax.apply_updates(params, updates), params)
    opt_state = keep(new_opt_state, opt_state)
    metrics = {"loss": value, "scale": scale.scale, "applied": finite}
    return params, (opt_state, scale), metrics

  return init, step


def plain_in_one_cond(loss: Callable[..., jax.Array], tx: Any) -> Step:
  """Run 3's step with its update inside one `lax.cond`: compiled, not run.

  Nothing else: no scaling, no check of the gradients (the predicate is the
  loss's finiteness). What skipping with one conditional costs to compile
  on this backend, before loss scaling adds anything.
  """

  def step(params: Any, state: Any, batch: jax.Array) -> Any:
    value, grads = jax.value_and_grad(loss)(params, batch)

    def apply(params: Any, state: Any) -> Any:
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    finite = jnp.isfinite(value)
    params, state = jax.lax.cond(
      finite, apply, lambda p, s: (p, s), params, state
    )
    metrics = {"loss": value, "scale": jnp.ones(()), "applied": finite}
    return params, state, metrics

  return tx.init, step


RUNS = [
  ("float32", jnp.float32, plain),
  ("bfloat16", jnp.bfloat16, plain),
  ("float16, no scaling", jnp.float16, plain),
  ("float16, LossScaleOptimizer", jnp.float16, library),
  ("float16, jmp pattern", jnp.float16, jmp_pattern),
  ("float16, flax DynamicScale", jnp.float16, flax_pattern),
]
UNSCALED, OURS = 2, 3  # indices in RUNS: the cost baseline, this library
# Compiled in turns with the runs, under this key, and never trained.
COND_ONLY = ("float16, Adam in one lax.cond", jnp.float16, plain_in_one_cond)
COND_KEY = "cond"


# --- running them -----------------------------------------------------------


@dataclasses.dataclass
class Run:
  index: int  # in RUNS
  name: str
  step: Any  # the compiled, donating step
  params: Any
  state: Any
  metrics: list[Any] = dataclasses.field(default_factory=list)
  chunk_times: list[float] = dataclasses.field(default_factory=list)
  evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def find(runs: list[Run], index: int) -> Run:
  """The run of `RUNS[index]`."""
  return next(run for run in runs if run.index == index)


def compile_step(
  factory: Callable[..., Step], cfg: Config, dtype: Any, params: Any
) -> tuple[Callable[[Any], Any], Any, float]:
  """(init, the compiled step, seconds to trace, lower and compile it).

  A fresh loss and step each call, so nothing comes from JAX's caches.
  """
  start = time.perf_counter()
  init, step = factory(make_loss(cfg, dtype), adam(cfg))
  batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)
  state = jax.eval_shape(init, params)
  compiled = (
    jax.jit(step, donate_argnums=(0, 1)).lower(params, state, batch).compile()
  )
  return init, compiled, time.perf_counter() - start


@functools.cache
def _held_out_fn(cfg: Config) -> Any:
  """The held-out loss of float32 master weights, computed in float32."""
  loss = make_loss(dataclasses.replace(cfg, accumulation=1), jnp.float32)
  return jax.jit(
    lambda params, data: jnp.mean(
      jax.lax.map(functools.partial(loss, params), data)
    )
  )


def evaluate(params: Any, cfg: Config, data: jax.Array) -> float:
  return float(_held_out_fn(cfg)(params, data))


def train_in_turns(
  runs: list[Run],
  cfg: Config,
  batches: jax.Array,
  held_out: jax.Array,
  on_chunk: Callable[[int, Run], None] | None = None,
) -> None:
  """Trains every run on the same batches; they take turns chunk by chunk.

  Each chunk is timed on its own; the machine's load changes slowly against
  a chunk, so per-chunk ratios between runs are robust where absolute
  times are not.
  """
  for run in runs:
    run.evals.append((0, evaluate(run.params, cfg, held_out)))
  for start in range(0, cfg.steps, cfg.chunk):
    stop = min(start + cfg.chunk, cfg.steps)
    for run in runs:
      begin = time.perf_counter()
      for i in range(start, stop):
        run.params, run.state, m = run.step(run.params, run.state, batches[i])
        run.metrics.append(m)
      jax.block_until_ready((run.params, run.state))
      run.chunk_times.append(time.perf_counter() - begin)
      if on_chunk is not None:
        on_chunk(stop, run)
    if stop % cfg.eval_every == 0 or stop == cfg.steps:
      for run in runs:
        run.evals.append((stop, evaluate(run.params, cfg, held_out)))


def history(run: Run) -> dict[str, np.ndarray]:
  got = jax.device_get(run.metrics)
  return {k: np.asarray([m[k] for m in got]) for k in got[0]}


def main_runs(
  cfg: Config, batches: jax.Array, held_out: jax.Array, log: Callable[..., Any]
) -> tuple[list[Run], dict[str, Any]]:
  """The runs, compile times measured in turns, and the Orbax resume.

  The compile times are keyed by index in RUNS, and the conditional-only
  reference (compiled with them, never trained) by COND_KEY.
  """
  params0 = init_params(jax.random.PRNGKey(cfg.seed), cfg)
  keys: tuple[int | str, ...] = (*cfg.runs, COND_KEY)
  compile_times: dict[int | str, list[float]] = {i: [] for i in keys}
  runs: list[Run] = []
  for r in range(cfg.compile_rounds):
    for i in keys:
      name, dtype, factory = RUNS[i] if isinstance(i, int) else COND_ONLY
      init, step, seconds = compile_step(factory, cfg, dtype, params0)
      compile_times[i].append(seconds)
      if r == 0 and isinstance(i, int):
        params = jax.tree.map(jnp.copy, params0)
        runs.append(Run(i, name, step, params, init(params)))
      log(f"compiled {name}: {seconds:.1f} s")
  monitor = ols.SkipMonitor(
    max_consecutive_skips=cfg.stop_after,
    log=lambda report: log(f"{RUNS[OURS][0]}: {report}"),
  )
  middle = (cfg.steps // 2) // cfg.chunk * cfg.chunk
  checkpoint = tempfile.mkdtemp(prefix="real_text_")

  def on_chunk(stop: int, run: Run) -> None:
    if run.index == OURS:
      monitor(run.state)
      if stop == middle:
        save(f"{checkpoint}/mid", (run.params, run.state))
    if run is runs[0]:
      log(f"step {stop}/{cfg.steps}")

  train_in_turns(runs, cfg, batches, held_out, on_chunk)
  resumed = resume(find(runs, OURS), f"{checkpoint}/mid", middle, cfg, batches)
  compile_best = {i: min(t) for i, t in compile_times.items()}
  return runs, {"compile": compile_best, "resume": resumed, "middle": middle}


# --- checkpoint and resume --------------------------------------------------


def save(path: str, tree: Any) -> None:
  import orbax.checkpoint as ocp

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tree)
  checkpointer.wait_until_finished()  # before the next step donates `tree`


def resume(
  run: Run, path: str, middle: int, cfg: Config, batches: jax.Array
) -> bool:
  """Restores the mid-run checkpoint, continues, compares bit for bit."""
  import orbax.checkpoint as ocp

  abstract = jax.tree.map(
    ocp.utils.to_shape_dtype_struct, (run.params, run.state)
  )
  params, state = ocp.StandardCheckpointer().restore(path, abstract)
  ols.check_state(state)
  for i in range(middle, cfg.steps):
    params, state, _ = run.step(params, state, batches[i])
  same = jax.tree.map(
    lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
    (params, state),
    (run.params, run.state),
  )
  return all(jax.tree.leaves(same))


# --- the float16-LayerNorm mistake, caught ----------------------------------


def mistake(cfg: Config, batches: jax.Array) -> dict[str, Any]:
  """LayerNorm statistics in float16, under `SkipMonitor`.

  The monitor is read after every step; where it raises, the run would
  stop. This run carries on without it for `mistake_steps`, to show where
  the scale goes when nobody is watching.
  """
  params = init_params(jax.random.PRNGKey(cfg.seed), cfg)
  opt = ols.LossScaleOptimizer(adam(cfg), ols.DynamicLossScale())
  loss = make_loss(cfg, jnp.float16, stats=jnp.float16)
  step = jax.jit(
    lambda p, s, b: opt.minimize(loss, p, s, b), donate_argnums=(0, 1)
  )
  state = opt.init(params)
  monitor = ols.SkipMonitor(max_consecutive_skips=cfg.stop_after, log=None)
  scales, stopped_at, error = [], None, None
  for i in range(cfg.mistake_steps):
    _, params, state = step(params, state, batches[i])
    scales.append(float(state.loss_scale()))
    if error is None:
      try:
        monitor(state)
      except ols.ConsecutiveSkipsError as e:
        stopped_at, error = i + 1, e
  return {
    "scales": np.asarray(scales),
    "stopped_at": stopped_at,
    "error": error,
    "skipped": int(state.skipped_steps),
  }


# --- the failure that scaling exists for ------------------------------------


def underflow(cfg: Config, params: Any, batch: jax.Array) -> float:
  """Share of gradient entries non-zero in float32 and zero in float16."""
  g32 = jax.grad(make_loss(cfg, jnp.float32))(params, batch)
  g16 = jax.grad(make_loss(cfg, jnp.float16))(params, batch)
  pairs = zip(jax.tree.leaves(g32), jax.tree.leaves(g16), strict=True)
  lost = sum(int(jnp.sum((a != 0) & (b == 0))) for a, b in pairs)
  alive = sum(int(jnp.sum(a != 0)) for a in jax.tree.leaves(g32))
  return lost / alive


def failure_runs(
  cfg: Config, batches: jax.Array, held_out: jax.Array, log: Callable[..., Any]
) -> list[Run]:
  """float32, float16 unscaled and float16 with this library, at `cfg`."""
  params0 = init_params(jax.random.PRNGKey(cfg.seed), cfg)
  runs = []
  for i in (0, UNSCALED, OURS):
    name, dtype, factory = RUNS[i]
    init, step, _ = compile_step(factory, cfg, dtype, params0)
    params = jax.tree.map(jnp.copy, params0)
    runs.append(Run(i, name, step, params, init(params)))
  train_in_turns(runs, cfg, batches, held_out)
  log("failure configuration done")
  return runs


# --- report -----------------------------------------------------------------


def final_loss(run: Run) -> float:
  return run.evals[-1][1]


def step_ratio(run: Run, base: Run) -> float:
  """Median over chunks of the chunk's time against the baseline's."""
  times = np.asarray(run.chunk_times) / np.asarray(base.chunk_times)
  return float(np.median(times))


def summarize(
  runs: list[Run], extra: dict[str, Any], failure: list[Run] | None
) -> dict[str, Any]:
  base = find(runs, UNSCALED)
  rows = []
  for run in runs:
    h = history(run)
    i = run.index
    retries = int(run.state.retries) if i == OURS else 0
    rows.append(
      {
        "index": i,
        "name": run.name,
        "final": final_loss(run),
        "vs_f32": final_loss(run) / final_loss(find(runs, 0)),
        "step": step_ratio(run, base),
        "compile": extra["compile"][i] / extra["compile"][UNSCALED],
        "skipped": int(np.sum(~h["applied"].astype(bool))),
        "retries": retries,
        "scale_end": float(h["scale"][-1]),
        "scales": h["scale"],
      }
    )
  compiles = extra["compile"]
  summary = {
    "rows": rows,
    "resume": extra["resume"],
    "middle": extra["middle"],
    "cond_compile": compiles[COND_KEY] / compiles[UNSCALED],
  }
  if failure is not None:
    summary["failure"] = [
      {"name": r.name, "final": final_loss(r), "evals": r.evals}
      for r in failure
    ]
  return summary


def _table(rows: list[dict[str, Any]]) -> str:
  lines = [
    "| run | held-out loss | vs float32 | step time vs run 3 |"
    " compile vs run 3 | skipped | retries | final scale |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    scaled = r["index"] >= OURS
    scale = f"{r['scale_end']:g}" if scaled else "–"
    lines.append(
      f"| {r['index'] + 1}. {r['name']} | {r['final']:.4f} | {r['vs_f32']:.4f} |"
      f" {r['step']:.3f} | {r['compile']:.3f} | {r['skipped']} |"
      f" {r['retries']} | {scale} |"
    )
  return "\n".join(lines)


def report(
  cfg: Config,
  fail_cfg: Config,
  corpus: dict[str, Any],
  summary: dict[str, Any],
  caught: dict[str, Any],
  command: str,
  seconds: tuple[float, float],
) -> str:
  """The generated part of docs/real_text.md: every number in the page."""
  rows = summary["rows"]
  ours = next(r for r in rows if r["index"] == OURS)
  n_params = corpus["params"]
  lines = [
    _timing().header(command, packages=PACKAGES),
    "",
    f"{seconds[0] / 60:.1f} minutes in all, {seconds[1] / 60:.1f} minutes of"
    f" CPU time (what a quiet machine with {os.cpu_count()} cores needs,"
    f" divided by at most {os.cpu_count()}); load average"
    f" {corpus['load']:.1f} at the end.",
    "",
    f"Data: {corpus['files']} files of this Python's standard library"
    f" (Python {platform.python_version()}), {corpus['train']:,} bytes to"
    f" train on and {corpus['held_out']:,} held out (every tenth file).",
    f"Model: a causal transformer, {cfg.layers} layer(s), width"
    f" {cfg.width}, {cfg.heads} heads, {n_params:,} parameters;"
    f" {cfg.steps} steps of Adam (learning rate {cfg.learning_rate:g} after"
    f" a linear warmup over {max(cfg.steps // 10, 1)} steps, then a cosine"
    f" decay to a tenth of it) on batches of {cfg.batch_size} windows of"
    f" {cfg.seq_len} bytes, the same batches for every run. Held-out loss:"
    f" nats per byte, the float32 master weights evaluated in float32 on"
    f" {cfg.eval_batches * cfg.batch_size} held-out windows. Times are the"
    f" median over chunks of {cfg.chunk} steps of the ratio to run 3's chunk"
    " (the runs take turns, chunk by chunk, so load on the machine hits them"
    " alike), and the fastest of"
    f" {cfg.compile_rounds} compilation(s) in turns, against run 3's.",
    "",
    _table(rows),
    "",
    f"**Quality.** float16 with `LossScaleOptimizer` ends at"
    f" {ours['vs_f32']:.4f}× float32's held-out loss"
    f" ({(ours['vs_f32'] - 1) * 100:+.2f}%;"
    f" {_verdict(abs(ours['vs_f32'] - 1) <= 0.01)} within 1%).",
    *_bfloat16_text(rows),
    f"**Cost.** Its step costs {ours['step']:.3f}× run 3's, both donated"
    f" ({_verdict(ours['step'] <= 1.05)} at most 1.05×), and compiles in"
    f" {ours['compile']:.3f}× run 3's time"
    f" ({_verdict(ours['compile'] <= 1.10)} within 1.10×). Run 3's own step"
    " with its update inside one `lax.cond` on the loss's finiteness, and"
    f" nothing else, compiles in {summary['cond_compile']:.3f}× run 3's"
    " time: what the conditional alone costs to compile on this backend,"
    " before any loss scaling (it is compiled in turns with the runs, not"
    " trained).",
    f"**Resume.** Stopped at step {summary['middle']}, saved and restored"
    f" with Orbax (`StandardCheckpointer`), checked with `check_state`, and"
    f" continued to step {cfg.steps}: parameters and optimizer state"
    f" {'equal bit for bit' if summary['resume'] else 'DIFFERENT'} to the"
    " uninterrupted run's.",
  ]
  lines += ["", _failure_text(fail_cfg, corpus, summary.get("failure"))]
  lines += ["", _mistake_text(cfg, caught)]
  return "\n".join(lines)


def _bfloat16_text(rows: list[dict[str, Any]]) -> list[str]:
  bf16 = [r for r in rows if r["index"] == 1]
  if not bf16:
    return []
  return [
    f"bfloat16 compute (float32's range, so no scaling; fewer mantissa bits"
    f" than float16) ends at {bf16[0]['vs_f32']:.4f}× float32's held-out"
    " loss."
  ]


def _verdict(met: bool) -> str:
  return "meets the bar of" if met else "does NOT meet the bar of"


def _failure_text(
  cfg: Config, corpus: dict[str, Any], failure: list[dict[str, Any]] | None
) -> str:
  if failure is None:
    return "(The failure configuration was not run.)"
  f32, unscaled, ours = (r["final"] for r in failure)
  return (
    f"**The failure scaling exists for.** The same model, with the loss of"
    f" each micro-batch divided by {cfg.accumulation} (the normalisation of"
    f" a step accumulated over {cfg.accumulation} micro-batches; equivalently"
    f" a mean over {cfg.accumulation}× more tokens), {cfg.steps} steps. At"
    f" initialisation, {corpus['underflow'] * 100:.1f}% of the gradient"
    " entries that float32 computes as non-zero are exactly zero in float16"
    f" (with the loss undivided: {corpus['underflow_1'] * 100:.2f}%)."
    f" Held-out loss: float32 {f32:.4f}; float16 without scaling"
    f" {unscaled:.4f} ({(unscaled / f32 - 1) * 100:+.1f}%); float16 with"
    f" `LossScaleOptimizer` {ours:.4f} ({(ours / f32 - 1) * 100:+.2f}%)."
  )


def _mistake_text(cfg: Config, caught: dict[str, Any]) -> str:
  if caught["error"] is None:
    return "**The float16-LayerNorm mistake** was NOT caught."
  scales = caught["scales"]
  floor_step = int(np.argmax(scales <= 1.0)) + 1 if np.any(scales <= 1) else 0
  message = str(caught["error"])
  return (
    "**A failure the library catches.** LayerNorm statistics in float16,"
    " with `DynamicLossScale()` and"
    f" `SkipMonitor(max_consecutive_skips={cfg.stop_after})` read after every"
    f" step: every step overflows, and the run stops at step"
    f" {caught['stopped_at']} (the scale lowered to"
    f" {scales[caught['stopped_at'] - 1]:g}) with `ConsecutiveSkipsError`:"
    f"\n\n```text\n{textwrap.fill(message, 78)}\n```\n\n"
    f"Left running without the monitor, {caught['skipped']} of its"
    f" {cfg.mistake_steps} steps are skipped and the scale reaches"
    + (
      f" its floor, 1, at step {floor_step}."
      if floor_step
      else f" {scales[-1]:g} by step {cfg.mistake_steps}."
    )
  )


def plot(
  cfg: Config,
  summary: dict[str, Any],
  runs: list[Run],
  caught: dict[str, Any],
  path: str,
) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  styles = ["-", "-", "-", "--", ":", "-."]
  for run in runs:
    style = styles[run.index]
    # From the first evaluation after step 0: the start (ln 256 nats)
    # would flatten the end, where the runs differ.
    steps, losses = zip(*run.evals[1:], strict=True)
    axes[0].plot(steps, losses, style, label=run.name)
  for row in summary["rows"]:
    if row["index"] >= OURS:
      axes[1].plot(
        np.arange(1, cfg.steps + 1),
        row["scales"],
        styles[row["index"]],
        label=row["name"],
      )
  scales = caught["scales"]
  axes[1].plot(
    np.arange(1, len(scales) + 1),
    scales,
    "-",
    color="black",
    label="float16 LayerNorm (mistake)",
  )
  if caught["stopped_at"]:
    axes[1].axvline(
      caught["stopped_at"],
      color="tab:red",
      linestyle=":",
      label="SkipMonitor stops",
    )
  for r, style in zip(
    summary.get("failure") or [], ["-", "-", "--"], strict=False
  ):
    steps, losses = zip(*r["evals"][1:], strict=True)
    axes[2].plot(steps, losses, style, label=r["name"])
  axes[0].set(title="held-out loss (nats/byte)", xlabel="step")
  axes[1].set(title="loss scale", xlabel="step", xscale="log")
  axes[1].set_yscale("log", base=2)
  axes[2].set(
    title=f"loss / {FAILURE_ACCUMULATION}: held-out loss", xlabel="step"
  )
  for ax in axes:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=72)


@functools.cache
def _timing() -> types.ModuleType:
  """`benchmarks/_timing.py`, whose header every results file carries.

  Returns:
    The module, loaded from its file: it is not part of the package.
  """
  path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
  spec = importlib.util.spec_from_file_location("_timing", path / "_timing.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def write_page(page: pathlib.Path, text: str) -> None:
  """Replaces what lies between the page's marker comments with `text`."""
  old = page.read_text()
  head, rest = old.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  page.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def run_all(
  cfg: Config, fail_cfg: Config | None, log: Callable[..., Any] = print
) -> dict[str, Any]:
  """Everything the page reports, as a dict (the test reads it)."""
  train, held, files = load_corpus(cfg.corpus_bytes)
  batches = jnp.asarray(train_batches(train, cfg))
  held_out = jnp.asarray(eval_batches(held, cfg))
  runs, extra = main_runs(cfg, batches, held_out, log)
  caught = mistake(cfg, batches)
  log(f"mistake: stopped at {caught['stopped_at']}")
  failure = None
  corpus = {
    "files": files,
    "train": len(train),
    "held_out": len(held),
    "params": sum(x.size for x in jax.tree.leaves(runs[0].params)),
    "load": os.getloadavg()[0],
  }
  if fail_cfg is not None:
    fail_batches = jnp.asarray(train_batches(train, fail_cfg))
    params0 = init_params(jax.random.PRNGKey(fail_cfg.seed), fail_cfg)
    corpus["underflow"] = underflow(fail_cfg, params0, fail_batches[0])
    corpus["underflow_1"] = underflow(
      dataclasses.replace(fail_cfg, accumulation=1), params0, fail_batches[0]
    )
    fail_held = jnp.asarray(eval_batches(held, fail_cfg))
    failure = failure_runs(fail_cfg, fail_batches, fail_held, log)
  summary = summarize(runs, extra, failure)
  return {
    "runs": runs,
    "summary": summary,
    "caught": caught,
    "corpus": corpus,
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a short run")
  parser.add_argument("--docs", default="docs", help="where the page lives")
  args = parser.parse_args(argv)
  cfg = QUICK if args.quick else FULL
  fail_cfg = dataclasses.replace(
    cfg, accumulation=FAILURE_ACCUMULATION, steps=cfg.steps // 4
  )
  _timing()  # loaded now, it reads the header's load average before the runs
  start, cpu = time.perf_counter(), time.process_time()
  result = run_all(cfg, fail_cfg)
  seconds = (time.perf_counter() - start, time.process_time() - cpu)
  command = _timing().command_line(None if argv is None else [__file__, *argv])
  text = report(
    cfg,
    fail_cfg,
    result["corpus"],
    result["summary"],
    result["caught"],
    command,
    seconds,
  )
  print(text)
  if not args.quick:
    docs = pathlib.Path(args.docs)
    write_page(docs / "real_text.md", text)
    plot(
      cfg,
      result["summary"],
      result["runs"],
      result["caught"],
      str(docs / "real_text.png"),
    )


# The failure configuration's loss divisor: a mean over this many times the
# tokens of a batch (with the full run's 1,024 tokens a micro-batch, about a
# million tokens; GPT-3 trained on batches of 3.2 million).
FAILURE_ACCUMULATION = 1024


if __name__ == "__main__":
  main()
