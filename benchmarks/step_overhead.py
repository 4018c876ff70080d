"""Cost of loss scaling in a donated train step, against plain Adam and peers.

Usage: python benchmarks/step_overhead.py [--quick] [--max-peer-leaves N]
       python benchmarks/step_overhead.py --failure-modes [--quick]
       python benchmarks/step_overhead.py --sharded [--quick]
       python benchmarks/step_overhead.py --baseline REV [--quick]

Everything is measured in one process on the same pytrees, in train-step
shape: jitted, with parameters and optimizer state donated and fed back. The
gradients are an input (scaled by 2**10), except in one workload, where they
are computed in the step from matrix products, as in a real model. Prints a
table, writes benchmarks/RESULTS.md and benchmarks/step_overhead.png.

`--baseline REV` measures only the fused step and `update` of this checkout
against those of commit `REV` (read with `git archive`), with plain adam,
and writes benchmarks/BASELINE_STEP.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

if "--sharded" in sys.argv:  # 8 host devices, before JAX starts
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import _timing
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

SCALE = 2.0**10
# Steps are timed in this many turns per configuration.
ROUNDS = 5


def _adam() -> optax.GradientTransformation:
  return optax.adam(1e-3)


def optax_step(
  tx: optax.GradientTransformation,
  prepare: Callable[[Any], Any] = lambda grads: grads,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """A train step of `tx` on given gradients.

  Args:
    tx: the transformation.
    prepare: applied to the gradients first.

  Returns:
    `(init, step)`: `tx.init`, and `step(params, state, grads)`, which runs
    `tx.update` on `prepare(grads)` then `optax.apply_updates`, returning
    `(params, state)`.
  """

  def step(params, state, grads):
    updates, state = tx.update(prepare(grads), state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def config_plain():
  return optax_step(_adam())


def _optimizer_of(package: Any, lr: float) -> Any:
  """`package`'s loss scale optimizer of `adam(lr)`, `DynamicLossScale(SCALE)`.

  `package` is this checkout's or an earlier commit's
  (`_timing.import_baseline`): its `LossScaleOptimizer`, or, at a commit
  before it, the transformation `loss_scale_optimizer` returned.
  """
  loss_scale = package.DynamicLossScale(SCALE)
  if hasattr(package, "LossScaleOptimizer"):
    return package.LossScaleOptimizer(optax.adam(lr), loss_scale)
  return package.loss_scale_optimizer(optax.adam(lr), loss_scale)


def fused_call(package: Any) -> str:
  """The call `fused_step_of(package)` times, as the docs write it."""
  if hasattr(package, "LossScaleOptimizer"):
    return "`LossScaleOptimizer(adam, DynamicLossScale(2**10)).apply_gradients`"
  return (
    "`apply_gradients(loss_scale_optimizer(adam, DynamicLossScale(2**10)))`"
  )


def fused_step_of(
  package: Any, lr: float = 1e-3
) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """`package`'s fused step (`fused_call`), as `(init, step)`.

  `step(params, state, grads)` returns `(params, state)`: the order of its
  donated arguments (XLA:CPU copies donated buffers returned in another).
  """
  tx = _optimizer_of(package, lr)
  if hasattr(package, "LossScaleOptimizer"):
    apply_gradients = tx.apply_gradients
  else:  # before the class, a free function took the transformation
    apply_gradients = functools.partial(package.apply_gradients, tx)

  def step(params, state, grads):
    return apply_gradients(grads, state, params)

  return tx.init, step


def update_step_of(
  package: Any, lr: float = 1e-3
) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """`package`'s `update`, then `optax.apply_updates`, as `(init, step)`."""
  return optax_step(_optimizer_of(package, lr))


def config_update():
  return update_step_of(ols)


def config_apply_gradients():
  return fused_step_of(ols)


def fused_step(
  lr: float = 1e-3, **options: Any
) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """A train step of `LossScaleOptimizer(adam(lr), DynamicLossScale(SCALE))`.

  Args:
    lr: Adam's learning rate.
    **options: `value` (passed as `value=`), `hysteresis`, `idle_callback`
      (a `jax.debug.callback` of the user's in a `cond` that never calls
      it) and `LossScaleOptimizer`'s own keyword arguments.

  Returns:
    `(init, step)`: `step(params, state, grads)` is `apply_gradients`,
    returning `(params, state)`.
  """
  value = options.pop("value", None)
  hysteresis = options.pop("hysteresis", 1)
  idle_callback = options.pop("idle_callback", False)
  tx = ols.LossScaleOptimizer(
    optax.adam(lr),
    ols.DynamicLossScale(SCALE, hysteresis=hysteresis),
    **options,
  )

  def step(params, state, grads):
    extra = {} if value is None else {"value": jnp.float32(value)}
    params, state = tx.apply_gradients(grads, state, params, **extra)
    if idle_callback:
      jax.lax.cond(
        state.skipped_steps >= 0,
        lambda: None,
        lambda: jax.debug.callback(lambda: None),
      )
    return params, state

  return tx.init, step


# The failure-mode options (`--failure-modes`), each against the defaults.
FAILURE_MODES: dict[str, Callable[..., Any]] = {
  "defaults": functools.partial(fused_step),
  "hysteresis=2": functools.partial(fused_step, hysteresis=2),
  "value= passed": functools.partial(fused_step, value=1.0),
  # Not an option of ours: any host callback in a step, for comparison.
  "defaults + a never-called jax.debug.callback": functools.partial(
    fused_step, idle_callback=True
  ),
}


def config_unscale_gradients():
  return optax_step(
    optax.chain(ols.unscale_gradients(ols.DynamicLossScale(SCALE)), _adam())
  )


def config_jmp():
  import jmp

  tx = _adam()

  def init(params):
    return tx.init(params), jmp.DynamicLossScale(jnp.float32(SCALE))

  def step(params, state, grads):
    opt_state, loss_scale = state
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = jmp.select_tree(finite, new_params, params)
    opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
    return params, (opt_state, loss_scale)

  return init, step


def config_flax_pattern():
  # flax.training.dynamic_scale.DynamicScale: unscale, a finiteness check per
  # leaf, then jnp.where over every leaf of params and optimizer state.
  tx = _adam()

  def init(params):
    return tx.init(params), jnp.float32(SCALE)

  def step(params, state, grads):
    opt_state, scale = state
    grads = jax.tree.map(lambda g: (g / scale).astype(g.dtype), grads)
    finite = jnp.array(True)
    for g in jax.tree.leaves(grads):
      finite &= jnp.all(jnp.isfinite(g))
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    sel = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
    params = jax.tree.map(sel, new_params, params)
    opt_state = jax.tree.map(sel, new_opt_state, opt_state)
    return params, (opt_state, jnp.where(finite, scale, scale / 2))

  return init, step


def config_apply_if_finite():
  return optax_step(
    optax.apply_if_finite(_adam(), max_consecutive_errors=5),
    lambda grads: jax.tree.map(lambda g: (g / SCALE).astype(g.dtype), grads),
  )


CONFIGS: dict[str, Callable[[], Any]] = {
  "plain adam": config_plain,
  "LossScaleOptimizer.update": config_update,
  "LossScaleOptimizer.apply_gradients": config_apply_gradients,
  "chain(unscale_gradients, adam)": config_unscale_gradients,
  "jmp select_tree": config_jmp,
  "flax DynamicScale pattern": config_flax_pattern,
  "optax.apply_if_finite": config_apply_if_finite,
}
PEERS = {
  "jmp select_tree",
  "flax DynamicScale pattern",
  "optax.apply_if_finite",
}


def make_tree(n_leaves: int, leaf_size: int, key: int = 0):
  keys = jax.random.split(jax.random.PRNGKey(key), n_leaves)
  params = {
    f"p{i:04d}": jax.random.normal(k, (leaf_size,)) for i, k in enumerate(keys)
  }
  return params


def _matmul_loss(params, xs, ys):
  # The gradient with respect to each weight matrix w is x.T @ y: written out
  # by a matrix product, as in a real model (scaled by SCALE, as the loss is).
  return SCALE * sum(jnp.sum((xs[k] @ w) * ys[k]) for k, w in params.items())


def _matmul_inputs(params, batch=8):
  x_key, y_key = jax.random.split(jax.random.PRNGKey(1))
  xs = {
    k: jax.random.normal(jax.random.fold_in(x_key, i), (batch, w.shape[0]))
    for i, (k, w) in enumerate(params.items())
  }
  ys = {
    k: 1e-3
    * jax.random.normal(jax.random.fold_in(y_key, i), (batch, w.shape[1]))
    for i, (k, w) in enumerate(params.items())
  }
  return xs, ys


def prepare(name, params, grad_dtype, matmul=False, config=None):
  """Compiles one configuration and runs its first step.

  The gradients are an input of the step, or, with `matmul`, computed in the
  step as the gradient of a loss made of one matrix product per leaf.
  `config` (returning `(init, step)`) replaces the configuration `name`
  names.
  """
  init, tx_step = (config or {**CONFIGS, **FAILURE_MODES}[name])()
  if matmul:
    grads = _matmul_inputs(params)

    def step(params, state, inputs):
      return tx_step(params, state, jax.grad(_matmul_loss)(params, *inputs))

  else:
    grads = jax.tree.map(
      lambda p: (p * SCALE * 1e-3).astype(grad_dtype), params
    )
    step = tx_step
  jitted = jax.jit(step, donate_argnums=(0, 1))
  p = jax.tree.map(jnp.copy, params)
  s = init(p)
  t0 = time.perf_counter()
  try:
    compiled, compile_s = _timing.compile_step(step, p, s, grads)
    temp = _timing.temp_bytes(compiled)
    p, s = compiled(p, s, grads)
  except TypeError:
    # jmp's loss scale cannot be lowered ahead of time on recent JAX; time
    # the first call (compilation plus one step) instead.
    compiled = jitted
    p, s = compiled(p, s, grads)
    jax.block_until_ready(p)
    compile_s = time.perf_counter() - t0
    temp = float("nan")
  jax.block_until_ready(p)
  return dict(
    name=name,
    init=init,
    step_fn=step,
    compiled=compiled,
    state=(p, s),
    grads=grads,
    params=params,
    compile=compile_s,
    temp=temp,
    times=[],
  )


def time_steps(run, n):
  """Times `n` donated steps of a prepared configuration."""
  times, run["state"] = _timing.step_times(
    run["compiled"], run["state"], (run["grads"],), n
  )
  run["times"] += times


def time_scan(run, scan_steps):
  """Wall time of a `lax.scan` loop of `scan_steps` donated steps."""
  step, init, grads = run["step_fn"], run["init"], run["grads"]

  def loop(p, s, g):
    return jax.lax.scan(
      lambda c, _: (step(*c, g), None), (p, s), None, length=scan_steps
    )[0]

  p, s = run.pop("state")
  loop_c = jax.jit(loop, donate_argnums=(0, 1))
  try:
    loop_c = loop_c.lower(p, s, grads).compile()
  except TypeError:  # jmp, as above: compile by running once
    jax.block_until_ready(loop_c(p, s, grads))
    p = jax.tree.map(jnp.copy, run["params"])
    s = init(p)
  t0 = time.perf_counter()
  jax.block_until_ready(loop_c(p, s, grads))
  return time.perf_counter() - t0


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="fewer repeats and workloads"
  )
  parser.add_argument(
    "--max-peer-leaves",
    type=int,
    default=100,
    help="skip peers above this many leaves (jmp needs"
    " minutes and GBs to compile at 400 leaves)",
  )
  parser.add_argument("--out", default="benchmarks")
  parser.add_argument(
    "--failure-modes",
    action="store_true",
    help="only the failure-mode options against the defaults, at 400 leaves"
    " and on 16M parameters (writes FAILURE_MODES.md)",
  )
  parser.add_argument(
    "--sharded",
    action="store_true",
    help="only the fused step and chain(unscale_gradients, adam) against"
    " plain adam, every leaf FSDP-sharded on 8 host devices (writes"
    " SHARDED.md)",
  )
  parser.add_argument(
    "--baseline",
    metavar="REV",
    help="only the fused step and update of this checkout against those of"
    " commit REV, with plain adam, on 16M parameters and at 400 leaves"
    " (writes BASELINE_STEP.md)",
  )
  args = parser.parse_args()
  if args.baseline:
    against_baseline(args.out, args.baseline, args.quick)
    return
  if args.sharded:
    sharded(args.out, 10 if args.quick else 30, 1 if args.quick else 5)
    return
  if args.failure_modes:
    failure_modes(args.out, 10 if args.quick else 30, 1 if args.quick else 5)
    return
  repeats = 10 if args.quick else 30
  print(_timing.header(), flush=True)
  rows = []
  failures: list[tuple[str, str, str, str]] = []

  def configs_for(n_leaves):
    """Every configuration; the peers only up to --max-peer-leaves."""
    return [
      c for c in CONFIGS if c not in PEERS or n_leaves <= args.max_peer_leaves
    ]

  def run(workload, params, dtype, names, scan_steps, matmul=False):
    # All configurations are compiled first, then timed in turns, a few steps
    # each, so that a slow spell of the machine affects them all alike.
    runs = []
    for name in names:
      try:
        runs.append(prepare(name, params, dtype, matmul))
      except Exception as e:  # a peer that cannot run this workload
        reason = str(e).splitlines()[0][:90]
        print(f"{workload:>16} {name:>40}: failed: {reason}", flush=True)
        failures.append((workload, jnp.dtype(dtype).name, name, reason))
    for _ in range(ROUNDS):
      for r in runs:
        time_steps(r, repeats // ROUNDS)
    base = None
    for r in runs:
      result = dict(
        step=float(np.median(r["times"])),
        compile=r["compile"],
        temp=r["temp"],
        scan=time_scan(r, scan_steps) if scan_steps else float("nan"),
        scan_steps=scan_steps,
      )
      r.pop("state", None)
      name = r["name"]
      if name == "plain adam":
        base = result
      rows.append((workload, jnp.dtype(dtype).name, name, result, base))
      print(
        f"{workload:>16} {jnp.dtype(dtype).name:>8} {name:>32}: "
        f"step {result['step'] * 1e3:8.2f} ms"
        f" ({result['step'] / base['step']:.2f}x)"
        f"  compile {result['compile']:6.2f} s"
        f" ({result['compile'] / base['compile']:.2f}x)"
        f"  temp {result['temp'] / 2**20:8.1f} MiB"
        f"  scan {result['scan']:.2f} s",
        flush=True,
      )

  big = make_tree(8, 2_000_000)
  for dtype in (
    [jnp.float32] if args.quick else [jnp.float32, jnp.float16, jnp.bfloat16]
  ):
    run(
      "16M / 8 leaves",
      big,
      dtype,
      list(CONFIGS),
      0 if dtype != jnp.float32 else (20 if args.quick else 100),
    )
  # The realistic shape: the gradients come out of matrix products in the
  # same step (for plain adam too they are then written out).
  run(
    "16M / 8 leaves, grads from matmuls",
    {k: v.reshape(1000, -1) for k, v in big.items()},
    jnp.float32,
    list(CONFIGS),
    0,
    matmul=True,
  )
  del big
  # Mid-sized leaves, as in a convolutional network: read in place by the
  # check, not copied into a concatenation.
  run(
    "16M / 512 leaves x 32768",
    make_tree(512, 32_768),
    jnp.float32,
    configs_for(512),
    0,
  )
  leaf_counts = [10, 100, 400] if args.quick else [10, 100, 400, 2000]
  for n in leaf_counts:
    run(
      f"{n} leaves x 1000",
      make_tree(n, 1000),
      jnp.float32,
      configs_for(n),
      1000 if n == 100 else 0,
    )

  with open(f"{args.out}/RESULTS.md", "w") as f:
    f.write(f"# step_overhead results\n\n{_timing.header()}\n\n")
    f.write(
      "| workload | grads | configuration | step (ms) | vs adam | "
      "compile (s) | vs adam | temp (MiB) | lax.scan loop (s) |\n"
    )
    f.write("|---|---|---|---|---|---|---|---|---|\n")
    for workload, dtype, name, r, base in rows:
      f.write(
        f"| {workload} | {dtype} | {name} | {r['step'] * 1e3:.2f} | "
        f"{r['step'] / base['step']:.2f}x | {r['compile']:.2f} | "
        f"{r['compile'] / base['compile']:.2f}x | {r['temp'] / 2**20:.1f} | "
        + (
          f"{r['scan']:.2f} ({r['scan_steps']} steps, "
          f"{r['scan'] / base['scan']:.2f}x) |\n"
          if r["scan_steps"]
          else "- |\n"
        )
      )
    for workload, dtype, name, reason in failures:
      f.write(f"\nFailed: {name} on {workload} ({dtype} grads): {reason}\n")
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(
      "matplotlib is missing (pip install 'optax_lossscale[bench]'); no plot"
    )
    return
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for name in CONFIGS:
    pts = [
      (int(w.split()[0]), r["step"] / b["step"], r["compile"])
      for w, d, n, r, b in rows
      if n == name and "x 1000" in w
    ]
    if pts:
      xs, ratio, comp = zip(*pts, strict=True)
      ax1.plot(xs, ratio, "o-", label=name)
      ax2.plot(xs, comp, "o-", label=name)
  for ax, title in [(ax1, "step time / plain adam"), (ax2, "compile time (s)")]:
    ax.set_xscale("log")
    ax.set_xlabel("leaves (1,000 params each)")
    ax.set_title(title)
  ax2.set_yscale("log")
  ax1.legend(fontsize=7)
  env = _timing.environment()
  fig.suptitle(
    f"{env['versions']}; {env['backend']}, {env['device']}; {env['host']}",
    fontsize=7,
  )
  fig.tight_layout()
  fig.savefig(f"{args.out}/step_overhead.png", dpi=80)


def _compile_failure_mode(name: str, params: Any, lr: float) -> float:
  """Seconds to compile `name` with Adam's learning rate `lr`: a program of
  its own, so a first compile (JAX serves a repeated one from its cache)."""
  init, step = FAILURE_MODES[name](lr=lr)
  p = jax.tree.map(jnp.copy, params)
  grads = jax.tree.map(lambda x: x * SCALE * 1e-3, params)
  return _timing.compile_step(step, p, init(p), grads)[1]


def _scan_loop(run: dict[str, Any], steps: int) -> Callable[[], float]:
  """A timer of `steps` donated steps inside one compiled `lax.scan`."""
  step, grads = run["step_fn"], run["grads"]

  def loop(p, s, g):
    return jax.lax.scan(
      lambda c, _: (step(*c, g), None), (p, s), None, length=steps
    )[0]

  compiled = (
    jax.jit(loop, donate_argnums=(0, 1)).lower(*run["state"], grads).compile()
  )

  def timed() -> float:
    t0 = time.perf_counter()
    run["state"] = compiled(*run["state"], grads)
    jax.block_until_ready(run["state"])
    return (time.perf_counter() - t0) / steps

  return timed


def failure_modes(out: str, repeats: int, compiles: int) -> None:
  """Step and compile ratios of each failure-mode option vs the defaults.

  Step: per call of the jitted step, and per step inside one compiled
  `lax.scan` of many steps (one dispatch for all). Compile: the median of
  `compiles` first compiles, in turns.
  """
  lines = []
  for workload, params, scan_steps in [
    ("400 leaves x 1000", make_tree(400, 1000), 2000),
    ("16M / 8 leaves", make_tree(8, 2_000_000), 10),
  ]:
    runs = [prepare(name, params, jnp.float32) for name in FAILURE_MODES]
    for run in runs:
      run["compiles"] = [run["compile"]]
    for k in range(1, compiles):
      for run in runs:
        lr = 1e-3 * (1 + k)
        run["compiles"].append(_compile_failure_mode(run["name"], params, lr))
    for _ in range(ROUNDS):
      for run in runs:
        time_steps(run, repeats // ROUNDS)
    loops = [_scan_loop(run, scan_steps) for run in runs]
    for run in runs:
      run["scan"] = []
    for _ in range(ROUNDS):
      for run, timed in zip(runs, loops, strict=True):
        run["scan"].append(timed())
    base = runs[0]
    median = lambda run, key: float(np.median(run[key]))  # noqa: E731
    for run in runs:
      cells = [
        median(run, key) / median(base, key)
        for key in ("times", "scan", "compiles")
      ]
      line = (
        f"| {workload} | {run['name']} | "
        + " | ".join(f"{c:.2f}x" for c in cells)
        + " |"
      )
      print(line, flush=True)
      lines.append(line)
  with open(f"{out}/FAILURE_MODES.md", "w") as f:
    f.write(
      "# Failure-mode options against the defaults\n\n"
      f"{_timing.header()}\n\n"
      "Ratios to the `LossScaleOptimizer.apply_gradients` step with the"
      " defaults, in one process."
      " Step per call: the jitted step called from Python. Step in a scan:"
      " one step of a compiled `lax.scan` loop of many. Compile: the median"
      f" of {compiles} first compiles.\n\n"
      "| workload | option | step per call | step in a scan | compile |\n"
      "|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )


def against_baseline(out: str, rev: str, quick: bool) -> None:
  """The fused step and `update`, now and at commit `rev`, in one process.

  Each configuration is compiled first, then timed in `ROUNDS` rounds, the
  order rotated each round, `steps` steps each: every cell is the median
  over the rounds of a ratio of the rounds' median step times, and its
  range.
  """
  with tempfile.TemporaryDirectory() as tmp:
    found = _timing.extract_baseline(rev, tmp)
    package = _timing.import_baseline(tmp if found else None)
    if package is None:
      raise SystemExit(f"commit {rev!r} does not serve as a baseline")
    rows = {
      "plain adam": (config_plain, None),
      f"LossScaleOptimizer.apply_gradients at {rev}": (
        lambda: fused_step_of(package),
        None,
      ),
      "LossScaleOptimizer.apply_gradients": (
        lambda: fused_step_of(ols),
        f"LossScaleOptimizer.apply_gradients at {rev}",
      ),
      f"LossScaleOptimizer.update at {rev}": (
        lambda: update_step_of(package),
        None,
      ),
      "LossScaleOptimizer.update": (
        lambda: update_step_of(ols),
        f"LossScaleOptimizer.update at {rev}",
      ),
    }
    steps = 2 if quick else 100
    workloads = (
      [("160k / 8 leaves", make_tree(8, 20_000))]
      + [("40 leaves x 1000", make_tree(40, 1000))]
      if quick
      else [("16M / 8 leaves", make_tree(8, 2_000_000))]
      + [("400 leaves x 1000", make_tree(400, 1000))]
    )
    head = _timing.header()  # the load average before the runs
    print(head, flush=True)
    lines = []
    for workload, params in workloads:
      runs = {
        name: prepare(name, params, jnp.float32, config=config)
        for name, (config, _) in rows.items()
      }
      names = list(runs)
      medians: dict[str, list[float]] = {name: [] for name in names}
      for k in range(ROUNDS):
        for name in names[k % len(names) :] + names[: k % len(names)]:
          before = len(runs[name]["times"])
          time_steps(runs[name], steps)
          medians[name].append(float(np.median(runs[name]["times"][before:])))
      for name, (_, then) in rows.items():
        cells = [
          workload,
          name,
          _timing.ratio_range(medians[name], medians["plain adam"]),
        ]
        cells.append(
          _timing.ratio_range(medians[name], medians[then]) if then else "-"
        )
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
      del runs
  with open(f"{out}/BASELINE_STEP.md", "w") as f:
    f.write(
      f"# The fused step now against commit {rev}\n\n{head}\n\n"
      f"The fused step, {fused_call(ols)}, and `LossScaleOptimizer.update`"
      " then `optax.apply_updates`, of this checkout and of commit"
      f" `{rev}` (read with `git archive`; there {fused_call(package)}),"
      " with plain adam, run by the same JAX in one process: each jitted,"
      " its parameters and state donated and fed back, the gradients an"
      f" input. Timed in {ROUNDS} rounds of {steps} steps, the order"
      " rotated each round: each cell is the median over the rounds of the"
      " ratio of the rounds' median step times, and its range in brackets."
      f" `now / {rev}`: each step of this checkout against the same step"
      f" at `{rev}`.\n\n"
      f"| workload | step | vs plain adam | now / {rev} |\n"
      "|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )


SHARDED = [
  "plain adam",
  "LossScaleOptimizer.apply_gradients",
  "chain(unscale_gradients, adam)",
]


def _compile_seconds(name: str, params: Any, grads: Any) -> tuple[float, str]:
  """A first compile of `name` (fresh closures, so no cache hit) and its HLO."""
  init, step = CONFIGS[name]()
  p = jax.tree.map(jnp.copy, params)
  compiled, seconds = _timing.compile_step(step, p, init(p), grads)
  return seconds, compiled.as_text()


def sharded(out: str, repeats: int, compiles: int) -> None:
  """Step and compile ratios to plain adam with FSDP-sharded leaves.

  Every leaf is sharded `P("d", None)` over the 8 devices of a
  `jax.make_mesh` mesh (Explicit axes, the default), for both plain adam
  and the loss-scaled steps; the gradients too.
  """
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  lines = []
  with jax.set_mesh(mesh):
    for workload, n_leaves, shape in [
      ("16M / 8 leaves", 8, (1000, 2000)),
      ("400 leaves x 1000", 400, (8, 125)),
    ]:
      params = {
        k: jax.device_put(v.reshape(shape), P("d", None))
        for k, v in make_tree(n_leaves, shape[0] * shape[1]).items()
      }
      runs = [prepare(name, params, jnp.float32) for name in SHARDED]
      grads = runs[0]["grads"]
      for run in runs:
        run["compiles"] = [run["compile"]]
        for _ in range(1, compiles):
          run["compiles"].append(
            _compile_seconds(run["name"], params, grads)[0]
          )
        hlo = _compile_seconds(run["name"], params, grads)[1]
        run["moves"] = sorted(
          set(re.findall(r"(all-gather|all-to-all|collective-permute)", hlo))
        )
      for _ in range(ROUNDS):
        for run in runs:
          time_steps(run, repeats // ROUNDS)
      base = runs[0]
      median = lambda run, key: float(np.median(run[key]))  # noqa: E731
      for run in runs:
        line = (
          f"| {workload} | {run['name']} | "
          f"{median(run, 'times') / median(base, 'times'):.2f}x | "
          f"{median(run, 'compiles') / median(base, 'compiles'):.2f}x | "
          f"{', '.join(run['moves']) or 'none'} |"
        )
        print(line, flush=True)
        lines.append(line)
  with open(f"{out}/SHARDED.md", "w") as f:
    f.write(
      "# FSDP-sharded steps on 8 host devices\n\n"
      f"{_timing.header()}\n\n"
      "The devices share one machine's cores. Every parameter, gradient"
      ' and moment sharded `P("d", None)` over a `jax.make_mesh`'
      " mesh (Explicit axes); ratios to plain adam sharded the same way, in"
      " one process, configurations timed in turns. Compile: the median of"
      f" {compiles} first compiles.\n\n"
      "| workload | step | step vs adam | compile vs adam |"
      " gradient data moved (HLO) |\n|---|---|---|---|---|\n"
      + "\n".join(lines)
      + "\n"
    )


if __name__ == "__main__":
  main()
