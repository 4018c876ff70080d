"""The checks of a step's inputs, naming what is wrong, and the leaves' names."""

from __future__ import annotations

import collections
import warnings
from typing import Any

import jax
import numpy as np
import optax
from jax.tree_util import keystr, tree_leaves_with_path

from optax_lossscale import _loss_scale, _numerics, _states
from optax_lossscale._validation import describe, must

# flax's `fp8_ops.OVERWRITE_WITH_GRADIENT`: FP8 scales and amax histories,
# whose "gradients" are their new values.
_OVERWRITE = "_overwrite_with_gradient"


def _in_overwrite_collection(path: tuple[Any, ...]) -> bool:
  # flax's rule: a top-level key of the variables (`TrainState`, fp8_ops).
  return bool(path) and getattr(path[0], "key", None) == _OVERWRITE


def _is_variable(x: Any) -> bool:
  """Whether `x` is an NNX variable (without importing flax)."""
  names = {f"{c.__module__}.{c.__name__}" for c in type(x).__mro__}
  return "flax.nnx.variablelib.Variable" in names


def leaf_names(tree: Any) -> list[str]:
  """The names of `tree`'s leaves in reports, None leaves included: their
  key paths, an NNX variable's being the variable's (without `.value`)."""
  if tree is None:  # `init(None)`: no parameters to name
    return []
  stop = lambda x: x is None or _is_variable(x)  # noqa: E731
  flat = tree_leaves_with_path(tree, is_leaf=stop)
  count = lambda x: 1 if x is None else len(jax.tree.leaves(x))  # noqa: E731
  return [keystr(p) or "<root>" for p, x in flat for _ in range(count(x))]


def like_grads(params: Any) -> Any:
  """The part of `params` shaped like the gradients: `optax.lookahead`'s
  parameters hold the fast weights, which the gradients are of, and the
  slow ones."""
  return params.fast if isinstance(params, optax.LookaheadParams) else params


def overwritten_leaves(call: str, overwrite: Any, tree: Any) -> Any:
  """Per leaf of `tree`, whether the gradient overwrites it: bools."""
  rule = _in_overwrite_collection if overwrite is None else overwrite
  where = f"`{call}`: `overwrite_with_gradient`"
  try:  # a function of the path, or a pytree of bools (or its prefix)
    marks = (
      jax.tree_util.tree_map_with_path(lambda p, _: rule(p), tree)
      if callable(rule)
      else jax.tree.map(lambda m, x: jax.tree.map(lambda _: m, x), rule, tree)
    )
  except ValueError as e:
    raise ValueError(
      f"{where} must be a function or a pytree of bools like the params: {e}"
    ) from None
  for flag in jax.tree.leaves(marks):
    if not isinstance(flag, (bool, np.bool_)):
      raise must(TypeError, where, "give a bool per leaf", flag)
  return marks


def check_loss_scale(call: str, loss_scale: Any) -> None:
  if not isinstance(loss_scale, _loss_scale.LossScale):
    got = describe(loss_scale)
    if isinstance(loss_scale, type):  # the class: `DynamicLossScale`
      got += f"; call it: `{loss_scale.__name__}()`"
    raise TypeError(f"`{call}(loss_scale=...)` must be a LossScale, got {got}.")


def check_loss_name(call: str, extra_args: dict[str, Any]) -> None:
  """Warns if the loss is given as `loss=`, which no check reads, and not as
  `value=` (a transformation of the user's may take `loss=`: it is passed
  on)."""
  if "loss" in extra_args and "value" not in extra_args:
    warnings.warn(
      f"`{call}(..., loss=...)`: no check reads `loss=`; pass the loss as"
      " `value=` (Optax's name) so that a non-finite loss is skipped, and"
      " `loss=` too if a transformation of yours takes it.",
      stacklevel=4,
    )


def check_structure(call: str, grads: Any, params: Any) -> None:
  """Raises a `ValueError` naming the leaf where `grads` and `params` differ.

  `optax.lookahead`'s parameters are checked by their fast weights.
  """
  params = like_grads(params)
  if params is None or grads is None:
    return
  is_none = lambda x: x is None  # noqa: E731
  pairs = [tree_leaves_with_path(t, is_leaf=is_none) for t in (grads, params)]
  keys = [[keystr(k) or "<root>" for k, _ in pair] for pair in pairs]
  if keys[0] != keys[1]:
    odd = sorted(set(keys[0]) ^ set(keys[1]))[:3] or "the tree types"
    raise ValueError(
      f"`{call}`: the gradients' and parameters' structures differ (at {odd})."
    )
  for name, (_, g), (_, p) in zip(keys[0], *pairs, strict=True):
    if g is None:  # None for None: Equinox's gradients of non-parameters
      problem = "" if p is None else "is None, its parameter not"
    elif p is None:
      problem = "is not None, its parameter is"
    elif np.shape(g) != np.shape(p):
      problem = f"has shape {np.shape(g)}, its parameter {np.shape(p)}"
    elif _numerics.varying_axes(g) - _numerics.varying_axes(p):
      problem = (
        "varies across devices inside `shard_map` but its parameter does not,"
        " so an applied and a skipped step would differ in type. Average the"
        " gradients first: `grads = jax.lax.pmean(grads, axis_name)`"
      )
    else:
      problem = ""
    if problem:
      raise ValueError(f"`{call}`: the gradient at {name} {problem}.")


def check_minimize(call: str, fun: Any, params: Any) -> None:
  """Raises a `TypeError` if `minimize` cannot differentiate `fun` in
  `params`: `fun` is not callable (swapped arguments), or `params` are
  `optax.lookahead`'s."""
  if not callable(fun):
    where = f"`{call}(fun, params, state)`: the first argument"
    raise must(TypeError, where, "the loss function", fun)
  if params is not like_grads(params):
    raise TypeError(
      f"`{call}` differentiates `fun` in all of `params`; `optax.lookahead`'s"
      " gradients are of `params.fast`: call `scaled_value_and_grad(fun)(state,"
      " params.fast)`, then `apply_gradients(grads, state, params)`."
    )


def check_inputs(
  call: str, grads: Any, state: Any, params: Any, dtypes: Any
) -> None:
  """Raises, at trace time, naming what is wrong with a step's inputs.

  `dtypes` is a state of the type, fields and dtypes `init` returns.
  """
  for name, given in (("params", params), ("grads", grads)):
    if isinstance(given, _states.LossScaleOptimizerState):
      order = "fun, params, state" if "minimize" in call else "grads, state"
      raise TypeError(
        f"`{call}`: `{name}` is the state; the arguments are ({order}, ...)."
      )
  _states.check_like(call, state, dtypes)
  check_structure(call, grads, params)
  slots = state.last_skip.nonfinite.shape[-1]
  what = "gradients (None included)" if params is None else "parameters"
  tree = grads if params is None else like_grads(params)
  paths = tree_leaves_with_path(tree, is_leaf=lambda x: x is None)
  if tree is None or not slots or len(paths) == slots:
    return
  # Not `init`'s leaves: the message names the subtrees.
  counts = collections.Counter(keystr(p[:1]) or "<root>" for p, _ in paths)
  fits = [k for k, n in counts.items() if n == slots]
  others = ", ".join(k for k in counts if fits and k != fits[0])
  hint = f"; pass {fits[0]} alone and keep {others} apart" if others else ""
  if params is not None:
    hint += (
      " (flax's `TrainState` trains `variables['params']` and carries the"
      " other collections)"
    )
  raise ValueError(
    f"`{call}`: the {what} have {len(paths)} leaves"
    f" ({', '.join(f'{k}: {n}' for k, n in counts.items())}), `init` had"
    f" {slots}{hint}."
  )
