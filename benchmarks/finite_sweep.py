"""The finiteness check against the one-liner, over dtypes, shapes and trees.

Usage: PYTHONPATH=. python benchmarks/finite_sweep.py [--quick] [--out DIR]

The reference is what `optax.apply_if_finite` computes:
`jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))`. Each case is
jitted three ways: the one-liner, `ols.all_finite`, and the read
`LossScaleOptimizer` makes of a step's gradients (the sum of their squares,
at a scale of 2**10, the norm unscaled after: the verdict and the norm, with
the exact per-leaf check in a conditional that runs only when the sum is not
finite). They are timed in turns in one process: the best of `REPEATS` calls
per round, the minimum over `ROUNDS` rounds. Prints ratios to the one-liner
and writes benchmarks/FINITE_SWEEP.md.
The fused step's first compile is `first_compile.py`'s.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import _timing
import jax
import jax.numpy as jnp
import numpy as np

import optax_lossscale as ols
from optax_lossscale import (
  _verdict,
)  # the step's read, which no public name runs alone

REPEATS = 7
ROUNDS = 2
DTYPES = {
  "float32": jnp.float32,
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
}
SHAPES = [
  (8, (2_000_000,)),
  (4, (1000, 1000)),
  (4, (1000, 1000, 1)),
  (10, (1000, 1000)),
  (20, (512, 2048)),
  (400, (1000,)),
  (64, (3, 3, 64, 64)),
]


def gpt2_small() -> dict[str, tuple[int, ...]]:
  """GPT-2 small's parameter shapes (148 leaves, 124M parameters)."""
  d, vocab, ctx = 768, 50257, 1024
  shapes = {"wte": (vocab, d), "wpe": (ctx, d)}
  for i in range(12):
    for name, shape in {
      "ln_1.scale": (d,),
      "ln_1.bias": (d,),
      "attn.c_attn.w": (d, 3 * d),
      "attn.c_attn.b": (3 * d,),
      "attn.c_proj.w": (d, d),
      "attn.c_proj.b": (d,),
      "ln_2.scale": (d,),
      "ln_2.bias": (d,),
      "mlp.c_fc.w": (d, 4 * d),
      "mlp.c_fc.b": (4 * d,),
      "mlp.c_proj.w": (4 * d, d),
      "mlp.c_proj.b": (d,),
    }.items():
      shapes[f"h{i}.{name}"] = shape
  shapes["ln_f.scale"], shapes["ln_f.bias"] = (d,), (d,)
  return shapes


def resnet50() -> dict[str, tuple[int, ...]]:
  """ResNet-50's parameter shapes: HWIO kernels, BatchNorm scales and biases."""
  shapes: dict[str, tuple[int, ...]] = {}

  def conv_bn(name: str, k: int, cin: int, cout: int) -> None:
    shapes[f"{name}.kernel"] = (k, k, cin, cout)
    shapes[f"{name}.bn.scale"], shapes[f"{name}.bn.bias"] = (cout,), (cout,)

  conv_bn("stem", 7, 3, 64)
  cin = 64
  for stage, (blocks, width) in enumerate(
    zip([3, 4, 6, 3], [64, 128, 256, 512], strict=True)
  ):
    for b in range(blocks):
      name = f"s{stage}.b{b}"
      conv_bn(f"{name}.conv1", 1, cin, width)
      conv_bn(f"{name}.conv2", 3, width, width)
      conv_bn(f"{name}.conv3", 1, width, 4 * width)
      if b == 0:
        conv_bn(f"{name}.proj", 1, cin, 4 * width)
      cin = 4 * width
  shapes["fc.kernel"], shapes["fc.bias"] = (2048, 1000), (1000,)
  return shapes


def cases(quick: bool) -> list[tuple[str, str, dict[str, tuple[int, ...]]]]:
  out = []
  for dtype in DTYPES:
    for n, shape in SHAPES[:2] if quick else SHAPES:
      out.append(
        (f"{n} x {shape}", dtype, {f"p{i:03d}": shape for i in range(n)})
      )
  for name, tree in [("GPT-2 small", gpt2_small()), ("ResNet-50", resnet50())]:
    for dtype in ["float32"] if quick else ["float32", "float16"]:
      out.append((f"{name} ({len(tree)} leaves)", dtype, tree))
  if not quick:  # leaves of many sizes, small and mid-sized
    for low, high in [(1, 16384), (1000, 4000)]:
      sizes = np.random.default_rng(0).integers(low, high, 400)
      tree = {f"p{i:03d}": (int(n),) for i, n in enumerate(sizes)}
      for dtype in ["float32", "float16"]:
        out.append((f"400 x ({low} to {high},)", dtype, tree))
  return out


def one_liner(tree: Any) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def step_read(tree: Any) -> jax.Array:
  checks = _verdict.read(
    "sweep", ols.DynamicLossScale(2.0**10), tree, None, None
  )
  return checks.grads_finite & (checks.norm >= 0)


READ = "the step's read"
CHECKS: dict[str, Callable[[Any], jax.Array]] = {
  "one-liner": one_liner,
  "all_finite": ols.all_finite,
  READ: step_read,
}


def _best(fn: Callable[..., Any], tree: Any) -> float:
  best = float("inf")
  for _ in range(REPEATS):
    t0 = time.perf_counter()
    fn(tree).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return best


def sweep(quick: bool) -> list[str]:
  rows = []
  for label, dtype, shapes in cases(quick):
    # Made in NumPy: a jitted generator would compile one program per shape.
    rng = np.random.default_rng(0)
    tree = {
      k: jnp.asarray(rng.standard_normal(s, np.float32).astype(DTYPES[dtype]))
      for k, s in shapes.items()
    }
    compiled = {
      name: jax.jit(fn).lower(tree).compile() for name, fn in CHECKS.items()
    }
    for fn in compiled.values():
      assert bool(fn(tree))
    best = {name: float("inf") for name in CHECKS}
    for _ in range(ROUNDS):
      for name, fn in compiled.items():
        best[name] = min(best[name], _best(fn, tree))
    ref = best["one-liner"]
    row = (
      f"| {label} | {dtype} | {ref * 1e3:.2f} | "
      f"{best['all_finite'] / ref:.2f}x | {best[READ] / ref:.2f}x |"
    )
    print(row, flush=True)
    rows.append(row)
    del tree, compiled
    jax.clear_caches()
  return rows


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default=os.path.dirname(__file__))
  args = parser.parse_args()
  print(_timing.header(), flush=True)
  print("| case | dtype | one-liner (ms) | all_finite | the step's read |")
  rows = sweep(args.quick)
  if args.quick:
    return
  with open(os.path.join(args.out, "FINITE_SWEEP.md"), "w") as f:
    f.write(
      "# The finiteness check against the one-liner\n\n"
      f"{_timing.header()}\n\n"
      "Ratios of the jitted check's time to the one-liner's"
      " (`jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))`),"
      f" best of {REPEATS} calls, the minimum of {ROUNDS} rounds, in turns"
      " in one process. The step's read is what `LossScaleOptimizer` reads"
      " of a step's gradients: the sum of the squares of the scaled"
      " gradients (scale 2**10), which gives the verdict and the norm.\n\n"
      "| case | dtype | one-liner (ms) | all_finite | the step's read |\n"
      "|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
  main()
