"""Strict numerics for every test: silent promotion shows up as a failure."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


import pytest  # noqa: E402


@pytest.fixture
def standard_promotion():
  """For tests that run Optax's own optimizers.

  Optax's Adam computes `decay ** count` with a Python float and an int32,
  which strict promotion refuses; our own code stays strict-clean (see
  `test_transforms.py::test_wrapper_is_clean_under_strict_promotion`).
  """
  with jax.numpy_dtype_promotion("standard"):
    yield
