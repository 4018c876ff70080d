"""A `lax.switch` that `vmap` keeps working on Explicit-sharded cases."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_lossscale import _numerics


def hoist(
  fun: Callable[..., Any], operands: tuple[Any, ...]
) -> tuple[Callable[..., Any], list[Any], Any]:
  """`fun` traced once, as a function of its closed-over values followed by
  its operands, and the shapes of its outputs.

  Every value `fun` closes over is hoisted, tracers of any dtype included
  (`jax.closure_convert` keeps integer ones closed over).
  """
  closed, shapes = jax.make_jaxpr(fun, return_shape=True)(*operands)

  def replay(consts: Any, *operands: Any) -> Any:
    flat = jax.core.eval_jaxpr(closed.jaxpr, consts, *jax.tree.leaves(operands))
    return jax.tree.unflatten(jax.tree.structure(shapes), flat)

  return replay, list(closed.consts), shapes


def switch(
  index: Any,
  branches: Sequence[Callable[..., Any]],
  *operands: Any,
  sharded_like: Any = (),
) -> Any:
  """`lax.switch(index, branches, *operands)`, also under `vmap`.

  `vmap` turns a conditional whose index is batched into a select of all
  branches' results, and JAX (0.10) broadcasts the index without the cases'
  sharding: a case that an Explicit mesh axis splits (an ensemble sharded
  inside, FSDP within each member) then fails with a `ShardingTypeError`.
  When an Explicit axis splits a leaf of `operands` or of `sharded_like`
  (what the branches close over), the conditional is wrapped in
  `jax.custom_batching.custom_vmap`, whose rule selects leaf by leaf with
  the index sharded like each case. Otherwise it is `lax.switch` itself.
  The wrapped form is differentiated as the plain one (a `custom_jvp`).
  Remove it once JAX's `vmap` of `cond` keeps the cases' sharding:
  `check_vmap_members_sharded_inside` in tests/multidevice_checks.py fails
  under JAX 0.10.2 without it.
  """
  if not _numerics.explicit_axes(jax.tree.leaves((operands, sharded_like))):
    return _nested(index, list(branches), operands)
  # custom_vmap takes no batched value closed over: they become operands.
  funs, consts, _ = zip(*(hoist(f, operands) for f in branches), strict=True)

  def plain(index: Any, consts: Any, operands: Any) -> Any:
    return _nested(index, list(map(functools.partial, funs, consts)), operands)

  run = jax.custom_batching.custom_vmap(plain)

  @run.def_vmap
  def vmap_rule(size: int, in_batched: Any, *args: Any) -> tuple[Any, Any]:
    # Every branch, then a select per leaf; `args` are `plain`'s.
    axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
    if not in_batched[0]:  # one branch for all members: a batched conditional
      out = jax.vmap(plain, in_axes=tuple(axes), axis_size=size)(*args)
    else:
      index, consts, operands = args
      cases = [
        jax.vmap(f, in_axes=(a, *axes[2]), axis_size=size)(c, *operands)
        for f, c, a in zip(funs, consts, axes[1], strict=True)
      ]
      out = jax.tree.map(lambda *leaves: _select(index, leaves), *cases)
    return out, jax.tree.map(lambda _: True, out)

  differentiable = jax.custom_jvp(run)

  @differentiable.defjvp
  def differentiable_jvp(primals: Any, tangents: Any) -> Any:
    # custom_vmap has no reverse-mode rule: differentiate the plain one.
    plain_at = functools.partial(plain, primals[0])
    return jax.jvp(plain_at, primals[1:], tangents[1:])

  return differentiable(index, list(consts), operands)


def _nested(
  index: Any, branches: list[Callable[..., Any]], operands: Any
) -> Any:
  """`lax.switch` as nested two-way conditionals, each with the first of its
  branches first: a buffer that a branch passes on is copied by XLA (0.10)
  unless the branch is a two-way conditional's first (jax#39449)."""
  if len(branches) == 1:
    return branches[0](*operands)
  rest = lambda *ops: _nested(index - 1, branches[1:], ops)  # noqa: E731
  return lax.cond(index > 0, rest, branches[0], *operands)


def _select(index: jax.Array, cases: Sequence[jax.Array]) -> Any:
  """Each member's case, by its `index` (clamped, as `lax.switch` does).

  `index` (one per member) is broadcast with the sharding of the cases, as
  `lax.select_n` requires.
  """
  index = jnp.clip(index, 0, len(cases) - 1).astype(jnp.int32)
  shape, sharding = cases[0].shape, jax.typeof(cases[0]).sharding
  if not sharding.mesh.empty:  # the index split as the members are
    first = P(*sharding.spec[:1])
    index = jax.sharding.reshard(index, NamedSharding(sharding.mesh, first))
  which = lax.broadcast_in_dim(index, shape, (0,), out_sharding=sharding)
  return lax.select_n(which, *cases)
