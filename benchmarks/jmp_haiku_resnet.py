"""jmp against `optax_lossscale.jmp` in a small Haiku ResNet train step.

Usage: python benchmarks/jmp_haiku_resnet.py [--quick] [--out FILE]

Haiku's ImageNet example step, written once against a module: a ResNet-18
(BatchNorm, 10 classes) with the policy `p=f32,c=f16,o=f32` and BatchNorm
under `p=f32,c=f32,o=f16`, the scaled loss, `grad`, `cast_to_param`,
`unscale`, `all_finite`, `adjust`, SGD with momentum, and `select_tree` over
(params, state, opt_state), as the example selects them. The step is compiled
with jmp and with `optax_lossscale.jmp` in turns (first compiles: trace,
lower and compile; each repeat another learning rate, so another program;
the median of the per-round ratios), its temporary memory read
(`compiled.memory_analysis().temp_size_in_bytes`, train state donated),
then timed in turns with its train state donated and fed back.

Where `jmp_select_tree.py` measures jmp's update step alone on many leaves,
this is a model whose own forward and backward pass dominate: the figure
a Haiku user moving a ResNet should expect. Prints the figures and writes
benchmarks/JMP_HAIKU.md. Needs jmp and dm-haiku.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

import _timing
import haiku as hk
import jax
import jax.numpy as jnp
import jmp as deepmind_jmp
import numpy as np
import optax

from optax_lossscale import jmp as ols_jmp

OUT = pathlib.Path(__file__).with_name("JMP_HAIKU.md")
PACKAGES = ("jmp", "dm-haiku")  # named in the header beside jax and optax
JMP = "jmp"
OURS = "optax_lossscale.jmp"
MODULES = {JMP: deepmind_jmp, OURS: ols_jmp}


class TrainState(NamedTuple):
  """Haiku's train state; the loss scale as its two arrays (jmp's own
  `DynamicLossScale` cannot go through `jax.jit(...).lower` on recent JAX)."""

  params: Any
  state: Any
  opt_state: Any
  loss_scale: tuple[jax.Array, jax.Array]


def _forward(images: jax.Array, is_training: bool) -> jax.Array:
  net = hk.nets.ResNet18(num_classes=10, resnet_v2=False)
  return net(images, is_training=is_training)


def make_step(
  m: Any, lr: float
) -> tuple[Callable[[], None], Callable[..., Any], Callable[..., Any]]:
  """`(set_policies, init, step)` of Haiku's ImageNet step against `m`."""
  model = hk.transform_with_state(_forward)
  tx = optax.sgd(lr, momentum=0.9)
  policy = m.get_policy("p=f32,c=f16,o=f32")

  def set_policies() -> None:
    hk.mixed_precision.set_policy(hk.nets.ResNet18, policy)
    hk.mixed_precision.set_policy(
      hk.BatchNorm, m.get_policy("p=f32,c=f32,o=f16")
    )

  def loss_fn(params: Any, state: Any, loss_scale: Any, batch: Any) -> Any:
    logits, state = model.apply(params, state, None, batch[0], True)
    labels = jax.nn.one_hot(batch[1], 10)
    loss = optax.softmax_cross_entropy(logits, labels).mean()
    return loss_scale.scale(loss), (loss, state)

  def init(batch: Any) -> TrainState:
    set_policies()
    params, state = model.init(jax.random.key(0), batch[0], True)
    scale = (jnp.float32(2.0**15), jnp.int32(0))
    return TrainState(params, state, tx.init(params), scale)

  def step(ts: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
    loss_scale = m.DynamicLossScale(*ts.loss_scale)
    grads, (loss, new_state) = jax.grad(loss_fn, has_aux=True)(
      ts.params, ts.state, loss_scale, batch
    )
    grads = policy.cast_to_param(grads)
    grads = loss_scale.unscale(grads)
    updates, new_opt_state = tx.update(grads, ts.opt_state, ts.params)
    new_params = optax.apply_updates(ts.params, updates)
    finite = m.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    new_params, new_state, new_opt_state = m.select_tree(
      finite,
      (new_params, new_state, new_opt_state),
      (ts.params, ts.state, ts.opt_state),
    )
    scale = (loss_scale.loss_scale, loss_scale.counter)
    return TrainState(new_params, new_state, new_opt_state, scale), loss

  return set_policies, init, step


def run(batch_size: int, repeats: int, rounds: int, steps: int) -> Any:
  kx, ky = jax.random.split(jax.random.key(1))
  batch = (
    jax.random.normal(kx, (batch_size, 32, 32, 3)),
    jax.random.randint(ky, (batch_size,), 0, 10),
  )
  runs: dict[str, dict[str, Any]] = {n: {"compiles": []} for n in MODULES}
  for r in range(repeats):
    # In turns, the order alternating; each repeat another learning rate, so
    # another program (JAX serves a repeated one from its cache).
    names = list(MODULES) if r % 2 == 0 else list(MODULES)[::-1]
    for name in names:
      set_policies, init, step = make_step(MODULES[name], 0.1 / (1 + r))
      ts = init(batch)
      set_policies()
      compiled, seconds = _timing.compile_step(
        step, ts, batch, donate_argnums=(0,)
      )
      runs[name]["compiles"].append(seconds)
      runs[name]["temp"] = _timing.temp_bytes(compiled) / 2**20
      runs[name]["leaves"] = len(
        jax.tree.leaves((ts.params, ts.state, ts.opt_state))
      )
      runs[name]["compiled"] = compiled
      runs[name]["state"], loss = compiled(ts, batch)
      runs[name]["loss"] = float(loss)
      print(f"  {name}: compile {seconds:.2f} s", flush=True)
  # The same first step, up to the rounding of two differently fused programs.
  ours, theirs = runs[OURS]["state"], runs[JMP]["state"]
  np.testing.assert_allclose(runs[OURS]["loss"], runs[JMP]["loss"], rtol=1e-3)
  for a, b in zip(
    jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
  for run_ in runs.values():
    run_["medians"] = []
  for _ in range(rounds):
    for run_ in runs.values():
      times, (run_["state"],) = _timing.step_times(
        run_["compiled"], (run_["state"],), (batch,), steps
      )
      run_["medians"].append(statistics.median(times))
  return runs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer steps")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--out", default=str(OUT), help="the markdown file")
  args = parser.parse_args()
  print(_timing.header(packages=PACKAGES), flush=True)
  repeats, rounds, steps = (2, 3, 5) if args.quick else (3, 5, 10)
  runs = run(args.batch, repeats, rounds, steps)
  write(args, runs, rounds, steps)


def write(args: Any, runs: Any, rounds: int, steps: int) -> None:
  jmp_run, ours = runs[JMP], runs[OURS]
  median = statistics.median
  compile_ratio = median(
    [o / j for o, j in zip(ours["compiles"], jmp_run["compiles"], strict=True)]
  )
  step_ratio = median(ours["medians"]) / median(jmp_run["medians"])
  lines = [
    "# jmp against optax_lossscale.jmp: a Haiku ResNet step",
    "",
    _timing.header(packages=PACKAGES),
    "",
    "Haiku's ImageNet example step on a ResNet-18 (BatchNorm, 10 classes,"
    f" {args.batch} images of 32x32x3), float16 compute with float32"
    " parameters and BatchNorm, SGD with momentum; `select_tree` over"
    f" (params, state, opt_state), {ours['leaves']} leaves. Compile: first"
    " compiles (trace, lower and compile), in turns, the median of"
    f" {len(ours['compiles'])} each (the ratio: the median of the per-round"
    " ratios). Temp: `compiled.memory_analysis().temp_size_in_bytes`, the"
    " train state donated. Step: the train state"
    f" donated and fed back, {steps} steps a round, {rounds} rounds in"
    " turns; the median of the rounds' medians.",
    "",
    "| configuration | compile (s) | temp (MiB) | step (ms) |",
    "|---|---|---|---|",
  ]
  for label, r in [
    ("`import jmp`", jmp_run),
    ("`from optax_lossscale import jmp`", ours),
  ]:
    lines.append(
      f"| {label} | {median(r['compiles']):.2f} | {r['temp']:.2f} |"
      f" {median(r['medians']) * 1e3:.1f} |"
    )
  lines += [
    "",
    f"optax_lossscale.jmp against jmp: compile {compile_ratio:.2f}x, temp"
    f" {_timing.ratio(ours['temp'], jmp_run['temp'])}, step"
    f" {step_ratio:.2f}x (the same first step, up to rounding).",
    "",
  ]
  pathlib.Path(args.out).write_text("\n".join(lines))
  print("\n".join(lines))


if __name__ == "__main__":
  main()
