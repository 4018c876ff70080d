"""Strict numerics for every test: silent promotion shows up as a failure."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
