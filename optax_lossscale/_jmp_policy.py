"""jmp's mixed-precision policies: which dtype parameters, compute and outputs use.

A policy casts the floating-point array leaves of a pytree (NumPy and JAX
arrays) to one of its three dtypes and passes every other leaf through, as
jmp 0.0.4 does. `get_policy` parses jmp's strings, and `str(policy)` writes
them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "Policy",
  "cast_to_full",
  "cast_to_half",
  "get_policy",
  "half_dtype",
]

T = TypeVar("T")

# jmp's names, the first of each the one `str(policy)` writes.
_NAMES: dict[Any, tuple[str, ...]] = {
  jnp.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
  jnp.dtype(jnp.float16): ("f16", "float16"),
  jnp.dtype(jnp.float32): ("full", "f32", "float32"),
  jnp.dtype(jnp.float64): ("f64", "float64"),
}
# The dtypes get_policy returns are jax.numpy's scalar types, as in jmp.
_TYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64]
# jmp's own table of names, keyed by those types, which code written against
# jmp's policy module (its tests included) reads.
dtype_to_names: dict[Any, tuple[str, ...]] = {
  t: _NAMES[jnp.dtype(t)] for t in _TYPES
}
_DTYPES: dict[str, Any] = {
  name: t for t in _TYPES for name in _NAMES[jnp.dtype(t)]
}
_KEYS = {
  "p": "param",
  "params": "param",
  "c": "compute",
  "compute": "compute",
  "o": "output",
  "output": "output",
}


def _cast_floating_to(tree: T, dtype: Any) -> T:
  def cast(x: Any) -> Any:
    if isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(
      x.dtype, jnp.floating
    ):
      return x.astype(dtype)
    return x

  result: T = jax.tree.map(cast, tree)
  return result


def _name(dtype: Any) -> str:
  key = jnp.dtype(dtype)
  return _NAMES[key][0] if key in _NAMES else key.name


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which dtypes a model's parameters, computation and outputs use.

  jmp's `Policy`: each `cast_to_*` method casts the floating-point NumPy and
  JAX arrays of a pytree to one dtype; integer arrays, Python numbers and other
  leaves pass through unchanged. Haiku's `hk.mixed_precision.set_policy`
  takes it.

  Args:
    param_dtype: the dtype of the parameters.
    compute_dtype: the dtype of the inputs, and so of the computation.
    output_dtype: the dtype of the outputs.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import jmp
    >>> policy = jmp.Policy(jnp.float32, jnp.float16, jnp.float32)
    >>> print(policy)
    p=full,c=f16,o=full
    >>> x = {"x": jnp.ones(2), "step": jnp.array(3)}
    >>> policy.cast_to_compute(x)
    {'step': Array(3, dtype=int32, weak_type=True), 'x': Array([1., 1.], dtype=float16)}
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def cast_to_param(self, x: T) -> T:
    """Casts the floating-point arrays of `x` to `param_dtype`."""
    return _cast_floating_to(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Casts the floating-point arrays of `x` to `compute_dtype`."""
    return _cast_floating_to(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Casts the floating-point arrays of `x` to `output_dtype`."""
    return _cast_floating_to(x, self.output_dtype)

  def with_output_dtype(self, output_dtype: Any) -> Policy:
    """Returns this policy with another `output_dtype`."""
    return dataclasses.replace(self, output_dtype=output_dtype)

  def __str__(self) -> str:
    return (
      f"p={_name(self.param_dtype)},c={_name(self.compute_dtype)},"
      f"o={_name(self.output_dtype)}"
    )


def half_dtype() -> Any:
  """Returns the half-precision dtype of the default backend.

  bfloat16 on TPU, float16 elsewhere, as in jmp.

  Returns:
    `jnp.bfloat16` or `jnp.float16`.
  """
  on_tpu = jax.local_devices()[0].platform == "tpu"
  return jnp.bfloat16 if on_tpu else jnp.float16


def _parse_dtype(value: str) -> Any:
  if value == "half":
    return half_dtype()
  if value not in _DTYPES:
    raise ValueError(
      f"Unknown dtype '{value}' must be full,half,float16,bfloat16 or a"
      " contraction thereof (e.g. 'f' for 'full', 'bf16' for 'bfloat16')"
    )
  return _DTYPES[value]


def get_policy(policy_name: str) -> Policy:
  """Returns a policy parsed from jmp's policy strings.

  Either one dtype for all three (`"half"`, `"float32"`, `"bf16"`), or
  comma-separated `key=dtype` parts with keys `p`/`params`, `c`/`compute`
  and `o`/`output`. Unspecified parameters are float32, compute follows the
  parameters and output follows compute (`"c=f16"` is `p=full,c=f16,o=f16`).
  Dtypes: `full`/`f32`/`float32`, `f16`/`float16`, `bf16`/`bfloat16`,
  `f64`/`float64`, and `half` (`half_dtype()`).

  Args:
    policy_name: the policy string.

  Returns:
    A `Policy`.

  Raises:
    TypeError: if `policy_name` is not a string.
    ValueError: for an unknown key or dtype, or a part without one `=`.

  Examples:
    >>> from optax_lossscale import jmp
    >>> print(jmp.get_policy("params=float32,compute=bfloat16,output=full"))
    p=full,c=bf16,o=full
    >>> print(jmp.get_policy("c=bf16"))
    p=full,c=bf16,o=bf16
  """
  if not isinstance(policy_name, str):
    raise TypeError(
      "`get_policy(policy_name=...)` must be a string, got"
      f" {type(policy_name).__name__} {policy_name!r:.80}."
    )
  if "=" not in policy_name:
    dtype = _parse_dtype(policy_name)
    return Policy(dtype, dtype, dtype)
  dtypes: dict[str, Any] = {"param": jnp.float32}
  for part in policy_name.split(","):
    if part.count("=") != 1:
      raise ValueError(
        f"`get_policy(policy_name=...)`: '{part}' in '{policy_name}' must be"
        " one key=dtype pair."
      )
    key, value = part.split("=")
    if key not in _KEYS:
      raise ValueError(
        f"Unknown key '{key}' in '{policy_name}' should be 'params',"
        " 'compute' or 'output'."
      )
    dtypes[_KEYS[key]] = _parse_dtype(value)
  dtypes.setdefault("compute", dtypes["param"])
  dtypes.setdefault("output", dtypes["compute"])
  return Policy(dtypes["param"], dtypes["compute"], dtypes["output"])


def cast_to_full(tree: T) -> T:
  """Casts the floating-point arrays of `tree` to float32.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale import jmp
    >>> jmp.cast_to_full([jnp.ones(1, jnp.float16), 2.0])
    [Array([1.], dtype=float32), 2.0]
  """
  return _cast_floating_to(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
  """Casts the floating-point arrays of `tree` to `half_dtype()`."""
  return _cast_floating_to(tree, half_dtype())
