"""The first compile of a whole float16 train step: Optax, a floor, ours.

Usage: python benchmarks/whole_step.py [--quick] [--layers N] [--compiles N]
         [--out PATH]

Times the first compile (lower and compile, parameters and optimizer state
donated) of a whole train step of the GPT-shaped `_model.Transformer`
(4 layers of width 256 by default, `--layers 12` for GPT-2 small's depth;
float32 master weights, float16 compute, the loss in float32), three ways:

- `plain`: Optax's `chain(clip_by_global_norm(1), adamw(1e-3))`:
  `jax.value_and_grad(loss)`, `tx.update`, `optax.apply_updates`, the
  gradients' global norm returned (logged). The baseline, 1.00x.
- `floor`: a loss-scaled step written by hand with one conditional: the
  gradient of `loss * scale` (a float32 scale carried in the state),
  unscaled by the scale's reciprocal, their global norm, the clip factor
  `where(norm < 1, 1, 1 / norm)` folded into the unscaling, then one
  `lax.cond(isfinite(norm), ...)` around `adamw(1e-3)`'s update and
  `apply_updates`, the scale halved on a non-finite norm; the norm returned.
  What any loss-scaled, clipped, skipping step pays to compile.
- `ours`: `LossScaleOptimizer(adamw(1e-3), DynamicLossScale(2**15),
  max_norm=1.0).minimize`, `state.grad_norm` returned.

Each compile is of a fresh program (a new function object and a learning
rate a millionth apart, the persistent cache off), `--compiles` of each
(default 9), the configurations in turns in one process, the order rotated
each round. Writes benchmarks/WHOLE_STEP.md: each configuration's median
ratio to `plain`'s compile in the same round and their range, the seconds,
and the library's own cost over the floor (`ours - floor`). `--quick`: one
compile each of a 1-layer, width-64 model (`--out` a file, or a folder to
write WHOLE_STEP.md into).
"""

from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Callable
from typing import Any

import _model
import _timing
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

OUT = pathlib.Path(__file__).with_name("WHOLE_STEP.md")
LR = 1e-3
SCALE = 2.0**15
MAX_NORM = 1.0
WIDTH, QUICK_WIDTH = 256, 64
LAYERS, QUICK_LAYERS = 4, 1

Loss = Callable[[Any, Any], jax.Array]
# step(params, state, batch) -> (params, state, loss, grad_norm)
Config = Callable[
  [Loss, float], tuple[Callable[[Any], Any], Callable[..., Any]]
]


def plain(loss_fn: Loss, lr: float) -> Any:
  """Optax's clipped AdamW on unscaled gradients, their norm returned."""
  tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(lr))

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    # `optax.global_norm` is `optax.tree.norm` with a DeprecationWarning.
    norm = optax.tree.norm(grads)
    return optax.apply_updates(params, updates), state, loss, norm

  return tx.init, step


def floor(loss_fn: Loss, lr: float) -> Any:
  """A loss-scaled, clipped AdamW step by hand, with one `lax.cond`."""
  tx = optax.adamw(lr)

  def init(params):
    return tx.init(params), jnp.float32(SCALE)

  def step(params, state, batch):
    inner, scale = state
    scaled = lambda p: loss_fn(p, batch) * scale  # noqa: E731
    scaled_loss, grads = jax.value_and_grad(scaled)(params)
    inverse = 1 / scale
    norm = optax.tree.norm(jax.tree.map(lambda g: g * inverse, grads))
    # The clip folded into the unscaling: one multiply per leaf.
    factor = inverse * jnp.where(norm < MAX_NORM, 1.0, MAX_NORM / norm)

    def apply(params, inner, scale):
      unscaled = jax.tree.map(lambda g: g * factor, grads)
      updates, inner = tx.update(unscaled, inner, params)
      return optax.apply_updates(params, updates), inner, scale

    def skip(params, inner, scale):
      return params, inner, scale / 2

    params, inner, scale = jax.lax.cond(
      jnp.isfinite(norm), apply, skip, params, inner, scale
    )
    return params, (inner, scale), scaled_loss * inverse, norm

  return init, step


def ours(loss_fn: Loss, lr: float) -> Any:
  """`LossScaleOptimizer(...).minimize`, `state.grad_norm` returned."""
  tx = ols.LossScaleOptimizer(
    optax.adamw(lr), ols.DynamicLossScale(SCALE), max_norm=MAX_NORM
  )

  def step(params, state, batch):
    loss, params, state = tx.minimize(loss_fn, params, state, batch)
    return params, state, loss, state.grad_norm

  return tx.init, step


CONFIGS: dict[str, Config] = {"plain": plain, "floor": floor, "ours": ours}
OWN_COST = "ours - floor: the library's own cost"


def measure(
  model: _model.Transformer, compiles: int
) -> tuple[dict[str, list[float]], dict[str, tuple[float, float]]]:
  """First compiles of every configuration, in turns, the order rotated.

  Returns:
    `(seconds, checks)`: each configuration's compile times, one per round;
    and the loss and gradient norm its last compiled step returned on the
    model's parameters and batch (a check that each step runs).
  """
  params = model.init_params(jax.random.key(0))
  batch = model.make_batch(jax.random.key(1))
  # One compile first, discarded: the process's one-time costs.
  _timing.compile_model_step(plain, model, params, batch, 0.5 * LR)
  names = list(CONFIGS)
  seconds: dict[str, list[float]] = {name: [] for name in names}
  last: dict[str, Any] = {}
  for k in range(compiles):
    # A learning rate a millionth apart each round: a constant of its own.
    lr = LR * (1 + (k + 1) * 1e-6)
    for name in names[k % len(names) :] + names[: k % len(names)]:
      compiled, s, carry = _timing.compile_model_step(
        CONFIGS[name], model, params, batch, lr
      )
      seconds[name].append(s)
      last[name] = (compiled, carry)
      print(f"round {k + 1}: {name:5} {s:6.2f} s", flush=True)
  checks = {}
  for name in names:
    compiled, carry = last[name]
    _, _, loss, norm = compiled(*carry, batch)
    checks[name] = (float(loss), float(norm))
    if not all(math.isfinite(x) for x in checks[name]):
      raise RuntimeError(f"{name}: loss, norm {checks[name]}: not finite")
  return seconds, checks


def describe(model: _model.Transformer) -> str:
  """The model in words: layers, width, leaves, parameters, batch."""
  params = jax.eval_shape(model.init_params, jax.random.key(0))
  leaves = jax.tree.leaves(params)
  return (
    f"`Transformer(layers={model.layers}, d_model={model.d_model})`:"
    f" {model.layers} layer{'s' * (model.layers != 1)}, width"
    f" {model.d_model}, {model.heads} heads,"
    f" {len(leaves)} leaves, {sum(x.size for x in leaves):,} float32"
    f" parameters; batch {model.batch} x {model.seq} tokens, vocabulary"
    f" {model.vocab}; float16 compute, float32 master weights, the loss in"
    " float32"
  )


def _seconds(values: list[float]) -> str:
  return f"{np.median(values):.2f} ({np.min(values):.2f}-{np.max(values):.2f})"


def table(seconds: dict[str, list[float]]) -> list[str]:
  """The rows: ratios to plain's compile in the same round, and seconds."""
  base = seconds["plain"]
  lines = [
    "| configuration | first compile / plain's | seconds |",
    "|---|---|---|",
  ]
  for name, values in seconds.items():
    cell = _timing.ratio_range(values, base)
    lines.append(f"| {name} | {cell} | {_seconds(values)} |")
  median = {
    name: float(np.median(np.asarray(values) / np.asarray(base)))
    for name, values in seconds.items()
  }
  lines.append(f"| {OWN_COST} | {median['ours'] - median['floor']:+.2f}x | - |")
  return lines


TEXT = (
  "First compile (lower and compile; JAX's tracing and lowering included)"
  " of a whole train step, jitted with the parameters and the optimizer"
  " state donated: the median of {compiles} fresh compiles of each (a new"
  " function object and a learning rate a millionth apart each round, the"
  " persistent cache off, so that none is served from a cache), the"
  " configurations in turns in one process, the order rotated each round."
  " Each cell is the median of the rounds' ratios to `plain`'s compile in"
  " the same round, and their range; the seconds are the median and range."
  "\n\n"
  "- `plain`: Optax's `optax.chain(optax.clip_by_global_norm(1.0),"
  " optax.adamw(1e-3))`: `jax.value_and_grad(loss)`, `tx.update`,"
  " `optax.apply_updates`, and the gradients' global norm returned (logged;"
  " `optax.tree.norm`, which `optax.global_norm` calls). The baseline.\n"
  "- `floor`: a loss-scaled step written by hand with one conditional:"
  " `jax.value_and_grad` of `loss * scale` (a float32 scale, 2**15, carried"
  " in the state), the gradients multiplied by `1 / scale`, their global"
  " norm, the clip factor `jnp.where(norm < 1, 1, 1 / norm)` folded into"
  " the unscaling, then one `jax.lax.cond(jnp.isfinite(norm), ...)` around"
  " `optax.adamw(1e-3)`'s update and `optax.apply_updates`, the scale halved"
  " on a non-finite norm; the norm returned. No growth, hysteresis, counters"
  " or reports: what any loss-scaled, clipped step that skips pays.\n"
  "- `ours`: `LossScaleOptimizer(optax.adamw(1e-3), DynamicLossScale(2**15),"
  " max_norm=1.0).minimize(loss_fn, params, state, batch)`, returning"
  " `state.grad_norm` too.\n\n"
  "`{own}` is the median ratio of `ours` less that of `floor`. Measured on a"
  " CPU: nothing here is measured on a GPU.\n\n"
)


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="one compile of a 1-layer model"
  )
  parser.add_argument(
    "--layers",
    type=int,
    default=None,
    help=f"the model's layers (default {LAYERS}; {QUICK_LAYERS} with --quick)",
  )
  parser.add_argument(
    "--compiles",
    type=int,
    default=None,
    help="first compiles of each configuration (default 9; 1 with --quick)",
  )
  parser.add_argument(
    "--out",
    default=str(OUT),
    help=f"the results file, or a folder to write {OUT.name} into",
  )
  args = parser.parse_args()
  if args.layers is None:
    args.layers = QUICK_LAYERS if args.quick else LAYERS
  if args.compiles is None:
    args.compiles = 1 if args.quick else 9
  for name in ("layers", "compiles"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be at least 1, got {getattr(args, name)}.")
  return args


def main() -> None:
  args = parse_args()
  # A persistent cache would serve a repeated program without compiling it.
  jax.config.update("jax_enable_compilation_cache", False)
  width = QUICK_WIDTH if args.quick else WIDTH
  model = _model.Transformer(layers=args.layers, d_model=width)
  print(_timing.header(), flush=True)
  print(f"- model: {describe(model)}", flush=True)
  seconds, checks = measure(model, args.compiles)
  lines = table(seconds)
  print("\n".join(lines), flush=True)
  ran = ", ".join(
    f"`{name}` {loss:.4f} and {norm:.4f}"
    for name, (loss, norm) in checks.items()
  )
  text = (
    "# First compile of a whole float16 train step\n\n"
    f"{_timing.header()}\n"
    f"- model: {describe(model)}\n\n"
    + TEXT.format(compiles=args.compiles, own=OWN_COST)
    + "\n".join(lines)
    + "\n\nEach last compiled step, run once on the same parameters and"
    f" batch, returned the loss and gradient norm: {ran}.\n"
  )
  out = pathlib.Path(args.out)
  if out.is_dir():
    out = out / OUT.name
  out.write_text(text)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
