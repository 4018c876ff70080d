"""Gradient accumulation: `LossScaleOptimizer`'s `gradient_accumulation_steps`.

Windows follow the loop: the optimizer steps at every k-th micro-batch,
counting the dropped ones, on the mean of the micro-batches the window
kept; `state.stepped` says when it did. Each micro-batch is checked before
it is accumulated: a non-finite one is dropped alone and lowers the scale
at once; finite ones raise it once per window, and each restarts a
consecutive hysteresis. `max_norm` clips the window's mean, and `grad_norm`
is its norm, as `optax.MultiSteps(chain(clip_by_global_norm, inner), k)`
would. The window's counters and mean are the state's own fields
(`micro_step`, `accumulated`, `accumulator`): a state saved mid-window
resumes it. An `optax.MultiSteps` as `inner` is refused.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify

import optax_lossscale as ols

pytestmark = pytest.mark.usefixtures("standard_promotion")

K = 3  # micro-batches per window
FLAGS = np.random.default_rng(0).random(30) > 0.25


def _reference(flags, *, hysteresis, consecutive, scale=2.0**10, period=2):
  """(scale, num_good_steps) after each micro-batch, written out apart.

  Every micro-batch counts towards its window. A finite micro-batch is a
  finite step of the loss scale only when it closes its window; a
  non-finite one is a non-finite step at once. Every finite micro-batch
  restarts a consecutive hysteresis, also inside an open window.
  """
  good, bad, position, out = 0, 0, 0, []
  for finite in flags:
    position = (position + 1) % K
    if finite:
      if consecutive:
        bad = 0
      if position == 0:
        good += 1
        if good >= period:
          scale, good, bad = scale * 2, 0, 0
    else:
      good, bad = 0, min(bad + 1, hysteresis)
      if bad == hysteresis:
        scale = max(scale / 2, 1.0)
    out.append((scale, good))
  return out


def _inner():
  return optax.sgd(0.1, momentum=0.9)


def _accumulating(loss_scale, k=K, inner=None, **options):
  return ols.LossScaleOptimizer(
    _inner() if inner is None else inner,
    loss_scale,
    gradient_accumulation_steps=k,
    **options,
  )


class _Windows:
  """The reference: the mean of each window's kept micro-batches, given to
  `inner` (after `optax.clip_by_global_norm(max_norm)`) at the window's
  last micro-batch, counting dropped ones, as PyTorch's loop would.
  """

  def __init__(self, inner, k, max_norm=None):
    clip = (
      optax.identity()
      if max_norm is None
      else (optax.clip_by_global_norm(max_norm))
    )
    self.tx, self.k = optax.chain(clip, inner), k
    self.kept, self.position, self.state = [], 0, None
    self.norms, self.steps = [], []

  def __call__(self, params, grads, finite):
    if self.state is None:
      self.state = self.tx.init(params)
    if finite:
      self.kept.append(grads)
    self.position += 1
    if self.position < self.k:
      return params
    self.position, kept, self.kept = 0, self.kept, []
    if not kept:
      return params
    total = jax.tree.map(lambda *g: sum(g[1:], g[0]), *kept)
    window = jax.tree.map(lambda g: g / len(kept), total)
    self.norms.append(float(optax.tree.norm(window)))
    updates, self.state = self.tx.update(window, self.state, params)
    self.steps.append(True)
    return optax.apply_updates(params, updates)


def _scaled(grads, scale, finite):
  scaled = jax.tree.map(lambda g: g * scale, grads)
  if not finite:
    scaled["w"] = scaled["w"].at[1].set(jnp.inf)
  return scaled


@pytest.mark.parametrize(
  ("entry", "hysteresis", "consecutive", "value"),
  [
    ("apply_gradients", 1, False, False),
    ("update", 2, False, True),
    ("apply_gradients", 2, True, True),
  ],
)
def test_the_scale_moves_once_per_window_and_at_once_on_an_overflow(
  entry, hysteresis, consecutive, value
):
  ls = ols.DynamicLossScale(
    2.0**10, 2, hysteresis=hysteresis, consecutive_hysteresis=consecutive
  )
  tx = _accumulating(ls)
  reference = _Windows(_inner(), K)
  params = expected = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  state = tx.init(params)

  @jax.jit
  def step(grads, state, params, **extra):
    if entry == "apply_gradients":
      return tx.apply_gradients(grads, state, params, **extra)
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  extra = dict(value=jnp.float32(1.0)) if value else {}
  seen, stepped = [], 0
  for i, finite in enumerate(FLAGS):
    grads = {"w": jnp.full(3, 0.25 + i), "b": jnp.ones(2)}
    acc = state.accumulator
    params, state = step(
      _scaled(grads, state.loss_scale(), finite), state, params, **extra
    )
    expected = reference(expected, grads, finite)
    if not finite and (i + 1) % K:  # dropped alone: the accumulator is kept
      chex.assert_trees_all_equal(state.accumulator, acc)
    stepped += int(state.stepped)
    seen.append(
      (float(state.loss_scale()), int(state.loss_scale.num_good_steps))
    )
  want = _reference(FLAGS, hysteresis=hysteresis, consecutive=consecutive)
  assert seen == want
  scales = [s for s, _ in want]
  assert any(b > a for a, b in zip(scales, scales[1:], strict=False))
  assert any(b < a for a, b in zip(scales, scales[1:], strict=False))
  chex.assert_trees_all_close(params, expected, rtol=1e-6)
  assert stepped == len(reference.steps)
  assert int(state.skipped_steps) == int((~FLAGS).sum())


@pytest.mark.parametrize("accumulate", [True, False])
def test_a_kept_micro_batch_restarts_a_consecutive_hysteresis(accumulate):
  # The case: hysteresis 2, consecutive, k = 4; micro-batches
  # overflow, fit, overflow, fit. Each fitting one restarts the count of
  # bad steps, inside the open window too, as the same loop without
  # accumulation does: the two overflows are not consecutive, and the
  # scale holds. (Were only the window's last micro-batch to restart it,
  # the second overflow would halve the scale.)
  ls = ols.DynamicLossScale(2.0**10, hysteresis=2, consecutive_hysteresis=True)
  tx = (
    _accumulating(ls, 4) if accumulate else ols.LossScaleOptimizer(_inner(), ls)
  )
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients)
  grads = {"w": jnp.full(3, 0.5), "b": jnp.ones(2)}
  scales, bad = [], []
  for finite in [False, True, False, True]:
    params, state = step(
      _scaled(grads, state.loss_scale(), finite), state, params
    )
    scales.append(float(state.loss_scale()))
    bad.append(int(state.loss_scale.num_bad_steps))
  assert scales == [2.0**10] * 4
  assert bad == [1, 0, 1, 0]
  assert int(state.skipped_steps) == 2
  assert bool(state.stepped)  # the window kept two: it steps


# The loop, as PyTorch, DeepSpeed and Megatron-LM run it: 24
# micro-batches, k = 4, micro-batches 5, 6 and 13 overflowing; and 19, the
# last of its window, which then steps (and clips) on the three it kept.
LOOP = [i not in (5, 6, 13, 19) for i in range(24)]


@pytest.mark.parametrize("entry", ["apply_gradients", "update", "minimize"])
def test_windows_follow_the_loop_and_clip_the_mean_of_the_kept_ones(entry):
  adamw = optax.adamw(0.05, weight_decay=0.01)
  tx = _accumulating(ols.DynamicLossScale(2.0**8), 4, inner=adamw, max_norm=1.0)
  reference = _Windows(adamw, 4, max_norm=1.0)

  def loss(p, x):
    y = (p["w"] * x[0]).astype(jnp.float16) * x[1].astype(jnp.float16)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(p["b"] * x[0, :2])

  @jax.jit
  def step(params, state, x):
    if entry == "minimize":
      return tx.minimize(loss, params, state, x)[1:]
    _, grads = ols.scaled_value_and_grad(loss)(state, params, x)
    if entry == "apply_gradients":
      return tx.apply_gradients(grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = expected = {"w": jnp.linspace(-1.0, 1.0, 6), "b": jnp.ones(2)}
  state = tx.init(params)
  steps, norms = [], []
  for i, finite in enumerate(LOOP):
    x = jnp.stack(
      [jnp.full(6, 0.5 + i / 8), jnp.full(6, 1.0 if finite else 1e4)]
    )
    grads = jax.grad(loss)(expected, x)
    params, state = step(params, state, x)
    expected = reference(expected, grads, finite)
    if bool(state.stepped):
      steps.append(i)
      norms.append(float(state.grad_norm))
  assert steps == [3, 7, 11, 15, 19, 23]
  assert norms == pytest.approx(reference.norms, rel=1e-5)
  assert max(norms) > 1.0  # the clip acted
  chex.assert_trees_all_close(params, expected, rtol=2e-5, atol=1e-6)
  assert int(state.skipped_steps) == LOOP.count(False)
  assert int(state.accumulated) == 0 and int(state.micro_step) == 0


def test_a_window_holding_an_applied_inf_is_not_clipped_into_a_nan():
  # skip_nonfinite=False keeps an inf micro-batch; the window's mean holds
  # it, and its norm is inf. The clip leaves such a window as it is:
  # 0 * inf would be NaN. (The inf comes last: the running mean, as
  # `optax.MultiSteps`', turns an inf followed by a finite value into NaN.)
  tx = _accumulating(
    ols.NoOpLossScale(),
    2,
    inner=optax.sgd(1.0),
    max_norm=1.0,
    skip_nonfinite=False,
  )
  step = jax.jit(
    checkify.checkify(tx.apply_gradients, errors=checkify.nan_checks)
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for g in ([1.0, 1.0], [jnp.inf, 1.0]):
    error, (params, state) = step({"w": jnp.array(g)}, state, params)
    assert error.get() is None
  assert bool(state.stepped)
  assert float(state.grad_norm) == np.inf
  np.testing.assert_array_equal(params["w"], [-np.inf, -1.0])


@pytest.mark.parametrize("entry", ["update", "apply_gradients"])
def test_a_state_of_another_optimizer_is_refused_by_name(entry):
  params = {"w": jnp.ones(2)}
  plain = ols.LossScaleOptimizer(
    optax.sgd(0.1), ols.DynamicLossScale(8.0), gradient_accumulation_steps=K
  )
  tx = _accumulating(ols.DynamicLossScale(8.0))
  with pytest.raises(TypeError, match=r"`inner_state` is not of the structure"):
    getattr(tx, entry)(params, plain.init(params), params)


def test_a_window_that_kept_none_is_skipped():
  tx = _accumulating(ols.DynamicLossScale(2.0**10))
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  state = tx.init(params)
  grads = {"w": jnp.full(3, 0.5), "b": jnp.ones(2)}
  step = jax.jit(tx.apply_gradients)
  stepped = []
  for _ in range(K):  # the first window steps
    params, state = step(grads, state, params)
    stepped.append(bool(state.stepped))
  before = (params, state.inner_state)
  for _ in range(K):
    params, state = step(_scaled(grads, 1.0, False), state, params)
    stepped.append(bool(state.stepped))
  chex.assert_trees_all_equal((params, state.inner_state), before)
  assert stepped == [False, False, True] + [False] * K
  assert int(state.micro_step) == 0 and int(state.accumulated) == 0
  assert float(state.loss_scale()) == 2.0**7


def test_the_norm_is_the_micro_batch_s_and_at_the_step_the_window_s():
  tx = _accumulating(ols.DynamicLossScale(4.0, 1), 4, inner=optax.sgd(1.0))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients)
  norms = []
  for i, finite in enumerate([True, True, False, False]):
    grads = {"w": jnp.array([3.0 * (i + 1), 4.0 * (i + 1)])}
    params, state = step(
      _scaled(grads, state.loss_scale(), True)
      if finite
      else {"w": jnp.array([jnp.inf, 0.0])},
      state,
      params,
    )
    norms.append(float(state.grad_norm))
  # Each micro-batch's own norm (inf when it overflowed); at the window's
  # last, dropped, the norm of the mean of the two it kept: the step's.
  assert norms == [5.0, 10.0, np.inf, 7.5]
  assert bool(state.stepped)
  np.testing.assert_allclose(params["w"], [-4.5, -6.0])


@pytest.mark.parametrize(
  "form", ["object", "gradient_transformation", "in a chain"]
)
def test_a_multisteps_as_inner_is_refused_naming_the_replacement(form):
  multi = optax.MultiSteps(optax.sgd(0.1), 2)
  inner = {
    "object": multi,
    "gradient_transformation": multi.gradient_transformation(),
    "in a chain": optax.chain(optax.clip(1.0), multi.gradient_transformation()),
  }[form]
  with pytest.raises(
    TypeError, match=r"MultiSteps.*gradient_accumulation_steps=k"
  ):
    ols.LossScaleOptimizer(inner, ols.DynamicLossScale()).init(
      {"w": jnp.ones(2)}
    )


@pytest.mark.parametrize(
  ("steps", "error"),
  [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)],
)
def test_gradient_accumulation_steps_is_an_int_of_at_least_one(steps, error):
  with pytest.raises(error, match=r"gradient_accumulation_steps=\.\.\."):
    _accumulating(ols.DynamicLossScale(), steps)


def test_stepped_is_true_exactly_at_the_ends_of_windows_that_kept_one():
  # Windows of three: one whose middle is dropped, one that kept none, one
  # whose last two are dropped, one that kept all.
  flags = [True, False, True] + [False] * 3 + [True, False, False]
  flags += [True] * 3
  grads = {"w": jnp.full(3, 0.5), "b": jnp.ones(2)}
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  for k in (K, 1):
    tx = _accumulating(ols.DynamicLossScale(2.0**10), k)
    state, p = tx.init(params), params
    assert not bool(state.stepped)
    step = jax.jit(tx.apply_gradients)
    stepped, applied, positions, kept = [], [], [], []
    for finite in flags:
      p, state = step(_scaled(grads, state.loss_scale(), finite), state, p)
      stepped.append(bool(state.stepped))
      applied.append(bool(state.should_apply))
      positions.append(int(state.micro_step))
      kept.append(int(state.accumulated))
    assert applied == flags
    if k == 1:
      assert stepped == applied
      assert positions == kept == [0] * len(flags)
      assert state.accumulator == ()
      continue
    windows = [flags[i : i + K] for i in range(0, len(flags), K)]
    assert stepped == [i == K - 1 and any(w) for w in windows for i in range(K)]
    assert positions == [(i + 1) % K for i in range(len(flags))]
    assert kept == [1, 1, 0, 0, 0, 0, 1, 1, 0, 1, 2, 0]


def test_a_state_restored_mid_window_continues_bit_for_bit():
  # A checkpoint taken after two of four micro-batches (one dropped) holds
  # the open window: its position, its count and its mean.
  tx = _accumulating(ols.DynamicLossScale(2.0**10, 2), 4, inner=optax.adam(0.1))
  step = jax.jit(tx.apply_gradients)
  flags = [True, False, True, True, True, False, True, True]

  def run(params, state, start, stop):
    for i in range(start, stop):
      grads = {"w": jnp.linspace(-1.0, 1.0, 3) * (i + 1), "b": jnp.ones(2)}
      params, state = step(
        _scaled(grads, state.loss_scale(), flags[i]), state, params
      )
    return params, state

  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  whole = run(params, tx.init(params), 0, len(flags))
  half = run(params, tx.init(params), 0, 2)
  assert int(half[1].micro_step) == 2 and int(half[1].accumulated) == 1
  saved = jax.tree.map(np.asarray, half)  # nothing of the device left
  assert all(type(x) is np.ndarray for x in jax.tree.leaves(saved))
  resumed = run(*saved, 2, len(flags))
  chex.assert_trees_all_equal(resumed, whole)
  assert int(whole[1].skipped_steps) == 2


def test_ensemble_members_under_vmap_drop_their_own_micro_batches():
  # Two members, windows of three: the first drops the middle of its first
  # window, the second the last of its first window and all of its second.
  flags = [
    [True, False, True, True, True, True],
    [True, True, False, False, False, False],
  ]
  tx = _accumulating(ols.DynamicLossScale(2.0**10, 2))
  one = jax.jit(tx.apply_gradients)
  both = jax.jit(jax.vmap(tx.apply_gradients))

  def grads(m, i, scale):
    g = {"w": jnp.full(3, 0.5 + i) * (m + 1), "b": jnp.ones(2) * (i - m)}
    return _scaled(g, scale, flags[m][i])

  starts = [
    {"w": jnp.full(3, 1.0 + m, jnp.float32), "b": jnp.full(2, -m, jnp.float32)}
    for m in (0, 1)
  ]

  def stack(*trees):
    return jax.tree.map(lambda *x: jnp.stack(x), *trees)

  params = stack(*starts)
  state = jax.vmap(tx.init)(params)
  alone = [(p, tx.init(p)) for p in starts]
  stepped = []
  for i in range(len(flags[0])):
    scales = state.loss_scale()
    g = stack(*[grads(m, i, scales[m]) for m in (0, 1)])
    params, state = both(g, state, params)
    alone = [
      one(grads(m, i, s.loss_scale()), s, p) for m, (p, s) in enumerate(alone)
    ]
    stepped.append([bool(x) for x in state.stepped])
  no, first, yes = [False, False], [True, False], [True, True]
  assert stepped == [no, no, yes, no, no, first]
  for m, (p, s) in enumerate(alone):
    member = jax.tree.map(lambda x, m=m: x[m], (params, state))
    chex.assert_trees_all_close(member, (p, s), rtol=1e-6)
  assert [int(n) for n in state.skipped_steps] == [1, 4]
  assert float(state.loss_scale()[0]) > float(state.loss_scale()[1])


def _float16_loss(p, x):
  """Its gradient is x times the scale in float16: inf above 65504."""
  w = p["w"].astype(jnp.float16)
  return jnp.sum(w * x.astype(jnp.float16)).astype(jnp.float32)


@functools.cache
def _minimize():
  """An accumulating optimizer and its `minimize` step, compiled once."""
  tx = _accumulating(ols.DynamicLossScale(2.0**10, 2))
  step = jax.jit(
    lambda p, s, x: tx.minimize(_float16_loss, p, s, x, max_retries=1)
  )
  return tx, step


def test_minimize_with_retries_moves_the_scale_once_per_window():
  tx, step = _minimize()
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  # A batch of 1000 overflows at 2**7 and above: from 2**10, the retry at
  # 2**9 overflows too, the batch is dropped and the scale halves once, as
  # for one overflow. Finite batches then move the scale once per window of
  # three (the dropped batch counts towards its window).
  seen = []
  for x in [1.0, 1000.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]:
    _, params, state = step(params, state, jnp.full(2, x))
    seen.append(float(state.loss_scale()))
  assert seen == [2.0**10] + [2.0**9] * 4 + [2.0**10] * 3
  assert int(state.skipped_steps) == 1 and int(state.retries) == 1


def test_a_retried_micro_batch_in_an_open_window_follows_the_one_rule():
  tx, step = _minimize()
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  # 100 overflows at 2**10 and fits at 2**9: retried once and applied; with
  # hysteresis=1 the scale drops to 2**9 though the window stays open.
  _, params, state = step(params, state, jnp.full(2, 1.0))
  _, params, state = step(params, state, jnp.full(2, 100.0))
  assert int(state.retries) == 1 and bool(state.should_apply)
  assert int(state.micro_step) == 2 and int(state.accumulated) == 2
  assert not bool(state.stepped)
  assert float(state.loss_scale()) == 2.0**9
  assert int(state.loss_scale.num_bad_steps) == 1


def test_multisteps_outside_checks_the_accumulated_gradients_once_per_window():
  # The other order: MultiSteps accumulates the scaled gradients and commits
  # the optimizer's state once per window: the scale moves per window.
  tx = optax.MultiSteps(
    ols.LossScaleOptimizer(optax.sgd(0.1), ols.DynamicLossScale(8.0, 1)),
    every_k_schedule=2,
  )
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  scales = []
  for _ in range(4):
    scale = state.inner_opt_state.loss_scale()
    updates, state = step({"w": jnp.full(2, 0.5) * scale}, state, params)
    params = optax.apply_updates(params, updates)
    scales.append(float(state.inner_opt_state.loss_scale()))
  assert scales == [8.0, 16.0, 16.0, 32.0]
  # Its pitfall, as the accumulation guide says: one non-finite micro-batch
  # poisons the accumulator for good (Optax resets it by multiplying by
  # zero), so every later window is skipped.
  for i in range(6):
    grads = {"w": jnp.array([jnp.nan, 1.0] if i == 0 else [1.0, 1.0])}
    _, state = step(grads, state, params)
  assert int(state.inner_opt_state.skipped_steps) == 3


# `minimize` passes its loss through `apply_gradients`.
@pytest.mark.parametrize("entry", ["update", "minimize"])
def test_extra_args_reach_the_optimizer_when_accumulating(entry):
  def inner():  # `reduce_on_plateau` needs `value=`: it fails without it
    plateau = optax.contrib.reduce_on_plateau(patience=1)
    return optax.chain(optax.sgd(0.5), plateau)

  tx = _accumulating(ols.DynamicLossScale(2.0**4, 1000), 2, inner=inner())
  reference = optax.MultiSteps(inner(), 2)

  def loss(p, x):
    return jnp.sum((p["w"] * x) ** 2)

  @jax.jit
  def reference_step(params, state, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    updates, state = reference.update(grads, state, params, value=value)
    return optax.apply_updates(params, updates), state

  @jax.jit
  def step(params, state, x):
    if entry == "minimize":
      _, params, state = tx.minimize(loss, params, state, x)
      return params, state
    value, grads = ols.scaled_value_and_grad(loss)(state, params, x)
    updates, state = tx.update(grads, state, params, value=value)
    return optax.apply_updates(params, updates), state

  params = expected = {"w": jnp.array([1.0, -2.0])}
  state, ref_state = tx.init(params), reference.init(expected)
  for i in range(6):
    x = jnp.full(2, 1.0 + 0.25 * i)
    params, state = step(params, state, x)
    expected, ref_state = reference_step(expected, ref_state, x)
  chex.assert_trees_all_close(params, expected, rtol=1e-6)
  chex.assert_trees_all_close(
    state.inner_state, ref_state.inner_opt_state, rtol=1e-6
  )
  # The losses rise, so the plateau lowered the learning rate.
  assert float(state.inner_state[1].scale) < 1.0


def test_a_micro_batch_retried_at_the_window_s_end_steps_once():
  tx = _accumulating(ols.DynamicLossScale(2.0**10), 2, inner=optax.sgd(1.0))
  step = jax.jit(
    lambda p, s, x: tx.minimize(_float16_loss, p, s, x, max_retries=1)
  )
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  stepped = []
  for x in [1.0, 100.0]:  # 100 overflows at 2**10, fits at 2**9
    _, params, state = step(params, state, jnp.full(2, x))
    stepped.append(bool(state.stepped))
  np.testing.assert_array_equal(params["w"], 1.0 - (1.0 + 100.0) / 2)
  assert stepped == [False, True] and int(state.retries) == 1
  np.testing.assert_allclose(state.grad_norm, 50.5 * np.sqrt(2), rtol=1e-6)


@pytest.mark.parametrize("entry", ["update", "apply_gradients"])
def test_inner_gets_the_window_in_the_accumulator_s_dtype(entry):
  # float16 gradients, float32 parameters: `optax.MultiSteps` accumulates in
  # float32 and gives its inner optimizer float32; so does the window here.
  # The running mean's difference, -20000 - 60000, passes float16's
  # largest (65504), and the mean's 0.5 + 2**-12 is not a float16.
  seen = []
  sgd = optax.sgd(1.0)

  def update(updates, state, params=None):
    seen.append(jax.tree.map(lambda u: u.dtype, updates))
    return sgd.update(updates, state, params)

  inner = optax.GradientTransformation(sgd.init, update)
  tx = _accumulating(ols.FixedLossScale(1.0), 2, inner=inner)
  params = {"w": jnp.zeros(2)}
  state, p = tx.init(params), params
  step = jax.jit(getattr(tx, entry))
  for i, g in enumerate([[60000.0, 1.0], [-20000.0, 2.0**-11]]):
    grads = {"w": jnp.array(g, jnp.float16)}
    if entry == "apply_gradients":
      p, state = step(grads, state, p)
    else:
      updates, state = step(grads, state, p)
      p = optax.apply_updates(p, updates)
    if i == 0:
      assert state.accumulator["w"].dtype == jnp.float32
      np.testing.assert_array_equal(state.accumulator["w"], g)
  assert seen == [{"w": jnp.dtype(jnp.float32)}]
  assert p["w"].dtype == jnp.float32
  np.testing.assert_array_equal(p["w"], [-20000.0, -(0.5 + 2.0**-12)])
  assert float(state.grad_norm) == pytest.approx(np.hypot(20000.0, 0.5))


@pytest.mark.parametrize("steps", [(1, 3), (3, 1)])
def test_a_state_of_the_other_accumulation_is_refused_by_name(steps):
  params = {"w": jnp.ones(2)}
  given, used = (
    ols.LossScaleOptimizer(
      optax.sgd(0.1), ols.DynamicLossScale(8.0), gradient_accumulation_steps=k
    )
    for k in steps
  )
  grads = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match="the state's `accumulator`"):
    jax.jit(used.apply_gradients)(grads, given.init(params), params)


def test_a_none_gradient_leaf_adds_nothing_to_the_window():
  tx = _accumulating(ols.DynamicLossScale(8.0), 2)
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  grads = {"a": jnp.full(2, 8.0), "b": None}
  _, state = step(grads, state)
  np.testing.assert_array_equal(state.accumulator["a"], [1.0, 1.0])
  np.testing.assert_array_equal(state.accumulator["b"], np.zeros(3))
  updates, state = step(grads, state)
  assert bool(state.stepped)
  np.testing.assert_array_equal(updates["b"], np.zeros(3))


def test_a_window_whose_norm_overflows_is_clipped_as_optax_clips_it():
  # Finite micro-batches whose mean's squares pass float32's range: the
  # norm is inf, as Optax's is, and the clip zeroes the step as Optax's does
  # (and as without accumulation), not applying the window unclipped.
  for k in (1, 2):
    tx = ols.LossScaleOptimizer(
      optax.sgd(1.0),
      ols.DynamicLossScale(1000.0),
      max_norm=1.0,
      gradient_accumulation_steps=k,
    )
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    grads = {"w": jnp.array([3e30, 4e30]) * 1000.0}
    for _ in range(k):
      params, state = jax.jit(tx.apply_gradients)(grads, state, params)
    assert bool(state.stepped) and float(state.grad_norm) == np.inf
    np.testing.assert_array_equal(params["w"], [0.0, 0.0])


def _with_the_rule(k):
  return ols.LossScaleOptimizer(
    optax.sgd(0.1),
    ols.DynamicLossScale(8.0),
    gradient_accumulation_steps=k,
    spike_sigmas=6.0,
    spike_window=4,
  )


def test_a_state_resumed_without_accumulation_ignores_the_open_window():
  # A checkpoint taken mid-window, resumed with gradient_accumulation_steps=1
  # by replacing the accumulator alone: no window is open any more, so an
  # overflow is skipped (not applied as the window's end) and the first
  # step is judged on its own, the rule's loss included.
  params = {"w": jnp.ones(2)}
  old, new = _with_the_rule(4), _with_the_rule(1)
  state, old_step = old.init(params), jax.jit(old.apply_gradients)
  for _ in range(2):
    _, state = old_step(
      {"w": jnp.full(2, 8.0)}, state, params, value=jnp.float32(1e6)
    )
  assert int(state.accumulated) == 2 and float(state.spikes.loss_sum) > 0
  state = state._replace(accumulator=new.init(params).accumulator)
  step = jax.jit(new.apply_gradients)
  bad = {"w": jnp.array([jnp.inf, 8.0])}
  kept, state = step(bad, state, params, value=jnp.float32(1.0))
  chex.assert_trees_all_equal(kept, params)
  assert not bool(state.should_apply) and not bool(state.stepped)
  assert int(state.accumulated) == 0 and int(state.micro_step) == 0
  for _ in range(3):
    params, state = step(
      {"w": jnp.full(2, 8.0)}, state, params, value=jnp.float32(1.0)
    )
    assert bool(state.stepped) and float(state.spikes.loss_sum) == 0.0
  np.testing.assert_allclose(params["w"], 1.0 - 3 * 0.1 * 8.0 / 4.0)


@pytest.mark.parametrize("k", [1, 2])
def test_a_resumed_window_judges_no_loss_of_the_window_left_open(k):
  # Two micro-batches of loss 100 kept in a window left open, then a resume
  # by the docs' recipe (the fresh state's accumulator and counters): the
  # rule judges the next window by its own losses, not by the open one's.
  params = {"w": jnp.ones(2)}
  old, new = _with_the_rule(4), _with_the_rule(k)
  state, old_step = old.init(params), jax.jit(old.apply_gradients)
  for i in range(4 * 4 + 2):  # four windows (the rule's is half full), then 2
    loss = 100.0 if i >= 16 else 1.0 + 0.1 * (i % 3)
    _, state = old_step(
      {"w": jnp.full(2, 8.0 + i % 3)}, state, params, value=jnp.float32(loss)
    )
  assert float(state.spikes.loss_sum) == 200.0
  fresh = new.init(params)
  state = state._replace(
    accumulator=fresh.accumulator,
    accumulated=fresh.accumulated,
    micro_step=fresh.micro_step,
  )
  step = jax.jit(new.apply_gradients)
  for _ in range(k):
    _, state = step(
      {"w": jnp.full(2, 8.0)}, state, params, value=jnp.float32(1.0)
    )
  assert bool(state.stepped) and int(state.skipped_steps) == 0


def test_float32_gradients_of_float64_parameters_accumulate_under_x64():
  # The window's norm is of the float64 accumulator, a micro-batch's of
  # float32 gradients: every branch returns the norm as the state keeps it.
  with jax.enable_x64(True):
    tx = ols.LossScaleOptimizer(
      optax.sgd(1.0),
      ols.FixedLossScale(2.0),
      max_norm=1.0,
      gradient_accumulation_steps=2,
    )
    params = {"w": jnp.zeros(2, jnp.float64)}
    state = tx.init(params)
    step = jax.jit(tx.apply_gradients)
    for _ in range(2):
      grads = {"w": jnp.array([6.0, 8.0], jnp.float32)}
      params, state = step(grads, state, params)
    assert bool(state.stepped) and state.grad_norm.dtype == jnp.float32
    np.testing.assert_allclose(params["w"], [-0.6, -0.8], rtol=1e-6)
