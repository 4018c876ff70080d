"""Bad batches on real text: the spike rule skips them, at no step cost.

Usage: python benchmarks/bad_batches.py [--quick] [--batch-size N]
         [--seed N] [--out PATH]

Trains the byte-level GPT of `examples/real_text.py` (its model, data, loss,
Adam schedule and held-out evaluation, imported by path) in float16 compute
with float32 master weights, through `LossScaleOptimizer(adam(cfg),
DynamicLossScale(...), max_norm=1.0, spike_sigmas=6.0).minimize(...,
max_retries=8)`, three ways from the same initialisation on the same
batches, in turns in one process:

- (a) clean batches, the spike rule on;
- (b) three bad batches injected, the rule on;
- (c) the same bad batches, the rule off (`spike_sigmas=None`).

The bad batches, at fixed steps once the rule's window is half full and
more than a window apart (a skipped spike enters the window, so a second
one within a window is judged against a wider spread):

- gradients x100: the batch's gradients multiplied by 100, its loss as it
  was, finite in float16 at the run's scale: the norm row spikes;
- loss x1e4: the batch's loss multiplied by 1e4, whose float16 backward
  pass overflows at the run's scale, so `max_retries` recomputes it at
  lower scales until it fits; then it is judged, and spikes;
- random bytes: a batch of uniform random bytes in place of text: the loss
  row spikes.

The multipliers are traced arguments of the loss (and the random bytes
are data), so one compiled step serves every step of a run. Checks, which
fail the script (exit status 1, after writing its files): the x100 batch
needed no retry and the x1e4 batch some (the premises); every bad batch
skipped in (b) with the reason "spike"; no spike skipped in (a); (b)'s final
held-out loss within 0.5% of (a)'s. Then the step time with the rule on
against the rule off, in turns, chunk by chunk, on clean batches.

Writes benchmarks/BAD_BATCHES.md and benchmarks/bad_batches.png. `--quick`:
a 1-layer model, a window of 16, 64 steps, writing nothing unless `--out`
(the results file, or a folder; the figure goes beside it). `--batch-size`
and `--seed` change the model's configuration (32 windows a step, seed 0),
and also write only with `--out`: at 8 windows a step the clean data's own
outliers are skipped as spikes in (a).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import pathlib
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import _timing
import jax
import jax.numpy as jnp
import numpy as np

import optax_lossscale as ols

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = pathlib.Path(__file__).with_name("BAD_BATCHES.md")
FIGURE = "bad_batches.png"
# The injected batches, in the order they come.
GRADS, OVERFLOW, BYTES = "gradients x100", "loss x1e4", "random bytes"
INJECTED = (GRADS, OVERFLOW, BYTES)
GRAD_MULTIPLIER, LOSS_MULTIPLIER = 100.0, 1e4
# The runs, in the order they take turns.
CLEAN, BAD, OFF = "clean", "bad", "off"
RUN_NAMES = {
  CLEAN: "(a) clean, rule on",
  BAD: "(b) bad batches, rule on",
  OFF: "(c) bad batches, rule off",
}


def real_text() -> types.ModuleType:
  """`examples/real_text.py`, loaded from its file (it is no package)."""
  name = "bad_batches_real_text"  # its own: tests load it as `real_text`
  if name not in sys.modules:
    path = ROOT / "examples" / "real_text.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
  return sys.modules[name]


@dataclasses.dataclass(frozen=True)
class Setup:
  """One experiment: the model's `real_text.Config` and the optimizer's."""

  model: Any  # real_text.Config
  spike_window: int
  initial_scale: float
  timing_rounds: int  # rounds of rule on / rule off, for the step time
  timing_chunk: int  # steps each, per round
  spike_sigmas: float = 6.0
  max_norm: float = 1.0
  max_retries: int = 8
  # (b)'s final held-out loss within this of (a)'s; None: not checked (a
  # quick run's few steps, three of them skipped, say nothing of it).
  loss_bar: float | None = 0.005

  @property
  def injected(self) -> dict[int, str]:
    """Step -> kind: the first at 3/4 of a window (the rule judges from half
    a window), then every 5/4 of a window, so that none is in the window
    the next is judged against."""
    first, every = self.spike_window * 3 // 4, self.spike_window * 5 // 4
    return {first + i * every: kind for i, kind in enumerate(INJECTED)}


def _setups() -> tuple[Setup, Setup]:
  rt = real_text()
  full = Setup(
    model=rt.Config(
      layers=2,
      width=128,
      heads=4,
      seq_len=64,
      # At 8 windows a step, the clean data's own outliers (a row of a long
      # `####` banner) stand 6 to 15 sigmas out: `--batch-size 8`.
      batch_size=32,
      steps=512,
      chunk=32,  # steps a run takes before the next takes its turn
      eval_every=64,
      eval_batches=4,
      corpus_bytes=2_000_000,
    ),
    spike_window=128,  # OLMo-core's, Levanter's and MaxText's default
    initial_scale=2.0**10,
    timing_rounds=6,
    timing_chunk=12,
  )
  quick = Setup(
    model=rt.Config(
      layers=1,
      width=64,
      heads=2,
      seq_len=64,
      batch_size=8,
      steps=64,
      chunk=8,
      eval_every=16,
      eval_batches=4,
      corpus_bytes=1_000_000,
    ),
    spike_window=16,
    initial_scale=2.0**8,
    timing_rounds=3,
    timing_chunk=4,
    loss_bar=None,
  )
  return full, quick


FULL, QUICK = _setups()


# --- the step ---------------------------------------------------------------


def make_loss(setup: Setup) -> Callable[..., jax.Array]:
  """real_text's float16 loss with two traced multipliers.

  `loss_multiplier` multiplies the loss (and so its gradients);
  `grad_multiplier` multiplies the gradients alone: the value is the loss
  as it was (`stop_gradient`), its derivative `grad_multiplier` times the
  loss's.
  """
  base = real_text().make_loss(setup.model, jnp.float16)

  def loss_fn(params, batch, loss_multiplier, grad_multiplier):
    loss = base(params, batch) * loss_multiplier
    frozen = jax.lax.stop_gradient(loss)
    return frozen + grad_multiplier * (loss - frozen)

  return loss_fn


def make_optimizer(setup: Setup, rule: bool) -> ols.LossScaleOptimizer:
  """The optimizer of the runs, the spike rule on or off."""
  spikes = (
    {"spike_sigmas": setup.spike_sigmas, "spike_window": setup.spike_window}
    if rule
    else {}  # spike_sigmas=None, the default
  )
  return ols.LossScaleOptimizer(
    real_text().adam(setup.model),
    ols.DynamicLossScale(setup.initial_scale),
    max_norm=setup.max_norm,
    **spikes,
  )


def compile_step(
  setup: Setup, tx: ols.LossScaleOptimizer, params: Any, options: Any = None
) -> Any:
  """`tx.minimize` of `make_loss`, jitted, donating parameters and state.

  `step(params, state, batch, loss_multiplier, grad_multiplier)` returns
  `(params, state, loss)`. `options`: XLA's compiler options (the test
  compiles with less optimisation).
  """
  loss_fn = make_loss(setup)

  def step(params, state, batch, loss_multiplier, grad_multiplier):
    value, params, state = tx.minimize(
      loss_fn,
      params,
      state,
      batch,
      loss_multiplier,
      grad_multiplier,
      max_retries=setup.max_retries,
    )
    return params, state, value

  cfg = setup.model
  batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  state = jax.eval_shape(tx.init, params)
  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
    params, state, batch, scalar, scalar
  )
  return lowered.compile(options)


# --- the data ---------------------------------------------------------------


def inputs(
  setup: Setup, batches: np.ndarray, bad: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each step's batch, loss multiplier and gradient multiplier."""
  batches = batches.copy()
  steps = len(batches)
  loss_multiplier = np.ones(steps, np.float32)
  grad_multiplier = np.ones(steps, np.float32)
  if bad:
    rng = np.random.default_rng(setup.model.seed + 1)
    for step, kind in setup.injected.items():
      if kind == GRADS:
        grad_multiplier[step] = GRAD_MULTIPLIER
      elif kind == OVERFLOW:
        loss_multiplier[step] = LOSS_MULTIPLIER
      else:
        batches[step] = rng.integers(0, 256, batches[step].shape, np.int32)
  return (
    jnp.asarray(batches),
    jnp.asarray(loss_multiplier),
    jnp.asarray(grad_multiplier),
  )


# --- training ---------------------------------------------------------------


HISTORY = (
  "loss",
  "grad_norm",
  "applied",
  "retries",
  "scale",
  "norm_threshold",
  "loss_threshold",
)


@dataclasses.dataclass
class Run:
  """One run: its compiled step, carry, data, and what each step did.

  `history[k][i]` is step i's: the loss `minimize` returned, the global
  norm, whether it was applied, the retries so far, the loss scale after
  it, and the thresholds (norm, loss) the rule judged it against (nan where
  the rule is off or the window not yet half full). `reports[i]` is step
  i's `SkipReport`, for each skipped step.
  """

  key: str  # CLEAN, BAD or OFF
  rule: bool
  step: Any
  params: Any
  state: Any
  data: tuple[jax.Array, jax.Array, jax.Array]
  reports: dict[int, ols.SkipReport] = dataclasses.field(default_factory=dict)
  history: dict[str, list[float]] = dataclasses.field(
    default_factory=lambda: {k: [] for k in HISTORY}
  )
  evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)

  @property
  def name(self) -> str:
    return RUN_NAMES[self.key]


def window_thresholds(state: Any, sigmas: float) -> tuple[float, float]:
  """The next step's thresholds (norm, loss): the window's mean plus
  `sigmas` sample standard deviations, as the rule computes them; nan
  while the window is less than half full (the rule judges nothing) or
  where the rule is off."""
  window = jax.device_get(state.spikes)
  if not window:  # `spike_sigmas=None`: no window
    return math.nan, math.nan
  length = window.values.shape[-1]
  held = window.values[:, : min(int(window.written), length)]
  if held.shape[-1] < max(2, length // 2):
    return math.nan, math.nan
  norm, loss = held.mean(-1) + sigmas * held.std(-1, ddof=1)
  return float(norm), float(loss)


def train(
  setup: Setup,
  runs: list[Run],
  held_out: jax.Array | None,
  log: Callable[..., Any] = print,
) -> None:
  """Every run on its batches; they take turns chunk by chunk.

  Each step is read on the host (its loss, norm, whether it was applied,
  the window's thresholds before it) and `SkipMonitor` reads the state, so
  every skip's report is kept.
  """
  rt, cfg = real_text(), setup.model
  evaluate = lambda run: rt.evaluate(run.params, cfg, held_out)  # noqa: E731
  monitors = {}
  for run in runs:
    monitors[run.key] = ols.SkipMonitor(
      log=lambda report, run=run: run.reports.__setitem__(report.step, report)
    )
    if held_out is not None:
      run.evals.append((0, evaluate(run)))
  for start in range(0, cfg.steps, cfg.chunk):
    stop = min(start + cfg.chunk, cfg.steps)
    for run in runs:
      batches, loss_multiplier, grad_multiplier = run.data
      for i in range(start, stop):
        thresholds = window_thresholds(run.state, setup.spike_sigmas)
        run.params, run.state, value = run.step(
          run.params,
          run.state,
          batches[i],
          loss_multiplier[i],
          grad_multiplier[i],
        )
        s = run.state
        got = jax.device_get(
          (value, s.grad_norm, s.should_apply, s.retries, s.loss_scale())
        )
        for key, x in zip(HISTORY, (*got, *thresholds), strict=True):
          run.history[key].append(float(x))
        monitors[run.key](run.state)
    if held_out is not None and (
      stop % cfg.eval_every == 0 or stop == cfg.steps
    ):
      for run in runs:
        run.evals.append((stop, evaluate(run)))
    log(f"step {stop}/{cfg.steps}")


def time_rule(
  setup: Setup,
  params0: Any,
  steps: dict[bool, tuple[Any, Any]],
  batches: jax.Array,
) -> dict[bool, list[float]]:
  """Seconds per step, rule on (True) and off (False), per round.

  In turns, the order swapped each round, `timing_chunk` donated steps
  each on clean batches, after one warm-up chunk each.
  """
  one = jnp.ones((), jnp.float32)
  carry = {}
  for rule, (tx, _) in steps.items():
    params = jax.tree.map(jnp.copy, params0)
    carry[rule] = (params, tx.init(params))
  seconds: dict[bool, list[float]] = {rule: [] for rule in steps}
  n = setup.timing_chunk
  for r in range(setup.timing_rounds + 1):  # round 0 warms up
    order = [True, False] if r % 2 else [False, True]
    for rule in order:
      step = steps[rule][1]
      params, state = carry[rule]
      begin = time.perf_counter()
      for i in range(n):
        batch = batches[(r * n + i) % len(batches)]
        params, state, _ = step(params, state, batch, one, one)
      jax.block_until_ready((params, state))
      if r:
        seconds[rule].append((time.perf_counter() - begin) / n)
      carry[rule] = (params, state)
  return seconds


def run_all(
  setup: Setup,
  keys: tuple[str, ...] = (CLEAN, BAD, OFF),
  evaluate: bool = True,
  timing: bool = True,
  options: Any = None,
  log: Callable[..., Any] = print,
) -> dict[str, Any]:
  """The runs `keys` (of CLEAN, BAD, OFF), optionally evaluated and timed.

  Returns:
    `{"runs": {key: Run}, "seconds": {rule: [s per step]} or None,
    "corpus": {...}, "checks": [(description, passed)]}`.
  """
  rt, cfg = real_text(), setup.model
  train_bytes, held_bytes, files = rt.load_corpus(cfg.corpus_bytes)
  clean = rt.train_batches(train_bytes, cfg)
  held_out = jnp.asarray(rt.eval_batches(held_bytes, cfg)) if evaluate else None
  # Jitted: one compile, where each leaf's draw would compile alone (the
  # same draws as real_text's eager call, to float32 rounding).
  init = jax.jit(rt.init_params, static_argnums=1)
  params0 = init(jax.random.PRNGKey(cfg.seed), cfg)
  steps: dict[bool, tuple[Any, Any]] = {}
  for rule in sorted({key != OFF for key in keys}, reverse=True):
    tx = make_optimizer(setup, rule)
    begin = time.perf_counter()
    steps[rule] = (tx, compile_step(setup, tx, params0, options))
    log(
      f"compiled, rule {'on' if rule else 'off'}:"
      f" {time.perf_counter() - begin:.1f} s"
    )
  runs = []
  for key in keys:
    tx, step = steps[key != OFF]
    params = jax.tree.map(jnp.copy, params0)
    data = inputs(setup, clean, bad=key != CLEAN)
    runs.append(Run(key, key != OFF, step, params, tx.init(params), data))
  train(setup, runs, held_out, log)
  seconds = None
  if timing and len(steps) == 2:
    seconds = time_rule(setup, params0, steps, jnp.asarray(clean))
  corpus = {
    "files": files,
    "train": len(train_bytes),
    "held_out": len(held_bytes),
    "params": sum(x.size for x in jax.tree.leaves(params0)),
  }
  by_key = {run.key: run for run in runs}
  return {
    "runs": by_key,
    "seconds": seconds,
    "corpus": corpus,
    "checks": checks(setup, by_key),
  }


# --- checks -----------------------------------------------------------------


def applied(run: Run, step: int) -> bool:
  return bool(run.history["applied"][step])


def retried(run: Run, step: int) -> int:
  """How many times `minimize` recomputed the batch of `step`."""
  retries = run.history["retries"]
  return int(retries[step] - (retries[step - 1] if step else 0))


def final(run: Run) -> float:
  return run.evals[-1][1]


def checks(setup: Setup, runs: dict[str, Run]) -> list[tuple[str, bool]]:
  """The script's assertions, as (what, whether it holds)."""
  out = []
  if BAD in runs:
    bad = runs[BAD]
    # The experiment's premises: the x100 batch is finite in float16 at the
    # run's scale, the x1e4 batch overflows and is recomputed.
    for step, kind in setup.injected.items():
      if kind in (GRADS, OVERFLOW):
        n = retried(bad, step)
        want = "needed no retry" if kind == GRADS else "was recomputed"
        out.append(
          (
            f"(b): the {kind} batch at step {step} {want} (retries: {n})",
            (n == 0) == (kind == GRADS),
          )
        )
    for step, kind in setup.injected.items():
      report = bad.reports.get(step)
      reason = None if report is None else report.reason
      out.append(
        (
          f"(b) skips the {kind} batch at step {step}, reason 'spike'"
          f" (got {'applied' if applied(bad, step) else 'skipped'},"
          f" reason {reason!r})",
          not applied(bad, step) and reason == "spike",
        )
      )
  if CLEAN in runs:
    spikes = clean_spikes(runs)
    out.append(
      (f"(a) skips no spike (steps skipped as spikes: {spikes})", not spikes)
    )
    bar = setup.loss_bar
    if BAD in runs and runs[BAD].evals and bar is not None:
      r = final(runs[BAD]) / final(runs[CLEAN])
      out.append(
        (
          f"(b)'s final held-out loss within {bar:.1%} of (a)'s"
          f" (ratio {r:.4f})",
          abs(r - 1) <= bar,
        )
      )
  return out


# --- the results file -------------------------------------------------------


def _skips(run: Run) -> str:
  reasons = [r.reason for r in run.reports.values()]
  kinds = ("spike", "overflow", "non-finite loss")
  counts = " / ".join(str(reasons.count(k)) for k in kinds)
  return f"{int(run.state.skipped_steps)} ({counts})"


def results_table(setup: Setup, runs: dict[str, Run]) -> list[str]:
  clean = runs[CLEAN]
  lines = [
    "| run | final held-out loss | vs (a) | skipped steps (spike / overflow"
    " / non-finite loss) | retries | final loss scale |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for run in runs.values():
    r = final(run) / final(clean)
    lines.append(
      f"| {run.name} | {final(run):.4f} | {r:.4f}x ({(r - 1) * 100:+.2f}%) |"
      f" {_skips(run)} | {int(run.state.retries)} |"
      f" {float(run.state.loss_scale()):g} |"
    )
  return lines


def _spiked(report: ols.SkipReport | None) -> str:
  if report is None or not report.spike:
    return "-"
  return "; ".join(
    f"{name} {value:.4g} > {threshold:.4g}"
    for name, value, _, _, threshold in report.spike
  )


def _threshold_ratio(run: Run, step: int) -> str:
  """The thresholds (norm, loss) for the step after `step` against those
  for `step`: how far a skipped spike widens the window."""
  h = run.history
  if step + 1 >= len(h["loss"]):
    return "-"
  ratios = [
    h[f"{row}_threshold"][step + 1] / h[f"{row}_threshold"][step]
    for row in ("norm", "loss")
  ]
  return ", ".join(f"{r:.1f}x" for r in ratios)


def _state_of(run: Run, step: int) -> str:
  done = "applied" if applied(run, step) else "skipped"
  report = run.reports.get(step)
  return done if report is None else f"{done} ({report.reason})"


def injected_table(setup: Setup, runs: dict[str, Run]) -> list[str]:
  bad, off = runs[BAD], runs[OFF]
  lines = [
    "| step | injected batch | (b) rule on | value > threshold | retries |"
    " thresholds after / before (norm, loss) | (c) rule off | (c)'s retries"
    " | (c)'s norm |",
    "|---:|---|---|---|---:|---|---|---:|---:|",
  ]
  for step, kind in setup.injected.items():
    lines.append(
      f"| {step} | {kind} | {_state_of(bad, step)} |"
      f" {_spiked(bad.reports.get(step))} | {retried(bad, step)} |"
      f" {_threshold_ratio(bad, step)} | {_state_of(off, step)} |"
      f" {retried(off, step)} | {off.history['grad_norm'][step]:.4g} |"
    )
  return lines


def clean_spikes(runs: dict[str, Run]) -> list[int]:
  """The steps (a) skipped as spikes."""
  reports = runs[CLEAN].reports
  return sorted(s for s, r in reports.items() if r.reason == "spike")


def clean_spike_table(runs: dict[str, Run]) -> list[str]:
  """Each spike (a) skipped: its z-scores, and what (b) and (c) did."""
  clean, bad, off = runs[CLEAN], runs[BAD], runs[OFF]
  lines = [
    "| step | (a): value > threshold (sigmas above the window's mean) |"
    " (b) rule on | (b)'s norm threshold there | (c) rule off |",
    "|---:|---|---|---:|---:|",
  ]
  for step in clean_spikes(runs):
    report = clean.reports[step]
    spiked = "; ".join(
      f"{name} {value:.4g} > {threshold:.4g} ({(value - mean) / std:.1f})"
      for name, value, mean, std, threshold in report.spike
    )
    lines.append(
      f"| {step} | {spiked} | {_state_of(bad, step)} (norm"
      f" {bad.history['grad_norm'][step]:.4g}) |"
      f" {bad.history['norm_threshold'][step]:.4g} | {_state_of(off, step)} |"
    )
  return lines


def timing_table(setup: Setup, seconds: dict[bool, list[float]]) -> list[str]:
  off = seconds[False]
  lines = [
    "| configuration | step time / rule off's | ms per step |",
    "|---|---|---|",
  ]
  for rule, label in (
    (False, "rule off (`spike_sigmas=None`)"),
    (True, f"rule on (`spike_sigmas={setup.spike_sigmas:g}`)"),
  ):
    ms = np.asarray(seconds[rule]) * 1e3
    lines.append(
      f"| {label} | {_timing.ratio_range(seconds[rule], off)} |"
      f" {np.median(ms):.1f} ({np.min(ms):.1f}-{np.max(ms):.1f}) |"
    )
  return lines


def describe(setup: Setup, corpus: dict[str, Any]) -> list[str]:
  cfg = setup.model
  warmup = max(cfg.steps // 10, 1)
  return [
    f"- model: `examples/real_text.py`'s causal transformer, {cfg.layers}"
    f" layer(s), width {cfg.width}, {cfg.heads} heads,"
    f" {corpus['params']:,} float32 parameters; float16 compute, the loss,"
    " softmax and LayerNorm statistics in float32",
    f"- data: {corpus['files']} files of this Python's standard library,"
    f" {corpus['train']:,} bytes to train on, {corpus['held_out']:,} held"
    f" out; {cfg.steps} steps of {cfg.batch_size} windows of"
    f" {cfg.seq_len} bytes, the same for every run; held-out loss in nats"
    f" per byte on {cfg.eval_batches * cfg.batch_size} windows, the float32"
    " master weights evaluated in float32",
    f"- optimizer: `LossScaleOptimizer(adam(cfg),"
    f" DynamicLossScale({setup.initial_scale:g}),"
    f" max_norm={setup.max_norm:g}, spike_sigmas={setup.spike_sigmas:g},"
    f" spike_window={setup.spike_window})` (`spike_sigmas=None` in (c)),"
    f" driven by `minimize(loss_fn, params, state, batch, ...,"
    f" max_retries={setup.max_retries})`; `adam(cfg)` is real_text's Adam,"
    f" learning rate {cfg.learning_rate:g} after a {warmup}-step warmup,"
    " cosine decay to a tenth",
  ]


TEXT = (
  "Three runs from the same initialisation on the same batches, in turns in"
  " one process: (a) clean batches, the spike rule on; (b) three bad"
  " batches injected, the rule on; (c) the same bad batches, the rule off."
  " The rule judges from step {half} (half the window of {window}); the bad"
  " batches come at steps {steps}, more than a window apart, because a"
  " skipped spike enters the window (the documented rule), and a second"
  " spike within a window is judged against the spread the first one"
  " widened (`thresholds after / before` below: the thresholds of the"
  " norm and the loss for the step after the skip, against those for the"
  " skipped step).\n\n"
  "- `gradients x100`: the loss function's gradients multiplied by {grads:g}"
  " (its value as it was, through `stop_gradient`): finite in float16 at"
  " the run's scale, {scale:g}, which has headroom. At a dynamic scale that"
  " has grown to the edge of float16's range, as it does over a long run,"
  " a batch this far out overflows and takes the retry path below.\n"
  "- `loss x1e4`: the loss multiplied by {loss:g}: finite, but its float16"
  " backward pass overflows, so `minimize` recomputes it at halved scales"
  " until it fits (`retries`), then the rule judges it.\n"
  "- `random bytes`: the batch replaced by uniform random bytes.\n\n"
  "{batch_note}\n\n"
  "The multipliers are traced arguments of the loss function and the"
  " random bytes are data: one compiled step serves every step of a run."
  " Each run's step is read on the host after every step, and"
  " `SkipMonitor(log=...)` keeps every skip's report.\n\n"
)


def clean_spike_text(setup: Setup, runs: dict[str, Run]) -> list[str]:
  """The spikes (a) skipped, if any: batches of the clean data."""
  if not clean_spikes(runs):
    return [
      f"(a), on the clean data, skipped no step as a spike at"
      f" `spike_sigmas={setup.spike_sigmas:g}`.",
      "",
    ]
  return [
    "(a) skipped steps of the clean data as spikes: batches of text whose"
    " norm or loss stood more than"
    f" {setup.spike_sigmas:g} standard deviations above the window's mean."
    " The rule skips them as it would a bad batch. (b) judged the same"
    " batches against its own window (its thresholds there), which may hold"
    " an injected batch; (c) does not judge.",
    "",
    "\n".join(clean_spike_table(runs)),
    "",
  ]


def batch_note(batch_size: int) -> str:
  """What the batch size does to the clean run's spikes."""
  eight = (
    "rows of the clean data itself, such as a long `#####` comment banner,"
    " move a step's norm 6 to 15 standard deviations above the window's"
    " mean, and the rule skips them in (a) as it would a bad batch"
  )
  if batch_size <= 8:
    return f"A step is {batch_size} windows; at 8, {eight}."
  return (
    f"A step is {batch_size} windows. At 8 (`--batch-size 8`), {eight};"
    f" among {batch_size} windows such a row weighs {8 / batch_size:.2g} as"
    " much."
  )


def report(
  setup: Setup,
  result: dict[str, Any],
  command: str,
  seconds: tuple[float, float],
) -> str:
  runs, timing = result["runs"], result["seconds"]
  clean, bad, off = runs[CLEAN], runs[BAD], runs[OFF]
  steps = ", ".join(str(s) for s in setup.injected)
  text = TEXT.format(
    half=setup.spike_window // 2,
    window=setup.spike_window,
    steps=steps,
    grads=GRAD_MULTIPLIER,
    scale=setup.initial_scale,
    loss=LOSS_MULTIPLIER,
    batch_note=batch_note(setup.model.batch_size),
  )
  failed = [what for what, ok in result["checks"] if not ok]
  verdicts = "\n".join(
    f"- {'holds' if ok else 'FAILS'}: {what}" for what, ok in result["checks"]
  )
  on = np.asarray(timing[True]) / np.asarray(timing[False])
  lines = [
    "# Bad batches on real text: the spike rule",
    "",
    _timing.header(command),
    *describe(setup, result["corpus"]),
    "",
    f"{seconds[0] / 60:.1f} minutes in all, {seconds[1] / 60:.1f} minutes of"
    f" CPU time; load average {os.getloadavg()[0]:.2f} at the end.",
    "",
    text
    + "\n".join(results_table(setup, runs))
    + "\n\n`vs (a)`: the final held-out loss against run (a)'s. `retries`:"
    " the forward and backward passes `minimize` spent recomputing"
    " overflowed batches.\n",
    "\n".join(injected_table(setup, runs)),
    "",
    "`value > threshold`: the quantities that spiked (`SkipReport.spike`)."
    " `(c)'s norm`: the batch's global norm where the rule is off, before"
    f" clipping to {setup.max_norm:g}.",
    "",
    *clean_spike_text(setup, runs),
    "Checks (the script exits with status 1 if one fails):",
    "",
    verdicts,
    "",
    f"(c), which applies the bad batches, ends at"
    f" {final(off) / final(clean):.4f}x (a)'s held-out loss; (b) at"
    f" {final(bad) / final(clean):.4f}x.",
    "",
    "## Step time",
    "",
    f"The same step with the rule on and off, on clean batches, in turns:"
    f" {setup.timing_rounds} rounds of {setup.timing_chunk} donated steps"
    " each (after a warm-up round), the order swapped each round. Each cell"
    " is the median of the rounds' ratios to the rule-off chunk of the same"
    " round, and their range. The rule reads nothing more of the gradients:"
    " the norm is the step's own, the loss is `value=`.",
    "",
    "\n".join(timing_table(setup, timing)),
    "",
    f"The rule on costs {np.median(on):.3f}x the rule off's step"
    f" (rounds {np.min(on):.3f}-{np.max(on):.3f}).",
    "",
    f"![loss, gradient norm and held-out loss of the three runs]({FIGURE})",
    "",
  ]
  if failed:
    lines += ["**Failed:** " + "; ".join(failed), ""]
  return "\n".join(lines)


def plot(setup: Setup, runs: dict[str, Run], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  styles = {CLEAN: "tab:blue", BAD: "tab:green", OFF: "tab:orange"}
  x = np.arange(setup.model.steps)
  for run in runs.values():
    color = styles[run.key]
    loss = np.asarray(run.history["loss"])
    norm = np.asarray(run.history["grad_norm"])
    axes[0].plot(x, loss, color=color, lw=0.8, label=run.name)
    axes[1].plot(x, norm, color=color, lw=0.8, label=run.name)
    skipped = ~np.asarray(run.history["applied"], bool)
    for ax, y in ((axes[0], loss), (axes[1], norm)):
      ax.plot(x[skipped], y[skipped], "x", color=color, ms=8, mew=2)
    if run.rule:  # the thresholds the rule judged each step against
      for ax, row in ((axes[0], "loss"), (axes[1], "norm")):
        threshold = run.history[f"{row}_threshold"]
        ax.plot(x, threshold, "--", color=color, lw=0.7, alpha=0.8)
    steps, held = zip(*run.evals, strict=True)
    axes[2].plot(steps, held, color=color, marker=".", label=run.name)
  for step in setup.injected:
    for ax in axes[:2]:
      ax.axvline(step, color="grey", ls=":", lw=0.8)
  axes[0].plot([], [], "kx", label="skipped step")
  axes[0].plot([], [], "k--", lw=0.7, label="rule's threshold (rule on)")
  axes[0].set(title="training loss (as minimize returns it)", yscale="log")
  axes[1].set(title="gradient norm (before clipping)", yscale="log")
  axes[2].set(title="held-out loss (nats/byte)")
  low = min(min(h for _, h in run.evals[1:]) for run in runs.values())
  axes[2].set_ylim(low * 0.97, low * 1.5)
  for ax in axes:
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=72)
  plt.close(fig)


# --- main -------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick",
    action="store_true",
    help="a 1-layer model, a window of 16, 64 steps; writes only with --out",
  )
  parser.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help="windows a step, in place of the configuration's; writes only"
    " with --out",
  )
  parser.add_argument(
    "--seed",
    type=int,
    default=None,
    help="the initialisation's and batches' seed (default 0); writes only"
    " with --out",
  )
  parser.add_argument(
    "--out",
    default=None,
    help=f"the results file, or a folder to write {OUT.name} into (default"
    f" {OUT.relative_to(ROOT)}, none with --quick); {FIGURE} goes beside it",
  )
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  setup = QUICK if args.quick else FULL
  changed = {
    k: v
    for k, v in (("batch_size", args.batch_size), ("seed", args.seed))
    if v is not None
  }
  setup = dataclasses.replace(
    setup, model=dataclasses.replace(setup.model, **changed)
  )
  command = _timing.command_line(None if argv is None else [__file__, *argv])
  print(_timing.header(command), flush=True)
  start, cpu = time.perf_counter(), time.process_time()
  result = run_all(setup)
  seconds = (time.perf_counter() - start, time.process_time() - cpu)
  text = report(setup, result, command, seconds)
  print(text, flush=True)
  # A quick or changed run writes only where --out says.
  default = None if args.quick or changed else str(OUT)
  out = default if args.out is None else args.out
  if out is not None:
    path = pathlib.Path(out)
    if path.is_dir():
      path = path / OUT.name
    path.write_text(text)
    plot(setup, result["runs"], path.with_name(FIGURE))
    print(f"wrote {path} and {path.with_name(FIGURE)}")
  failed = [what for what, ok in result["checks"] if not ok]
  for what in failed:
    print(f"FAILED: {what}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
