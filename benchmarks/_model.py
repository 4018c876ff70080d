"""A GPT-2-shaped transformer: float32 master weights, float16 compute.

Shared by the benchmark scripts. At its default size it has GPT-2 small's
tree (12 blocks, 149 leaves: attention without biases, an untied head) at a
reduced width, small enough to train on two CPU cores.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _dense(key: jax.Array, n_in: int, n_out: int) -> jax.Array:
  return jax.random.normal(key, (n_in, n_out), jnp.float32) / np.sqrt(n_in)


def _layernorm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
  """Statistics in float32, result in float16."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
  return (y.astype(x.dtype) * scale) + bias


@dataclasses.dataclass(frozen=True)
class Transformer:
  """The model's shape; its methods build parameters, batches and the loss."""

  layers: int = 12
  d_model: int = 128
  heads: int = 4
  seq: int = 64
  batch: int = 8
  vocab: int = 256

  def _block_params(self, key: jax.Array) -> dict[str, jax.Array]:
    """One block: attention q/k/v/o, two layernorms, a two-layer MLP."""
    kq, kk, kv, ko, k1, k2 = jax.random.split(key, 6)
    d, h = self.d_model, 4 * self.d_model
    ones, zeros = jnp.ones(d), jnp.zeros(d)
    return {
      "wq": _dense(kq, d, d),
      "wk": _dense(kk, d, d),
      "wv": _dense(kv, d, d),
      "wo": _dense(ko, d, d),
      "ln1_scale": ones,
      "ln1_bias": zeros,
      "ln2_scale": ones + 0.0,
      "ln2_bias": zeros + 0.0,
      "w1": _dense(k1, d, h),
      "b1": jnp.zeros(h),
      "w2": _dense(k2, h, d),
      "b2": jnp.zeros(d),
    }

  def init_params(self, key: jax.Array) -> dict[str, Any]:
    """float32 master weights: embeddings, `layers` blocks, head."""
    keys = jax.random.split(key, self.layers + 3)
    d = self.d_model
    return {
      "embed": jax.random.normal(keys[0], (self.vocab, d)) * 0.02,
      "pos": jax.random.normal(keys[1], (self.seq, d)) * 0.02,
      "blocks": [self._block_params(k) for k in keys[3:]],
      "ln_scale": jnp.ones(d),
      "ln_bias": jnp.zeros(d),
      "head": _dense(keys[2], d, self.vocab),
    }

  def _attention(self, p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Causal multi-head self-attention."""
    b, s, d = x.shape
    heads = self.heads
    split = lambda w: (x @ w).reshape(b, s, heads, d // heads)  # noqa: E731
    q, k, v = split(p["wq"]), split(p["wk"]), split(p["wv"])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((s, s), bool))
    logits = jnp.where(mask, logits, jnp.asarray(-1e4, logits.dtype))
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
    return out @ p["wo"]

  def _block(self, p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    x = x + self._attention(p, _layernorm(x, p["ln1_scale"], p["ln1_bias"]))
    h = _layernorm(x, p["ln2_scale"], p["ln2_bias"])
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

  def loss(self, params: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
    """Next-token cross-entropy (float32) of a float16 forward pass."""
    p = jax.tree.map(lambda w: w.astype(jnp.float16), params)
    x = p["embed"][batch["tokens"]] + p["pos"]
    for block in p["blocks"]:
      x = self._block(block, x)
    logits = _layernorm(x, p["ln_scale"], p["ln_bias"]) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch["targets"]
    ).mean()

  def make_batch(self, key: jax.Array) -> dict[str, jax.Array]:
    """Random tokens and their next tokens."""
    tokens = jax.random.randint(key, (self.batch, self.seq + 1), 0, self.vocab)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
