"""A whole float16 train step on a small transformer, with and without scaling.

Usage: python benchmarks/train_step.py [--quick]

Forward, backward and Adam update of a 12-block transformer (float32 master
weights, float16 compute), jitted with parameters and optimizer state donated,
in six configurations: plain Adam, `scaled_value_and_grad` with
`apply_gradients`, `minimize` without and with retries, jmp and the flax
`DynamicScale` pattern. Measures compile time, temp memory and step time, and
the cost of a step whose first attempt overflows and is retried. Prints the
figures and writes benchmarks/TRAIN_STEP.md.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

LAYERS, D_MODEL, HEADS, SEQ, BATCH, VOCAB = 12, 128, 4, 64, 8, 256
SCALE = 2.0**10
MAX_RETRIES = 4
LR = 1e-3
OUT = pathlib.Path(__file__).with_name("TRAIN_STEP.md")
REFERENCE = "scaled_value_and_grad + apply_gradients"
PLAIN = "plain adam"

Step = Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]]


def _dense(key: jax.Array, n_in: int, n_out: int) -> jax.Array:
  return jax.random.normal(key, (n_in, n_out), jnp.float32) / np.sqrt(n_in)


def _block_params(key: jax.Array) -> dict[str, jax.Array]:
  """One block: attention q/k/v/o, two layernorms, a two-layer MLP."""
  kq, kk, kv, ko, k1, k2 = jax.random.split(key, 6)
  d, h = D_MODEL, 4 * D_MODEL
  ones, zeros = jnp.ones(d), jnp.zeros(d)
  return {
    "wq": _dense(kq, d, d),
    "wk": _dense(kk, d, d),
    "wv": _dense(kv, d, d),
    "wo": _dense(ko, d, d),
    "ln1_scale": ones,
    "ln1_bias": zeros,
    "ln2_scale": ones + 0.0,
    "ln2_bias": zeros + 0.0,
    "w1": _dense(k1, d, h),
    "b1": jnp.zeros(h),
    "w2": _dense(k2, h, d),
    "b2": jnp.zeros(d),
  }


def init_params(key: jax.Array) -> dict[str, Any]:
  """float32 master weights: embeddings, `LAYERS` blocks, head."""
  keys = jax.random.split(key, LAYERS + 3)
  return {
    "embed": jax.random.normal(keys[0], (VOCAB, D_MODEL)) * 0.02,
    "pos": jax.random.normal(keys[1], (SEQ, D_MODEL)) * 0.02,
    "blocks": [_block_params(k) for k in keys[3:]],
    "ln_scale": jnp.ones(D_MODEL),
    "ln_bias": jnp.zeros(D_MODEL),
    "head": _dense(keys[2], D_MODEL, VOCAB),
  }


def _layernorm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
  """Statistics in float32, result in float16."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
  return (y.astype(x.dtype) * scale) + bias


def _attention(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """Causal multi-head self-attention."""
  b, s, d = x.shape
  split = lambda w: (x @ w).reshape(b, s, HEADS, d // HEADS)  # noqa: E731
  q, k, v = split(p["wq"]), split(p["wk"]), split(p["wv"])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
  mask = jnp.tril(jnp.ones((s, s), bool))
  logits = jnp.where(mask, logits, jnp.asarray(-1e4, logits.dtype))
  weights = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
  return out @ p["wo"]


def _block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  x = x + _attention(p, _layernorm(x, p["ln1_scale"], p["ln1_bias"]))
  h = _layernorm(x, p["ln2_scale"], p["ln2_bias"])
  return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
  """Next-token cross-entropy (float32) of a float16 forward pass."""
  p = jax.tree.map(lambda w: w.astype(jnp.float16), params)
  x = p["embed"][batch["tokens"]] + p["pos"]
  for block in p["blocks"]:
    x = _block(block, x)
  logits = _layernorm(x, p["ln_scale"], p["ln_bias"]) @ p["head"]
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), batch["targets"]
  ).mean()


def make_batch(key: jax.Array) -> dict[str, jax.Array]:
  tokens = jax.random.randint(key, (BATCH, SEQ + 1), 0, VOCAB)
  return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


# Configurations: each returns `(init, step)`, `init(params) -> opt_state`
# and `step(params, opt_state, batch) -> (params, opt_state, loss)`.


def config_plain(lr: float = LR) -> tuple[Callable[[Any], Any], Step]:
  """`optax.adam` without loss scaling."""
  tx = optax.adam(lr)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return tx.init, step


def _loss_scale_optimizer(lr: float) -> ols.LossScaleOptimizer:
  return ols.LossScaleOptimizer(optax.adam(lr), ols.DynamicLossScale(SCALE))


def config_apply_gradients(
  lr: float = LR,
) -> tuple[Callable[[Any], Any], Step]:
  """`ols.scaled_value_and_grad`, then `apply_gradients`."""
  tx = _loss_scale_optimizer(lr)

  def step(params, state, batch):
    loss, grads = ols.scaled_value_and_grad(loss_fn)(state, params, batch)
    params, state = tx.apply_gradients(grads, state, params, value=loss)
    return params, state, loss

  return tx.init, step


def config_minimize(
  max_retries: int, lr: float = LR
) -> tuple[Callable[[Any], Any], Step]:
  """`LossScaleOptimizer.minimize` with `max_retries`."""
  tx = _loss_scale_optimizer(lr)

  def step(params, state, batch):
    loss, params, state = tx.minimize(
      loss_fn, params, state, batch, max_retries=max_retries
    )
    return params, state, loss

  return tx.init, step


def config_jmp(lr: float = LR) -> tuple[Callable[[Any], Any], Step]:
  """jmp: scale, grad, unscale, `all_finite`, `select_tree`, `adjust`."""
  import jmp

  tx = optax.adam(lr)

  def init(params):
    # jmp's loss scale is carried as its arrays: a `jmp.DynamicLossScale` in
    # the inputs or outputs of `jax.jit(...).lower` raises a TypeError.
    return tx.init(params), (jnp.float32(SCALE), jnp.int32(0))

  def step(params, state, batch):
    opt_state, (scale, counter) = state
    loss_scale = jmp.DynamicLossScale(scale, counter)
    scaled = lambda p: loss_scale.scale(loss_fn(p, batch))  # noqa: E731
    loss, grads = jax.value_and_grad(scaled)(params)
    loss, grads = loss_scale.unscale((loss, grads))
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = jmp.select_tree(finite, new_params, params)
    opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
    return (
      params,
      (opt_state, (loss_scale.loss_scale, loss_scale.counter)),
      loss,
    )

  return init, step


def config_flax(lr: float = LR) -> tuple[Callable[[Any], Any], Step]:
  """flax `DynamicScale.value_and_grad`, then `jnp.where` on every leaf."""
  from flax.training.dynamic_scale import DynamicScale

  tx = optax.adam(lr)

  def init(params):
    scale = DynamicScale(fin_steps=jnp.int32(0), scale=jnp.float32(SCALE))
    return tx.init(params), scale

  def step(params, state, batch):
    opt_state, dyn_scale = state
    dyn_scale, is_fin, loss, grads = dyn_scale.value_and_grad(loss_fn)(
      params, batch
    )
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    sel = lambda new, old: jnp.where(is_fin, new, old)  # noqa: E731
    params = jax.tree.map(sel, new_params, params)
    opt_state = jax.tree.map(sel, new_opt_state, opt_state)
    return params, (opt_state, dyn_scale), loss

  return init, step


CONFIGS: dict[str, Callable[..., tuple[Callable[[Any], Any], Step]]] = {
  PLAIN: config_plain,
  REFERENCE: config_apply_gradients,
  "minimize, max_retries=0": lambda lr=LR: config_minimize(0, lr),
  f"minimize, max_retries={MAX_RETRIES}": (
    lambda lr=LR: config_minimize(MAX_RETRIES, lr)
  ),
  "jmp select_tree": config_jmp,
  "flax DynamicScale pattern": config_flax,
}
RETRY_CONFIG = f"minimize, max_retries={MAX_RETRIES}"
PEERS = ("jmp select_tree", "flax DynamicScale pattern")


def compile_time(name: str, params: Any, batch: Any, lr: float) -> float:
  """Seconds to compile `name`'s step with Adam's learning rate `lr`.

  Each `lr` gives another program, so each compile is a first compile
  (JAX serves a repeated one from its cache).
  """
  init, step = CONFIGS[name](lr)
  s = init(params)
  t0 = time.perf_counter()
  jax.jit(step, donate_argnums=(0, 1)).lower(params, s, batch).compile()
  return time.perf_counter() - t0


def overflow_scale(params: Any, batch: Any) -> float:
  """The smallest power of 2 at which the float16 gradients overflow."""

  @jax.jit
  def finite(scale):
    grads = jax.grad(lambda p: loss_fn(p, batch) * scale)(params)
    return ols.all_finite(grads)

  for k in range(64):
    if not bool(finite(jnp.float32(2.0**k))):
      if not bool(finite(jnp.float32(2.0 ** (k - 1)))) or k < 1:
        raise RuntimeError(f"float16 gradients overflow at 2**{k - 1} too.")
      return 2.0**k
  raise RuntimeError("float16 gradients never overflow below 2**64.")


def prepare(name: str, params: Any, batch: Any) -> dict[str, Any]:
  """Compiles one configuration (timed) and runs one step."""
  init, step = CONFIGS[name]()
  p = jax.tree.map(jnp.copy, params)
  s = init(p)
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, batch).compile()
  compile_s = time.perf_counter() - t0
  p, s, loss = compiled(p, s, batch)
  if not np.isfinite(float(loss)):
    raise RuntimeError(f"{name}: non-finite loss {float(loss)}.")
  return dict(
    name=name,
    compiled=compiled,
    state=(p, s),
    compiles=[compile_s],
    temp=compiled.memory_analysis().temp_size_in_bytes,
    medians=[],
  )


def time_steps(run: dict[str, Any], batch: Any, steps: int) -> float:
  """The median time of `steps` donated steps, fed back into each other."""
  p, s = run["state"]
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    p, s, loss = run["compiled"](p, s, batch)
    jax.block_until_ready((p, s, loss))
    times.append(time.perf_counter() - t0)
  run["state"] = (p, s)
  return statistics.median(times)


def _with_scale(state: ols.LossScaleOptimizerState, scale: float) -> Any:
  """`state` with its loss scale set to `scale` (same static config)."""
  loss_scale = ols.DynamicLossScale(
    SCALE,
    current_loss_scale=jnp.asarray(scale, jnp.float32),
    num_good_steps=jnp.zeros((), jnp.int32),
  )
  return state._replace(loss_scale=loss_scale)


def step_at_scale(run: dict[str, Any], batch: Any, scale: float):
  """One step from a copy of `run`'s state at loss scale `scale`.

  Returns the step's time and how many retries it made.
  """
  p, s = jax.tree.map(jnp.copy, run["state"])
  s = _with_scale(s, scale)
  jax.block_until_ready((p, s))
  t0 = time.perf_counter()
  _, s, loss = run["compiled"](p, s, batch)
  jax.block_until_ready((s, loss))
  elapsed = time.perf_counter() - t0
  if int(s.skipped_steps) != int(run["state"][1].skipped_steps):
    raise RuntimeError(f"the step at scale {scale} was skipped.")
  return elapsed, int(s.retries) - int(run["state"][1].retries)


def retry_scale(run: dict[str, Any], batch: Any, guess: float) -> float:
  """The lowest power of 2 at which the step retries exactly once."""
  for k in range(1, 64):
    if step_at_scale(run, batch, 2.0**k)[1] == 1:
      return 2.0**k
  raise RuntimeError(f"no scale overflows exactly once (guess {guess}).")


def time_retry(run: dict[str, Any], batch: Any, guess: float, args) -> float:
  """Median over rounds of (overflow-once step) / (normal step) time."""
  over = retry_scale(run, batch, guess)
  print(f"one retry at 2**{int(np.log2(over))}")
  retry, normal = [], []
  for _ in range(args.rounds):
    for scale, times, expected in ((over, retry, 1), (SCALE, normal, 0)):
      steps = [step_at_scale(run, batch, scale) for _ in range(args.steps)]
      if any(n != expected for _, n in steps):
        raise RuntimeError(f"retries at scale {scale}: {steps}.")
      times.append(statistics.median(t for t, _ in steps))
  return statistics.median(retry) / statistics.median(normal)


def _ratio(a: float, b: float) -> str:
  return f"{a / b:.2f}x" if b > 0 else "-"


def markdown(runs: dict[str, dict[str, Any]], retry: float, cmd: str) -> str:
  """The ratios against the reference configuration and plain Adam."""
  ref, plain = runs[REFERENCE], runs[PLAIN]
  lines = [
    "# train_step results",
    "",
    f"jax {jax.__version__}, optax {optax.__version__}, {jax.default_backend()}",
    "",
    f"Reproduce: `{cmd}`",
    "",
    f"Ratios against `{REFERENCE}` (ref) and `{PLAIN}` (adam). Compile:"
    " the median of several first compiles for all but the peers (jmp, flax),"
    " which compile once.",
    "",
    "| configuration | step vs ref | step vs adam | compile vs ref"
    " | compile vs adam | temp memory vs ref | temp memory vs adam |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, r in runs.items():
    cells = [name]
    for key in ("step", "compile", "temp"):
      cells += [_ratio(r[key], ref[key]), _ratio(r[key], plain[key])]
    lines.append("| " + " | ".join(cells) + " |")
  lines += [
    "",
    f"One retry (`minimize`, `max_retries={MAX_RETRIES}`, first attempt"
    f" overflows) vs a normal step of the same: {retry:.2f}x",
    "",
  ]
  return "\n".join(lines)


def print_runs(runs: dict[str, dict[str, Any]]) -> None:
  print(f"{'configuration':42} {'step ms':>8} {'compile s':>9} {'temp MiB':>8}")
  for name, r in runs.items():
    print(
      f"{name:42} {r['step'] * 1e3:8.2f} {r['compile']:9.2f}"
      f" {r['temp'] / 2**20:8.1f}"
    )


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a smoke run")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--steps", type=int, default=None)
  args = parser.parse_args()
  args.rounds = args.rounds or (2 if args.quick else 5)
  args.steps = args.steps or (3 if args.quick else 10)
  args.compiles = 1 if args.quick else 3
  return args


def main() -> None:
  args = parse_args()
  params = init_params(jax.random.key(0))
  batch = make_batch(jax.random.key(1))
  leaves = jax.tree.leaves(params)
  print(f"{len(leaves)} leaves, {sum(x.size for x in leaves):,} parameters")
  over = overflow_scale(params, batch)
  if over <= 2 * SCALE:
    raise RuntimeError(f"gradients overflow at {over}, SCALE={SCALE} is high.")
  print(f"float16 gradients overflow at 2**{int(np.log2(over))}")
  runs = {}
  for name in CONFIGS:
    runs[name] = prepare(name, params, batch)
    print(f"compiled {name} in {runs[name]['compiles'][0]:.1f} s", flush=True)
  # More first compiles of ours and plain Adam, in turns (the peers compile
  # once: jmp alone takes minutes).
  for k in range(1, args.compiles):
    for name, run in runs.items():
      if name not in PEERS:
        run["compiles"].append(compile_time(name, params, batch, LR * (1 + k)))
  for run in runs.values():
    run["compile"] = statistics.median(run["compiles"])
  for _ in range(args.rounds):
    for run in runs.values():
      run["medians"].append(time_steps(run, batch, args.steps))
  for run in runs.values():
    run["step"] = statistics.median(run["medians"])
  retry = time_retry(runs[RETRY_CONFIG], batch, over, args)
  print_runs(runs)
  print(f"retry step vs normal step: {retry:.2f}x")
  cmd = "python benchmarks/train_step.py" + (" --quick" if args.quick else "")
  OUT.write_text(markdown(runs, retry, cmd))
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main()
