"""jmp against `optax_lossscale.jmp`: memory and compile time of jmp's steps.

Usage: python benchmarks/jmp_select_tree.py [--quick] [--leaves 40 100] [--out FILE]

Each step is written once against a module and compiled with jmp and with
`optax_lossscale.jmp`, in turns, in one process.

1. Temporary memory of jmp's README step, donated: an SGD step and an Adam
   step on 8 leaves of (512, 512) float32, then
   `select_tree(all_finite(grads), new, old)` over the parameters and the
   optimizer state (`compiled.memory_analysis().temp_size_in_bytes`).
2. First compiles of jmp's update step (unscale, `all_finite`, `adjust`,
   Adam, `select_tree` over the parameters and Adam's state; gradients
   given) on leaves of 1,000 float32: trace, lower and compile of a fresh
   function (each compile another learning rate, so another program, since
   JAX serves a repeated one from its cache). Rounds in turns, the order
   alternating; the median of the per-round ratios.
3. The whole jmp training step (policy casts, scaled loss, `grad`, unscale,
   `all_finite`, `adjust`, Adam, `select_tree`) of a float16 MLP with float32
   master weights: compile time, temporary memory and step time (parameters
   and state donated and fed back; timed in turns).

Prints the figures and writes benchmarks/JMP.md. Needs jmp (the `bench`
extra).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
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
MODULES = {JMP: deepmind_jmp, OURS: ols_jmp}
MIB = 2.0**20


def readme_step(m: Any, tx: Any) -> Callable[..., Any]:
  """jmp's README update: the new state, then `select_tree` against `m`."""

  def step(params: Any, opt_state: Any, grads: Any) -> Any:
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite = m.all_finite(grads)
    params = m.select_tree(finite, new_params, params)
    return params, m.select_tree(finite, new_opt_state, opt_state)

  return step


def temp_memory() -> dict[str, dict[str, float]]:
  """Temporary MiB of the donated SGD and Adam README steps per module."""
  params = {f"w{i}": jnp.ones((512, 512), jnp.float32) for i in range(8)}
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  out: dict[str, dict[str, float]] = {}
  for opt_name, tx in [("SGD", optax.sgd(0.1)), ("Adam", optax.adam(1e-3))]:
    out[opt_name] = {}
    for name, m in MODULES.items():
      compiled, _ = _timing.compile_step(
        readme_step(m, tx), params, tx.init(params), grads
      )
      out[opt_name][name] = _timing.temp_bytes(compiled) / MIB
      print(f"  {opt_name}, {name}: {out[opt_name][name]:.2f} MiB", flush=True)
  return out


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


def same_program_as_jmp(leaves: int) -> bool:
  """Whether jmp's step with our `select_tree` is jmp's own jaxpr."""
  params = {f"w{i:03d}": jnp.ones(1000, jnp.float32) for i in range(leaves)}
  swapped = types.SimpleNamespace(**vars(deepmind_jmp))
  swapped.select_tree = ols_jmp.select_tree
  jaxprs = []
  for m in (deepmind_jmp, swapped):
    init, step = update_step(m, 1e-3)
    jaxprs.append(str(jax.make_jaxpr(step)(params, init(params), params)))
  return jaxprs[0] == jaxprs[1]


def compile_ratios(leaves: int, rounds: int) -> dict[str, list[float]]:
  """First compiles of the update step per module, in turns."""
  params = {f"w{i:03d}": jnp.ones(1000, jnp.float32) for i in range(leaves)}
  grads = jax.tree.map(lambda p: p * SCALE * 1e-3, params)
  times: dict[str, list[float]] = {name: [] for name in MODULES}
  for r in range(rounds):
    names = list(MODULES) if r % 2 == 0 else list(MODULES)[::-1]
    for name in names:
      init, step = update_step(MODULES[name], 1e-3 * (1 + r))
      _, seconds = _timing.compile_step(step, params, init(params), grads)
      times[name].append(seconds)
      print(f"  {leaves} leaves, {name}: {seconds:.2f} s", flush=True)
  return times


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
    init, step = train_step(MODULES[name], 1e-3)
    p = jax.tree.map(jnp.copy, params)
    s = init(p)
    compiled, seconds = _timing.compile_step(step, p, s, batch)
    runs[name] = {
      "compile": seconds,
      "temp": _timing.temp_bytes(compiled) / MIB,
      "compiled": compiled,
      "carry": compiled(p, s, batch),
      "medians": [],
    }
    print(f"  train step, {name}: compile {seconds:.2f} s", flush=True)
  # The same first step (later steps drift apart by rounding, as any two
  # differently fused programs do, amplified by Adam over hundreds of steps).
  ours, theirs = runs[OURS]["carry"], runs[JMP]["carry"]
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for _ in range(rounds):
    for run in runs.values():
      times, run["carry"] = _timing.step_times(
        run["compiled"], run["carry"], (batch,), steps
      )
      run["medians"].append(statistics.median(times))
  return runs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer rounds")
  parser.add_argument("--leaves", type=int, nargs="+", default=[40, 100])
  parser.add_argument(
    "--depth", type=int, default=50, help="MLP layers (2 leaves each)"
  )
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--out", default=str(OUT), help="the markdown file")
  args = parser.parse_args()
  rounds = 3 if args.quick else 5
  print(_timing.header(packages=PACKAGES), flush=True)
  memory = temp_memory()
  same = all(same_program_as_jmp(n) for n in args.leaves)
  compiles = {n: compile_ratios(n, rounds) for n in args.leaves}
  runs = whole_step(args.depth, args.width, rounds, 20 if args.quick else 50)
  write(args, memory, same, compiles, runs)


def write(args: Any, memory: Any, same: bool, compiles: Any, runs: Any) -> None:
  median = statistics.median
  lines = [
    "# jmp against optax_lossscale.jmp",
    "",
    _timing.header(packages=PACKAGES),
    "",
    "Each step is written once against a module and compiled with jmp and"
    " with `optax_lossscale.jmp`, on the machine named above. A Haiku"
    " ResNet-18 step is in `benchmarks/JMP_HAIKU.md`"
    " (`python benchmarks/jmp_haiku_resnet.py`).",
    "",
    "## `select_tree`: temporary memory, donated",
    "",
    "jmp's README step: the optimizer's update on 8 leaves of (512, 512)"
    " float32 (8 MiB of parameters), then"
    " `select_tree(all_finite(grads), new, old)` over the parameters and the"
    " optimizer state; parameters and state donated."
    " `compiled.memory_analysis().temp_size_in_bytes`.",
    "",
    "| step | jmp (MiB) | optax_lossscale.jmp (MiB) | ours / jmp |",
    "|---|---|---|---|",
  ]
  for opt_name, mib in memory.items():
    lines.append(
      f"| {opt_name} | {mib[JMP]:.2f} | {mib[OURS]:.2f} |"
      f" {_timing.ratio(mib[OURS], mib[JMP])} |"
    )
  lines += [
    "",
    "## Compile time of jmp's update step",
    "",
    "The update step alone, gradients given (no model): unscale,"
    " `all_finite`, `adjust`, Adam and `select_tree` over the parameters"
    " and Adam's state, on leaves of 1,000 float32 parameters. First"
    f" compiles (trace, lower and compile), {len(compiles[args.leaves[0]][JMP])}"
    " rounds in turns; the median of each module's times and of the"
    " per-round ratios.",
    "",
    "| leaves | jmp (s) | optax_lossscale.jmp (s) | ours / jmp |",
    "|---|---|---|---|",
  ]
  for leaves, times in compiles.items():
    ratios = [o / j for o, j in zip(times[OURS], times[JMP], strict=True)]
    lines.append(
      f"| {leaves} | {median(times[JMP]):.2f} | {median(times[OURS]):.2f} |"
      f" {median(ratios):.2f}x |"
    )
  verdict = "the same jaxpr" if same else "a different jaxpr"
  lines += [
    "",
    "`select_tree` is jmp's, a `lax.select` per leaf: jmp's update step with"
    f" `optax_lossscale.jmp.select_tree` swapped in traces to {verdict} as"
    " jmp's own. The compile difference is `all_finite`, one pass here"
    " where jmp reduces each leaf and stacks the results.",
    "",
    "## The whole train step, before and after the import change",
    "",
    f"A float16 MLP with float32 master weights: {args.depth} residual"
    f" layers of width {args.width} ({2 * args.depth} parameter leaves),"
    " batch 32, Adam; parameters and state donated. Compile: one first"
    " compile each. Step time: the median of each round's median, rounds"
    " in turns.",
    "",
    "| configuration | compile (s) | temp (MiB) | step (ms) |",
    "|---|---|---|---|",
  ]
  jmp_run, ours = runs[JMP], runs[OURS]
  for label, run in [
    ("`import jmp`", jmp_run),
    ("`from optax_lossscale import jmp`", ours),
  ]:
    lines.append(
      f"| {label} | {run['compile']:.2f} | {run['temp']:.2f} |"
      f" {median(run['medians']) * 1e3:.3f} |"
    )
  step_ratio = median(ours["medians"]) / median(jmp_run["medians"])
  lines += [
    "",
    f"optax_lossscale.jmp against jmp: compile"
    f" {ours['compile'] / jmp_run['compile']:.2f}x, step {step_ratio:.2f}x"
    " (the same parameters after a step, within rounding).",
    "",
  ]
  pathlib.Path(args.out).write_text("\n".join(lines))
  print("\n".join(lines))


if __name__ == "__main__":
  main()
