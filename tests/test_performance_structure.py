"""The design that makes the step fast, checked structurally (not timed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import optax_lossscale as ols

pytestmark = pytest.mark.usefixtures("standard_promotion")

REDUCTIONS = {
  lax.reduce_max_p,
  lax.reduce_min_p,
  lax.reduce_sum_p,
  lax.reduce_and_p,
  lax.reduce_or_p,
  lax.reduce_prod_p,
}


def _reduced_elements(jaxpr, n):
  """How many elements the reductions over more than `n` elements read."""
  return sum(
    e.invars[0].aval.size
    for e in jaxpr.eqns
    if e.primitive in REDUCTIONS and e.invars[0].aval.size > n
  )


def _tree(n):
  return {f"p{i}": jnp.ones((10, 10)) for i in range(n)}


def _update_jaxpr(tx, n):
  params = _tree(n)
  return jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr


@pytest.mark.parametrize(
  "shape", [(10, 10), (300, 300)], ids=["small", "large"]
)
@pytest.mark.parametrize("n", [3, 50])
def test_one_reduction_pass_outside_the_inner_update(n, shape):
  tx = ols.loss_scale_optimizer(optax.adam(1e-3), ols.DynamicLossScale())
  params = {f"p{i}": jnp.ones(shape) for i in range(n)}
  jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
  reduced = _reduced_elements(jaxpr, n)
  # Every gradient element is reduced exactly once: one read of the gradients.
  assert reduced == n * shape[0] * shape[1]
  big = [
    e
    for e in jaxpr.eqns
    if e.primitive is not lax.cond_p
    and any(
      getattr(v.aval, "size", 0) >= shape[0] * shape[1] for v in e.outvars
    )
  ]
  # The unscaling is inside the cond, fused into the inner update: nothing
  # outside it multiplies or divides the gradients.
  assert not {e.primitive.name for e in big} & {"mul", "div"}
  assert sum(e.primitive is lax.cond_p for e in jaxpr.eqns) == 1


def test_unscale_gradients_checks_the_incoming_gradients():
  # The reduction reads the gradients as they come (`g - g`), not the unscaled
  # ones: the unscaling then has one consumer, the rest of the chain, and
  # fuses into it instead of being written out.
  n, shape = 4, (300, 300)
  tx = optax.chain(
    ols.unscale_gradients(ols.DynamicLossScale()), optax.adam(1e-3)
  )
  params = {f"p{i}": jnp.ones(shape) for i in range(n)}
  jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
  inputs = set(jaxpr.invars[:n])
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}

  def sources(var):
    # The jaxpr inputs `var` is computed from, and the primitives on the way.
    if var not in producer:
      return {var}, set()
    eqn = producer[var]
    found, names = set(), {eqn.primitive.name}
    for v in eqn.invars:
      if not hasattr(v, "val"):  # a variable, not a literal
        more, more_names = sources(v)
        found |= more
        names |= more_names
    return found, names

  checked = set()
  for e in jaxpr.eqns:
    if e.primitive in REDUCTIONS and e.invars[0].aval.size == shape[0] ** 2:
      found, names = sources(e.invars[0])
      assert "mul" not in names and "div" not in names, names
      checked |= found & inputs
  assert checked == inputs
  reduced = _reduced_elements(jaxpr, n)
  assert reduced == n * shape[0] * shape[1]


def test_fixed_scale_without_skipping_reads_nothing_extra():
  tx = ols.loss_scale_optimizer(
    optax.sgd(1e-3), ols.FixedLossScale(8), skip_nonfinite=False
  )
  # The verdict is unused, so XLA removes the check: the compiled step
  # reduces nothing.
  params = _tree(5)
  hlo = jax.jit(tx.update).lower(params, tx.init(params), params).compile()
  assert " reduce(" not in hlo.as_text()


def _hlo_ops(tx, n):
  params = _tree(n)
  text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
  return sum(1 for line in text.splitlines() if " = " in line)


@pytest.mark.parametrize(
  "make",
  [
    lambda: ols.loss_scale_optimizer(optax.adam(1e-3), ols.DynamicLossScale()),
    lambda: optax.chain(
      ols.unscale_gradients(ols.DynamicLossScale()), optax.adam(1e-3)
    ),
  ],
  ids=["loss_scale_optimizer", "unscale_gradients"],
)
def test_program_size_grows_linearly_with_leaves(make):
  tx = make()
  small, large = _hlo_ops(tx, 100), _hlo_ops(tx, 400)
  assert 3.5 < large / small < 4.3, (small, large)


def test_no_host_synchronisation_in_update():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3), ols.DynamicLossScale())
  params = _tree(4)
  state = tx.init(params)
  with jax.transfer_guard("disallow"):
    jax.jit(tx.update)(params, state, params)  # compiles and runs
    jax.jit(tx.update)(params, state, params)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_the_check_needs_little_memory_beyond_its_input(dtype):
  # No copy of a large leaf (nor a float32 conversion of a half-precision
  # one) is written out to check it.
  x = jnp.ones((300, 320), dtype)
  compiled = jax.jit(ols.all_finite).lower([x, jnp.ones(7, dtype)]).compile()
  assert compiled.memory_analysis().temp_size_in_bytes <= x.nbytes // 4


def test_skip_records_add_no_pass_and_no_cond():
  # The record's per-leaf flags are the check's own: the gradients are
  # still reduced exactly once, and there is still one cond and no host
  # callback.
  n, shape = 4, (300, 300)
  tx = ols.LossScaleOptimizer(optax.adam(1e-3), ols.DynamicLossScale())
  params = {f"p{i}": jnp.ones(shape) for i in range(n)}
  state = tx.init(params)
  assert state.last_skip is not None
  jaxpr = jax.make_jaxpr(
    lambda g, s, p: tx.apply_gradients(g, s, p, value=jnp.float32(1))
  )(params, state, params).jaxpr
  assert _reduced_elements(jaxpr, n) == n * shape[0] * shape[1]
  assert sum(e.primitive is lax.cond_p for e in jaxpr.eqns) == 1
  assert not any("callback" in e.primitive.name for e in jaxpr.eqns)
