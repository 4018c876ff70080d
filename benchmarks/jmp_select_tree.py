"""jmp against `optax_lossscale.jmp`: compile time of `select_tree`, and a step.

Usage: python benchmarks/jmp_select_tree.py [--quick] [--leaves 100 400]

1. The jmp update step (unscale, `all_finite`, `adjust`, Adam, `select_tree`
   over the parameters and Adam's state; gradients given) on trees of 1,000
   float32 parameters a leaf, written once against a module and compiled with
   jmp, with `optax_lossscale.jmp`, and with each module's `select_tree`
   swapped for the other's. Only first compiles are timed (trace, lower and
   compile of a fresh function; each repeat uses another learning rate, so
   another program, since JAX serves a repeated one from its cache). The
   configurations are compiled in turns in one process; jmp above 100 leaves
   is compiled once (minutes and about 11 GB at 400 leaves).
2. The whole jmp training step (policy casts, scaled loss, `grad`, unscale,
   `all_finite`, `adjust`, Adam, `select_tree`) of a float16 MLP with float32
   master weights, before and after changing `import jmp` to
   `from optax_lossscale import jmp`: compile time and step time (parameters
   and state donated and fed back; timed in turns).

Prints the figures and writes benchmarks/JMP.md. Needs jmp (the `bench`
extra).
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import _timing
import jax
import jax.numpy as jnp
import jmp as deepmind_jmp
import numpy as np
import optax

from optax_lossscale import jmp as ols_jmp

OUT = pathlib.Path(__file__).with_name("JMP.md")
PACKAGES = ("jmp",)  # named in the header beside jax and optax
SCALE = 2.0**10
JMP = "jmp"
OURS = "optax_lossscale.jmp"


def _modules() -> dict[str, Any]:
  """The configurations: a module, or one with the other's `select_tree`."""

  def mix(base: Any, select_from: Any) -> Any:
    return types.SimpleNamespace(
      DynamicLossScale=base.DynamicLossScale,
      all_finite=base.all_finite,
      select_tree=select_from.select_tree,
      get_policy=base.get_policy,
    )

  return {
    JMP: deepmind_jmp,
    OURS: ols_jmp,
    "jmp with optax_lossscale.jmp.select_tree": mix(deepmind_jmp, ols_jmp),
    "optax_lossscale.jmp with jmp's select_tree": mix(ols_jmp, deepmind_jmp),
  }


def update_step(m: Any, lr: float) -> tuple[Callable[..., Any], Any]:
  """`(init, step)` of jmp's update pattern against module `m`.

  The loss scale is carried as its two arrays: jmp's own `DynamicLossScale`
  cannot go through `jax.jit(...).lower` on recent JAX.
  """
  tx = optax.adam(lr)

  def init(params: Any) -> Any:
    return tx.init(params), (jnp.float32(SCALE), jnp.int32(0))

  def step(params: Any, state: Any, grads: Any) -> Any:
    opt_state, (scale, counter) = state
    loss_scale = m.DynamicLossScale(scale, counter)
    return _apply(m, tx, loss_scale, grads, params, opt_state)

  return init, step


def _apply(
  m: Any, tx: Any, loss_scale: Any, grads: Any, params: Any, opt_state: Any
) -> Any:
  """jmp's unscale, `all_finite`, `adjust`, update and `select_tree`."""
  grads = loss_scale.unscale(grads)
  finite = m.all_finite(grads)
  loss_scale = loss_scale.adjust(finite)
  updates, new_opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  params = m.select_tree(finite, new_params, params)
  opt_state = m.select_tree(finite, new_opt_state, opt_state)
  return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))


def _peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def first_compile(step: Callable[..., Any], *args: Any) -> float:
  t0 = time.perf_counter()
  jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
  return time.perf_counter() - t0


def select_tree_compiles(
  leaves: int, repeats: int, jmp_repeats: int
) -> dict[str, dict[str, Any]]:
  """Compile times of the update step per configuration, in turns."""
  params = {f"w{i:03d}": jnp.ones(1000, jnp.float32) for i in range(leaves)}
  grads = jax.tree.map(lambda p: p * SCALE * 1e-3, params)
  results: dict[str, dict[str, Any]] = {
    name: {"times": [], "rss_growth": 0.0} for name in _modules()
  }
  for r in range(repeats):
    # jmp itself last, so that its memory shows as growth of the peak.
    for name, m in reversed(list(_modules().items())):
      if name == JMP and r >= jmp_repeats:
        continue
      init, step = update_step(m, 1e-3 * (1 + r))
      before = _peak_rss_gib()
      seconds = first_compile(step, params, init(params), grads)
      growth = _peak_rss_gib() - before
      results[name]["times"].append(seconds)
      results[name]["rss_growth"] = max(results[name]["rss_growth"], growth)
      print(f"  {leaves} leaves, {name}: {seconds:.2f} s", flush=True)
  return results


# --- the whole train step --------------------------------------------------


def init_mlp(depth: int, width: int) -> dict[str, Any]:
  keys = jax.random.split(jax.random.key(0), depth)
  return {
    f"layer{i:03d}": {
      "w": jax.random.normal(k, (width, width)) / np.sqrt(width),
      "b": jnp.zeros(width),
    }
    for i, k in enumerate(keys)
  }


def train_step(m: Any, lr: float) -> tuple[Callable[..., Any], Any]:
  """`(init, step)` of the whole jmp training step against module `m`."""
  policy = m.get_policy("p=f32,c=f16,o=f32")
  tx = optax.adam(lr)

  def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    params, x = policy.cast_to_compute((params, x))
    for layer in params.values():
      x = x + jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean((policy.cast_to_output(x) - y) ** 2)

  def init(params: Any) -> Any:
    return tx.init(params), (jnp.float32(2.0**15), jnp.int32(0))

  def step(params: Any, state: Any, batch: Any) -> Any:
    opt_state, (scale, counter) = state
    loss_scale = m.DynamicLossScale(scale, counter)
    scaled = lambda p: loss_scale.scale(loss_fn(p, *batch))  # noqa: E731
    grads = policy.cast_to_param(jax.grad(scaled)(params))
    return _apply(m, tx, loss_scale, grads, params, opt_state)

  return init, step


def whole_step(
  depth: int, width: int, rounds: int, steps: int
) -> dict[str, dict[str, Any]]:
  params = init_mlp(depth, width)
  kx, ky = jax.random.split(jax.random.key(1))
  batch = (
    jax.random.normal(kx, (32, width)),
    jax.random.normal(ky, (32, width)),
  )
  runs: dict[str, dict[str, Any]] = {}
  for name in [OURS, JMP]:
    init, step = train_step(_modules()[name], 1e-3)
    p = jax.tree.map(jnp.copy, params)
    s = init(p)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, batch)
    compiled = compiled.compile()
    runs[name] = {
      "compile": time.perf_counter() - t0,
      "compiled": compiled,
      "state": compiled(p, s, batch),
      "medians": [],
    }
  # The same first step (later steps drift apart by rounding, as any two
  # differently fused programs do, amplified by Adam over hundreds of steps).
  ours, theirs = runs[OURS]["state"], runs[JMP]["state"]
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print(f"  train step, {name}: compile {runs[name]['compile']:.2f} s")
  for _ in range(rounds):
    for run in runs.values():
      p, s = run["state"]
      times = []
      for _ in range(steps):
        t0 = time.perf_counter()
        p, s = run["compiled"](p, s, batch)
        jax.block_until_ready((p, s))
        times.append(time.perf_counter() - t0)
      run["state"] = (p, s)
      run["medians"].append(statistics.median(times))
  return runs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer repeats")
  parser.add_argument("--leaves", type=int, nargs="+", default=[100, 400])
  parser.add_argument(
    "--depth", type=int, default=50, help="MLP layers (2 leaves each)"
  )
  parser.add_argument("--width", type=int, default=128)
  args = parser.parse_args()
  repeats = 2 if args.quick else 3
  print(_timing.header(packages=PACKAGES), flush=True)
  compiles = {
    n: select_tree_compiles(n, repeats, repeats if n <= 100 else 1)
    for n in args.leaves
  }
  runs = whole_step(
    args.depth, args.width, repeats + 2, 20 if args.quick else 50
  )
  write(args, compiles, runs)


def _median(xs: list[float]) -> float:
  return statistics.median(xs)


def write(args: Any, compiles: Any, runs: Any) -> None:
  lines = [
    "# jmp against optax_lossscale.jmp",
    "",
    _timing.header(packages=PACKAGES),
    "",
    "What these figures are: compile and step times of jmp's own update"
    " pattern, written once and run with each module, on the machine named"
    " above. The ratios are for the steps described here, whose"
    " cost is dominated by jmp's per-leaf work; they are not a model's. In a"
    " step whose own forward and backward pass dominate, the difference is"
    " far smaller: see `benchmarks/JMP_HAIKU.md` (a Haiku ResNet-18 step,"
    " `python benchmarks/jmp_haiku_resnet.py`).",
    "",
    "## `select_tree`: compile time of jmp's update step",
    "",
    "The update step alone, with the gradients given (no model): unscale,"
    " `all_finite`, `adjust`, Adam and `select_tree` over the parameters"
    " and Adam's state, on leaves of 1,000 float32 parameters"
    " (`select_tree` picks among 3x as many leaves). First compiles only"
    " (trace, lower and compile), the median over the repeats; jmp above"
    " 100 leaves is compiled once.",
    "",
    "| leaves | configuration | compile (s) | vs jmp | repeats |"
    " peak RSS growth (GiB) |",
    "|---|---|---|---|---|---|",
  ]
  for leaves, results in compiles.items():
    base = _median(results[JMP]["times"])
    for name, r in results.items():
      t = _median(r["times"])
      lines.append(
        f"| {leaves} | {name} | {t:.2f} | {t / base:.3f}x |"
        f" {len(r['times'])} | {r['rss_growth']:.2f} |"
      )
  depth = args.depth
  jmp_run, ours = runs[JMP], runs[OURS]
  step_ratio = _median(ours["medians"]) / _median(jmp_run["medians"])
  lines += [
    "",
    "Peak RSS growth: how far each compile raised the process's peak"
    " resident memory (0 when it stayed under an earlier peak; jmp is"
    " compiled last in each round, so its figure is its own).",
    "",
    "## The whole train step, before and after the import change",
    "",
    f"A float16 MLP with float32 master weights: {depth} residual layers"
    f" of width {args.width} ({2 * depth} parameter leaves, {6 * depth}"
    " leaves selected), batch 32, Adam; parameters and state donated."
    " A cheap model with many leaves, so jmp's per-leaf work weighs much."
    " Compile: one first compile each. Step time: the median of each"
    " round's median, rounds in turns.",
    "",
    "| configuration | compile (s) | step (ms) |",
    "|---|---|---|",
  ]
  for label, run in [
    ("`import jmp`", jmp_run),
    ("`from optax_lossscale import jmp`", ours),
  ]:
    lines.append(
      f"| {label} | {run['compile']:.2f} |"
      f" {_median(run['medians']) * 1e3:.3f} |"
    )
  lines += [
    "",
    f"optax_lossscale.jmp against jmp: compile"
    f" {ours['compile'] / jmp_run['compile']:.3f}x, step {step_ratio:.2f}x"
    " (the same parameters after a step, within rounding).",
    "",
  ]
  OUT.write_text("\n".join(lines))
  print("\n".join(lines))


if __name__ == "__main__":
  main()
