"""The fused step copies no parameter- or state-sized buffer.

This is the one test that reads compiled HLO (`compiled.as_text()`); the
others read the jaxpr. Copies exist only in the compiled program: XLA's copy
insertion adds them after JAX has lowered the step. It runs on whatever
backend the suite runs on, so on a GPU it guards the GPU's compiler.

Some XLA versions copy every buffer that a conditional's pass-through branch
forwards, unless that branch is the conditional's first (jax#39449,
jax#38145; fixed by openxla/xla#46314). `lax.cond(pred, true_fun, false_fun)`
makes `false_fun` the first, so the step's skip branch must be its false
branch. Swapped, the step below copies each parameter and Adam leaf twice
(XLA's CPU backend, jaxlib 0.10.2).

The steps take the donated parameters and state first and return them in
the same order, as a train step does: XLA's CPU backend (jaxlib 0.10.2) also
copies donated buffers returned in another order than they came, with or
without a `cond` (even plain Adam does).
"""

import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import optax_lossscale as ols

# Leaves of three sizes and two dtypes: a copy of any of them stands out
# from the scalars and the skip record's small arrays.
PARAMS = {
  "w": jnp.ones((256, 256), jnp.float32),
  "b": jnp.ones((256,), jnp.float32),
  "e": jnp.ones((64, 64), jnp.bfloat16),
}
SMALLEST = min(x.size for x in PARAMS.values())
LARGEST = max(PARAMS.values(), key=lambda x: x.nbytes)

# `name = dtype[dims]{layout} op(`, in any computation (fused ones included).
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<dtype>[a-z]\w*)"
  r"\[(?P<dims>[\d,]*)\](?P<layout>\{[^}]*\})?\s+(?P<op>[\w\-]+)\((?P<args>.*)"
)


def buffer_copies(hlo: str, min_size: int) -> list[str]:
  """The `copy` instructions of `min_size` or more elements that keep the layout.

  Each writes a second buffer of the same array. A `copy` that changes the
  layout is a transpose the model's math needs (a matmul's operand on GPU or
  TPU), not a duplicate.
  """
  layouts, copies = {}, []
  for line in hlo.splitlines():
    found = _INSTRUCTION.match(line)
    if not found:
      continue
    layouts[found["name"]] = found["layout"]
    if found["op"] != "copy":
      continue
    dims = [int(d) for d in found["dims"].split(",") if d]
    operand = found["args"].split(")")[0].split()[-1].lstrip("%")
    same_layout = layouts.get(operand, found["layout"]) == found["layout"]
    if math.prod(dims) >= min_size and same_layout:
      copies.append(line.strip()[:120])
  return copies


@functools.cache
def compiled(entry: str) -> Any:
  """One compile per step, shared by the tests; donated, as a train step."""
  tx = ols.LossScaleOptimizer(optax.adam(1e-3), ols.DynamicLossScale())
  state = tx.init(PARAMS)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), PARAMS)
  batch = jnp.ones((8, 256))

  def loss(params: Any, x: jax.Array) -> jax.Array:
    y = x @ params["w"] + params["b"][None]
    return jnp.mean(y**2) + jnp.sum(params["e"].astype(jnp.float32))

  steps = {
    "apply_gradients": (
      lambda p, s, g: tx.apply_gradients(g, s, p),
      grads,
    ),
    "minimize": (lambda p, s, x: tx.minimize(loss, p, s, x), batch),
  }
  step, rest = steps[entry]
  with jax.numpy_dtype_promotion("standard"):  # Optax's Adam
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(PARAMS, state, rest)
    return lowered.compile()


# `minimize` runs the same `cond` after a forward and backward pass: a second
# compile of about a second, so it runs with the slow tests.
@pytest.mark.parametrize(
  "entry", ["apply_gradients", pytest.param("minimize", marks=pytest.mark.slow)]
)
def test_the_donated_step_copies_no_parameter_or_state_buffer(
  entry: str,
) -> None:
  copies = buffer_copies(compiled(entry).as_text() or "", SMALLEST)
  assert not copies, (
    f"{entry} copies {len(copies)} buffers of {SMALLEST}+ elements; is the"
    " step's skip branch still the `cond`'s false branch (jax#39449)?\n"
    + "\n".join(copies)
  )


def test_the_donated_fused_step_needs_less_memory_than_its_largest_leaf() -> (
  None
):
  # A copy of the largest leaf alone would reach the bound (the swapped
  # branch order copies every leaf: 3.5x the bound). What the step may hold
  # is finiteness flags: XLA's CPU backend writes one byte per element of a
  # checked leaf before reducing them, a quarter of this float32 leaf's
  # bytes per check.
  analysis = compiled("apply_gradients").memory_analysis()
  if analysis is None:
    pytest.skip(f"no memory analysis on {jax.default_backend()}")
  assert analysis.temp_size_in_bytes < LARGEST.nbytes


def test_buffer_copies_sees_the_copies_xla_makes() -> None:
  # The detector itself: not donated, the pass-through branch's result needs
  # a buffer of its own, and XLA's copy insertion (shared by its backends)
  # writes it with one `copy`; donated, it needs none.
  def step(x: jax.Array, pred: bool) -> Any:
    return lax.cond(pred, lambda x: x + 1, lambda x: x, x)

  x = jnp.ones(SMALLEST)
  kept, donated = (
    jax.jit(step, donate_argnums=d).lower(x, True).compile().as_text() or ""
    for d in ((), 0)
  )
  assert len(buffer_copies(kept, SMALLEST)) == 1
  assert buffer_copies(kept, SMALLEST + 1) == []
  assert buffer_copies(donated, SMALLEST) == []
