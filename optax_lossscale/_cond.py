"""A `lax.cond` that `vmap` keeps working on Explicit-sharded cases."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_lossscale import _numerics

__all__: list[str] = []


def _hoist(
  fun: Callable[..., Any], operands: tuple[Any, ...]
) -> tuple[Callable[[Any, Any], Any], list[Any]]:
  """`fun` traced once, as a function of (its closed-over values, operands).

  Every value `fun` closes over is hoisted, tracers of any dtype included
  (`jax.closure_convert` keeps integer ones closed over).
  """
  closed, shapes = jax.make_jaxpr(fun, return_shape=True)(*operands)
  out_tree = jax.tree.structure(shapes)

  def replay(consts: Any, operands: Any) -> Any:
    flat = jax.core.eval_jaxpr(closed.jaxpr, consts, *jax.tree.leaves(operands))
    return jax.tree.unflatten(out_tree, flat)

  return replay, list(closed.consts)


def cond(
  pred: Any,
  true_fun: Callable[..., Any],
  false_fun: Callable[..., Any],
  *operands: Any,
  sharded_like: Any = (),
) -> Any:
  """`lax.cond(pred, true_fun, false_fun, *operands)`, also under `vmap`.

  `vmap` turns a `cond` whose predicate is batched into a select of both
  branches' results, and JAX (0.10) broadcasts the predicate without the
  cases' sharding: a case that an Explicit mesh axis splits (an ensemble
  sharded inside, FSDP within each member) then fails with a
  `ShardingTypeError`. When an Explicit axis splits a leaf of `operands` or
  of `sharded_like` (what the branches close over), the `cond` is wrapped in
  `jax.custom_batching.custom_vmap`, whose rule selects leaf by leaf with
  the predicate sharded like each case. Otherwise it is `lax.cond` itself.
  The wrapped form is differentiated as the plain `cond` (a `custom_jvp`).
  Remove it once JAX's `vmap` of `cond` keeps the cases' sharding:
  `check_vmap_members_sharded_inside` in tests/multidevice_checks.py fails
  under JAX 0.10.2 without it.
  """
  if not _numerics.explicit_axes(jax.tree.leaves((operands, sharded_like))):
    return lax.cond(pred, true_fun, false_fun, *operands)
  # custom_vmap takes no batched value closed over: they become operands.
  branches = (_hoist(true_fun, operands), _hoist(false_fun, operands))
  (true_c, true_consts), (false_c, false_consts) = branches
  consts, funs = (true_consts, false_consts), (true_c, false_c)

  def plain(pred: Any, consts: Any, operands: Any) -> Any:
    on_true, on_false = (
      lambda *ops, f=f, c=c: f(c, ops)
      for f, c in zip(funs, consts, strict=True)
    )
    return lax.cond(pred, on_true, on_false, *operands)

  run = jax.custom_batching.custom_vmap(plain)
  run.def_vmap(functools.partial(_batched, plain, funs))

  @jax.custom_jvp
  def differentiable(pred: Any, consts: Any, operands: Any) -> Any:
    return run(pred, consts, operands)

  @differentiable.defjvp
  def differentiable_jvp(primals: Any, tangents: Any) -> Any:
    # custom_vmap has no reverse-mode rule: differentiate the plain `cond`.
    pred, consts, operands = primals
    return jax.jvp(
      lambda c, o: plain(pred, c, o), (consts, operands), tangents[1:]
    )

  return differentiable(pred, consts, operands)


def _batched(
  plain: Callable[..., Any],
  funs: tuple[Callable[..., Any], Callable[..., Any]],
  size: int,
  batched: Any,
  pred: Any,
  consts: Any,
  operands: Any,
) -> tuple[Any, Any]:
  """`cond`'s batching rule: both branches, then a select per leaf."""
  axes = jax.tree.map(lambda b: 0 if b else None, batched)
  if not batched[0]:  # one branch for all members: a batched `cond`
    out = jax.vmap(plain, in_axes=tuple(axes), axis_size=size)(
      pred, consts, operands
    )
  else:
    on_true, on_false = (
      jax.vmap(f, in_axes=(a, axes[2]), axis_size=size)(c, operands)
      for f, c, a in zip(funs, consts, axes[1], strict=True)
    )
    out = jax.tree.map(lambda t, f: _select(pred, t, f), on_true, on_false)
  return out, jax.tree.map(lambda _: True, out)


def _select(pred: jax.Array, on_true: jax.Array, on_false: jax.Array) -> Any:
  """`on_true` where the member's `pred` holds, else `on_false`.

  `pred` (one bool per member) is broadcast with the sharding of the cases,
  as `lax.select` requires.
  """
  sharding = jax.typeof(on_true).sharding
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty:
    which = lax.broadcast_in_dim(pred, on_true.shape, (0,))
  else:
    spec = tuple(sharding.spec) + (None,) * on_true.ndim
    pred = jax.sharding.reshard(pred, NamedSharding(mesh, P(spec[0])))
    which = lax.broadcast_in_dim(
      pred, on_true.shape, (0,), out_sharding=sharding
    )
  return lax.select(which, on_true, on_false)
