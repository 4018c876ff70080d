"""Why loss scaling matters: a float16 network trained four ways.

Run with `python -m optax_lossscale.demo` (`--help` for the flags; `--quick`
for a run of seconds). It trains
the same deep sigmoid network on scikit-learn's digits (shipped inside the
package: nothing is downloaded) with the standard mixed-precision recipe,
float32 master weights and float16 compute, and compares a float32 reference,
float16 without loss scaling, and float16 with `FixedLossScale` and
`DynamicLossScale`. It prints a table and writes a PNG of the loss curves and
the loss scale.

The setting is the textbook one where gradients get small: seven sigmoid
layers (LeCun-normal initialisation; a sigmoid's slope is at most 1/4, so the
gradients shrink layer by layer on the way back) and the loss averaged over
batches of 512, so each example contributes little. In float16, the first
layers' gradients then fall below the smallest subnormal (6e-8) and become
exactly zero unless the loss is scaled: without scaling those layers learn
late or not at all, and the network ends well behind the float32 reference;
with either loss scale it matches the reference. Adam's steps do not depend on
the size of the gradients, so in float32 (and in scaled float16) the small
gradients still train the first layers.

It then shows what goes wrong in float16 and what handles it. On the same
network, with `DynamicLossScale` and the loss passed as `value=`, it injects
NaN inputs at one step (a non-finite loss: skipped, the scale unchanged) and,
at another, a batch whose loss is weighted by `OVERFLOW_WEIGHT` (a finite loss
whose float16 gradients overflow: skipped, the scale halved, or kept with
`hysteresis=2`), and prints what `SkipMonitor` logs every `LOG_EVERY` steps. Last, with the loss summed
over the batch so that 2**15 overflows, it counts the batches dropped in the
first 100 steps with TensorFlow's defaults (`DynamicLossScale()` through
`apply_gradients`) and with `DynamicLossScale(initial_loss_scale=2**24)` and
`minimize(..., max_retries=16)`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pathlib
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

DEPTH = 7
WIDTH = 128
LEARNING_RATE = 3e-3
FIXED_SCALE = 2.0**12
# Steps run per compiled call (a `lax.scan`); the progress bar moves by these.
CHUNK = 50
# The failure-mode runs read the state with a SkipMonitor this often.
LOG_EVERY = 5


def _require(module: str) -> Any:
  try:
    return importlib.import_module(module)
  except ImportError:
    sys.exit(
      f"The demo needs {module!r}, which is not installed. Install the"
      " demo extra: pip install '.[demo]' from a checkout, or"
      " pip install 'optax_lossscale[demo]'."
    )


def _load_digits(seed: int) -> tuple[np.ndarray, ...]:
  datasets = _require("sklearn.datasets")
  x, y = datasets.load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  order = np.random.RandomState(seed).permutation(len(x))
  x, y = x[order], y[order].astype(np.int32)
  split = int(0.8 * len(x))
  return x[:split], y[:split], x[split:], y[split:]


def _init(key: jax.Array) -> list[dict[str, jax.Array]]:
  sizes = [64] + [WIDTH] * DEPTH + [10]
  params = []
  for i, (fan_in, fan_out) in enumerate(
    zip(sizes[:-1], sizes[1:], strict=True)
  ):
    # LeCun normal: weights of variance 1 / fan_in.
    w = jax.random.normal(jax.random.fold_in(key, i), (fan_in, fan_out))
    params.append({"w": w / np.sqrt(fan_in), "b": jnp.zeros(fan_out)})
  return params


def _logits(params: Any, x: jax.Array, dtype: Any) -> jax.Array:
  h = x.astype(dtype)
  for i, layer in enumerate(params):
    h = h @ layer["w"].astype(dtype) + layer["b"].astype(dtype)[None, :]
    if i < len(params) - 1:
      h = jax.nn.sigmoid(h)
  return h


def _loss(params: Any, x: jax.Array, y: jax.Array, dtype: Any) -> jax.Array:
  # The cross-entropy of the low-precision logits, computed in float32.
  logits = _logits(params, x, dtype).astype(jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _make_chunk(dtype: Any, tx: ols.LossScaleOptimizer) -> Any:
  """A jitted function that runs a few training steps in one `lax.scan`."""

  def step(
    carry: tuple[Any, Any], batch: tuple[jax.Array, jax.Array]
  ) -> tuple[tuple[Any, Any], dict[str, jax.Array]]:
    params, opt_state = carry
    x, y = batch
    loss, grads = ols.scaled_value_and_grad(_loss)(
      opt_state, params, x, y, dtype
    )
    # Underflow: entries that float32 computes as non-zero and this run's
    # (scaled) low-precision backward pass returns as exactly zero.
    reference = jax.grad(_loss)(params, x, y, jnp.float32)
    lost = sum(
      jnp.sum((r != 0) & (g == 0))
      for r, g in zip(
        jax.tree.leaves(reference), jax.tree.leaves(grads), strict=True
      )
    )
    alive = sum(jnp.sum(r != 0) for r in jax.tree.leaves(reference))
    params, opt_state = tx.apply_gradients(grads, opt_state, params)
    stats = {
      "loss": loss,
      "loss_scale": opt_state.loss_scale(),
      "underflow": lost / jnp.maximum(alive, 1),
    }
    return (params, opt_state), stats

  @jax.jit
  def chunk(
    params: Any,
    opt_state: Any,
    x_train: jax.Array,
    y_train: jax.Array,
    indices: jax.Array,
  ) -> tuple[Any, Any, dict[str, jax.Array]]:
    batches = (x_train[indices], y_train[indices])
    (params, opt_state), stats = jax.lax.scan(
      step, (params, opt_state), batches
    )
    return params, opt_state, stats

  return chunk


RUNS = [
  ("float32 reference", jnp.float32, ols.NoOpLossScale()),
  ("float16, no loss scaling", jnp.float16, ols.NoOpLossScale()),
  (
    f"float16, FixedLossScale(2**{int(np.log2(FIXED_SCALE))})",
    jnp.float16,
    ols.FixedLossScale(FIXED_SCALE),
  ),
  (
    "float16, DynamicLossScale(increment_period=200)",
    jnp.float16,
    ols.DynamicLossScale(increment_period=200),
  ),
]


def train(
  name: str,
  dtype: Any,
  loss_scale: ols.LossScale,
  data: tuple[np.ndarray, ...],
  args: Any,
) -> dict[str, Any]:
  tqdm = _require("tqdm").tqdm
  x_train, y_train, x_test, y_test = data
  params = _init(jax.random.PRNGKey(args.seed))
  tx = ols.LossScaleOptimizer(optax.adam(LEARNING_RATE), loss_scale)
  opt_state = tx.init(params)
  run_chunk = _make_chunk(dtype, tx)
  rng = np.random.RandomState(args.seed + 1)
  x_device, y_device = jnp.asarray(x_train), jnp.asarray(y_train)
  chunks: list[dict[str, np.ndarray]] = []
  with tqdm(total=args.steps, desc=f"{name:<48}", leave=True) as bar:
    done = 0
    while done < args.steps:
      size = min(CHUNK, args.steps - done)
      indices = rng.randint(0, len(x_train), (size, args.batch_size))
      params, opt_state, stats = run_chunk(
        params, opt_state, x_device, y_device, indices
      )
      chunks.append(jax.device_get(stats))
      done += size
      bar.update(size)
  history = {
    key: [float(v) for c in chunks for v in c[key]] for key in chunks[0]
  }
  logits = _logits(params, jnp.asarray(x_test), dtype)
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
  return {
    "name": name,
    "history": history,
    "final_loss": float(np.mean(history["loss"][-20:])),
    "accuracy": accuracy,
    "underflow": float(np.mean(history["underflow"])),
    "first_underflow": history["underflow"][0],
    "skipped": int(opt_state.skipped_steps),
    "loss_scale": float(opt_state.loss_scale()),
  }


# --- failure modes: a NaN loss and an overflowing batch, injected ----------

# The overflowing batch: its loss is weighted by this (as an outlier batch of
# huge per-example losses would be). Its loss stays finite in float32; times
# the loss scale, its float16 gradients overflow.
OVERFLOW_WEIGHT = 2.0**12


def _weighted_loss(
  params: Any, x: jax.Array, y: jax.Array, weight: jax.Array
) -> jax.Array:
  return weight * _loss(params, x, y, jnp.float16)


def _make_fault_chunk(tx: ols.LossScaleOptimizer) -> Any:
  """A jitted `lax.scan` of float16 steps whose batches may be corrupted."""

  def step(
    carry: tuple[Any, Any], batch: tuple[jax.Array, ...]
  ) -> tuple[tuple[Any, Any], dict[str, jax.Array]]:
    params, state = carry
    x, y, nan, weight = batch
    x = jnp.where(nan, jnp.nan, x)  # NaN inputs: a failed forward pass
    before = state.loss_scale()
    loss, grads = ols.scaled_value_and_grad(_weighted_loss)(
      state, params, x, y, weight
    )
    params, state = tx.apply_gradients(grads, state, params, value=loss)
    stats = {
      "loss": loss,
      "scale_before": before,
      "loss_scale": state.loss_scale(),
    }
    return (params, state), stats

  @jax.jit
  def chunk(
    params: Any, state: Any, x: jax.Array, y: jax.Array, *xs: jax.Array
  ) -> tuple[Any, Any, dict[str, jax.Array]]:
    indices, nan, weight = xs
    batches = (x[indices], y[indices], nan, weight)
    (params, state), stats = jax.lax.scan(step, (params, state), batches)
    return params, state, stats

  return chunk


def failure_modes(
  hysteresis: int, data: tuple[np.ndarray, ...], args: Any
) -> dict[str, Any]:
  """Trains in float16 with a NaN-loss step and an overflowing step injected.

  The NaN inputs come at step `steps // 3 - 1`, the overflowing batch at
  `2 * steps // 3 - 1` (numbered from 0, as skip reports are); a `SkipMonitor` reads the state every
  `LOG_EVERY` steps and collects what it logs.
  """
  x_train, y_train = jnp.asarray(data[0]), jnp.asarray(data[1])
  reports: list[ols.SkipReport] = []
  monitor = ols.SkipMonitor(max_consecutive_skips=20, log=reports.append)
  tx = ols.LossScaleOptimizer(
    optax.adam(LEARNING_RATE),
    ols.DynamicLossScale(increment_period=200, hysteresis=hysteresis),
  )
  params = _init(jax.random.PRNGKey(args.seed))
  state = tx.init(params)
  # Numbered from 0, as the skip reports number steps.
  nan_step, overflow_step = (
    max(args.steps // 3, 1) - 1,
    max(2 * args.steps // 3, 2) - 1,
  )
  nan = np.zeros(args.steps, bool)
  weight = np.ones(args.steps, np.float32)
  nan[nan_step] = True
  weight[overflow_step] = OVERFLOW_WEIGHT
  run_chunk = _make_fault_chunk(tx)
  rng = np.random.RandomState(args.seed + 1)
  chunks = []
  for start in range(0, args.steps, LOG_EVERY):
    stop = min(start + LOG_EVERY, args.steps)
    indices = rng.randint(0, len(data[0]), (stop - start, args.batch_size))
    params, state, stats = run_chunk(
      params,
      state,
      x_train,
      y_train,
      indices,
      nan[start:stop],
      weight[start:stop],
    )
    monitor(state)
    chunks.append(jax.device_get(stats))
  history = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
  assert state.nonfinite_loss_steps is not None  # a fresh state counts them
  return {
    "hysteresis": hysteresis,
    "history": history,
    "injected": {"NaN inputs": nan_step, "overflowing batch": overflow_step},
    "reports": reports,
    "skipped": int(state.skipped_steps),
    "nonfinite_loss": int(state.nonfinite_loss_steps),
  }


def _describe_faults(run: dict[str, Any]) -> list[str]:
  h = run["history"]
  lines = [
    f"DynamicLossScale(increment_period=200, hysteresis={run['hysteresis']}):"
  ]
  lines += [f"  log: {r}" for r in run["reports"]]
  for what, step in run["injected"].items():
    before, after = h["scale_before"][step], h["loss_scale"][step]
    verdict = "unchanged" if after == before else "lowered"
    if after == before and what == "overflowing batch":
      verdict += ": hysteresis spent its budget instead"
    lines.append(
      f"  step {step} ({what}, loss {h['loss'][step]:.4g}): loss scale"
      f" {before:g} -> {after:g} ({verdict})"
    )
  lines.append(
    f"  {run['skipped']} steps skipped, {run['nonfinite_loss']} of them with"
    " a non-finite loss"
  )
  return lines


# --- dropped batches: TensorFlow's defaults against retries -----------------


def _summed_loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
  # Summed, not averaged, over the batch: a loss whose float16 gradients
  # overflow at 2**15 (Adam's steps do not depend on the factor).
  return x.shape[0] * _loss(params, x, y, jnp.float16)


def dropped_batches(data: tuple[np.ndarray, ...], args: Any) -> dict[str, int]:
  """Batches dropped in the first 100 steps (of the summed loss), two ways.

  TensorFlow's defaults (`DynamicLossScale()`: 2**15, increment period 2000)
  through `apply_gradients`, which drops each overflowed batch, against
  `DynamicLossScale(initial_loss_scale=2**24)` and `minimize(...,
  max_retries=16)`, which recomputes it at a lower scale and applies it;
  the scale comes down one halving per overflowed step, as without retries.
  """
  steps = min(100, args.steps)
  tf_tx = ols.LossScaleOptimizer(
    optax.adam(LEARNING_RATE), ols.DynamicLossScale()
  )
  retry_tx = ols.LossScaleOptimizer(
    optax.adam(LEARNING_RATE), ols.DynamicLossScale(initial_loss_scale=2**24)
  )

  def tf_step(carry: Any, batch: Any) -> tuple[Any, None]:
    params, state = carry
    loss, grads = ols.scaled_value_and_grad(_summed_loss)(state, params, *batch)
    return tf_tx.apply_gradients(grads, state, params), None

  def retry_step(carry: Any, batch: Any) -> tuple[Any, None]:
    _, params, state = retry_tx.minimize(
      _summed_loss, *carry, *batch, max_retries=16
    )
    return (params, state), None

  @jax.jit
  def run(params: Any, indices: jax.Array) -> tuple[Any, Any]:
    batches = (jnp.asarray(data[0])[indices], jnp.asarray(data[1])[indices])
    (_, tf_state), _ = jax.lax.scan(
      tf_step, (params, tf_tx.init(params)), batches
    )
    (_, retry_state), _ = jax.lax.scan(
      retry_step, (params, retry_tx.init(params)), batches
    )
    return tf_state, retry_state

  rng = np.random.RandomState(args.seed + 2)
  indices = rng.randint(0, len(data[0]), (steps, args.batch_size))
  tf_state, retry_state = run(_init(jax.random.PRNGKey(args.seed)), indices)
  return {
    "steps": steps,
    "tf_dropped": int(tf_state.skipped_steps),
    "tf_scale": float(tf_state.loss_scale()),
    "retry_dropped": int(retry_state.skipped_steps),
    "retries": int(retry_state.retries),
    "retry_scale": float(retry_state.loss_scale()),
  }


def _failure_text(faults: list[dict[str, Any]], dropped: dict[str, int]) -> str:
  lines = [
    "\nFailure modes, float16, same network: NaN inputs at one step (the loss"
    f" is NaN) and, at another, a batch whose loss is weighted by"
    f" {OVERFLOW_WEIGHT:g} (finite loss, overflowing float16 gradients);"
    f" the loss is passed as value=, a SkipMonitor logs every {LOG_EVERY}"
    " steps."
  ]
  for run in faults:
    lines += _describe_faults(run)
  n = dropped["steps"]
  lines += [
    f"\nBatches dropped in the first {n} steps, with the loss summed (not"
    " averaged) over the batch so that 2**15 overflows:",
    f"  TensorFlow's defaults, DynamicLossScale() (2**15, increment period"
    f" 2000), apply_gradients: {dropped['tf_dropped']} dropped; loss scale"
    f" now {dropped['tf_scale']:g}",
    f"  DynamicLossScale(initial_loss_scale=2**24), minimize(max_retries=16):"
    f" {dropped['retry_dropped']} dropped, {dropped['retries']} retries;"
    f" loss scale now {dropped['retry_scale']:g}",
  ]
  return "\n".join(lines)


def _table(results: list[dict[str, Any]]) -> str:
  header = (
    f"{'run':<50}{'final loss':>11}{'test acc':>10}"
    f"{'underflow@0':>13}{'underflow':>11}{'skipped':>9}"
    f"{'loss scale':>12}"
  )
  lines = [header, "-" * len(header)]
  for r in results:
    lines.append(
      f"{r['name']:<50}{r['final_loss']:>11.4f}{r['accuracy']:>10.1%}"
      f"{r['first_underflow']:>13.1%}{r['underflow']:>11.2%}"
      f"{r['skipped']:>9d}{r['loss_scale']:>12g}"
    )
  return "\n".join(lines)


def _write_table(table: str, argv: Sequence[str], png: str) -> str:
  """Writes the table beside the plot, with its command, machine and date."""
  path = pathlib.Path(png).with_suffix(".txt")
  command = " ".join(["python -m optax_lossscale.demo", *argv])
  machine = (
    f"{platform.machine()} {jax.default_backend()}, {os.cpu_count()} cores;"
    f" jax {jax.__version__}, optax {optax.__version__}"
  )
  date = datetime.date.today().isoformat()
  path.write_text(f"{command}\n{machine}\n{date}\n\n{table}\n")
  return str(path)


def _plot(
  results: list[dict[str, Any]], faults: list[dict[str, Any]], path: str
) -> None:
  matplotlib = _require("matplotlib")
  matplotlib.use("Agg")
  plt = _require("matplotlib.pyplot")
  fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 3.8))
  # The scaled runs follow the float32 reference closely: float32 is a wide
  # pale band under their dashed and dotted lines. A run has one colour in
  # both panels.
  styles = [("-", 5, 0.35), ("-", 1.5, 1), ("--", 1.5, 1), (":", 2, 1)]
  for i, (r, (style, width, alpha)) in enumerate(
    zip(results, styles, strict=True)
  ):
    loss = np.asarray(r["history"]["loss"])
    smooth = np.convolve(loss, np.ones(10) / 10, mode="valid")
    line = dict(color=f"C{i}", label=r["name"])
    ax1.plot(smooth, style, linewidth=width, alpha=alpha, **line)
    if "LossScale(" in r["name"]:
      ax2.plot(r["history"]["loss_scale"], **line)
  for f, style in zip(faults, ["-", "--"], strict=False):
    ax3.plot(
      np.arange(len(f["history"]["loss_scale"])),  # from 0, as the faults
      f["history"]["loss_scale"],
      style,
      label=f"hysteresis={f['hysteresis']}",
    )
  if faults:
    for (what, step), color in zip(
      faults[0]["injected"].items(), ["tab:red", "tab:purple"], strict=True
    ):
      ax3.axvline(
        step, color=color, linestyle=":", label=f"{what} (step {step})"
      )
  ax1.set(title="training loss (10-step mean)", xlabel="step", yscale="log")
  ax2.set(title="loss scale", xlabel="step", yscale="log")
  ax3.set(title="loss scale, faults injected (float16)", xlabel="step")
  for ax in (ax2, ax3):
    ax.set_yscale("log", base=2)
  for ax in (ax1, ax2, ax3):
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


# `--quick`: a first look in seconds: the steps and batch size that
# `--steps` and `--batch-size` otherwise default to.
QUICK_STEPS, QUICK_BATCH_SIZE = 15, 32


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """The command line's arguments; exits with a message if one is invalid."""
  parser = argparse.ArgumentParser(
    prog="python -m optax_lossscale.demo",
    description="Train a float16 network on scikit-learn's digits with and"
    " without loss scaling, and compare.",
  )
  parser.add_argument(
    "--steps",
    type=int,
    help="training steps per run (default: 400; 15 with --quick)",
  )
  parser.add_argument("--seed", type=int, default=0, help="random seed")
  parser.add_argument(
    "--batch-size",
    type=int,
    help="examples per step; the loss is their mean (default: 512; 32 with"
    " --quick)",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="a short run: fewer steps on smaller batches",
  )
  parser.add_argument(
    "--out",
    help="where to write the plot; the table goes beside it, as .txt"
    " (default: lossscale_demo.png; lossscale_demo_quick.png with --quick)",
  )
  args = parser.parse_args(argv)
  if args.steps is None:
    args.steps = QUICK_STEPS if args.quick else 400
  if args.batch_size is None:
    args.batch_size = QUICK_BATCH_SIZE if args.quick else 512
  if args.out is None:
    args.out = (
      "lossscale_demo_quick.png" if args.quick else "lossscale_demo.png"
    )
  if args.steps < 1 or args.batch_size < 1:
    parser.error("--steps and --batch-size must be positive")
  return args


def setting(args: argparse.Namespace) -> str:
  """What the demo trains, and what its table's columns mean."""
  return (
    f"Setting: {DEPTH} sigmoid layers of width {WIDTH} (LeCun-normal"
    f" initialisation); Adam (learning rate {LEARNING_RATE}); float32 master"
    f" weights, float16 compute; {args.steps} steps, each the mean loss over"
    f" a batch of {args.batch_size}, on scikit-learn's digits (1,437 train /"
    " 360 test images).\n"
    "Sigmoids shrink the gradients layer by layer on the way back, and the"
    " mean over a large batch makes each example's share small: in float16"
    " the first layers' gradients fall below the smallest subnormal (6e-8)"
    " and underflow to zero unless the loss is scaled.\n"
    "underflow@0: share of the gradient entries lost at step 0, the first;"
    " underflow: the mean over the run."
    + (
      "\n--quick: a smoke run on small batches; its numbers show nothing."
      if args.quick
      else ""
    )
  )


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = parse_args(argv)
  for module in ("sklearn.datasets", "tqdm", "matplotlib"):
    _require(module)
  print(setting(args))
  start = time.perf_counter()
  data = _load_digits(args.seed)
  results = [train(name, dtype, ls, data, args) for name, dtype, ls in RUNS]
  table = _table(results)
  print()
  print(table)
  faults = [failure_modes(h, data, args) for h in (1, 2)]
  dropped = dropped_batches(data, args)
  print(_failure_text(faults, dropped))
  _plot(results, faults, args.out)
  text = _write_table(table, sys.argv[1:] if argv is None else argv, args.out)
  print(
    f"\nPlot written to {args.out}, table to {text};"
    f" {time.perf_counter() - start:.0f} s in all."
  )
  return results


if __name__ == "__main__":
  main()
