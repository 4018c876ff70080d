"""Strict numerics for every test: silent promotion shows up as a failure."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


import pytest  # noqa: E402


def pytest_collection_finish(session):
  """Starts the subprocesses of the selected test modules, all at once.

  The docs' pages and the multi-device checks run in subprocesses, each
  mostly on one core: started here, they run beside the tests that run in
  this process, instead of after them. A module opts in with a
  `start_subprocesses(session)` function.
  """
  modules = {getattr(item, "module", None) for item in session.items}
  for module in modules:
    start = getattr(module, "start_subprocesses", None)
    if start is not None:
      start(session)


@pytest.fixture
def standard_promotion():
  """For tests that run Optax's own optimizers.

  Optax's Adam computes `decay ** count` with a Python float and an int32,
  which strict promotion refuses; our own code stays strict-clean (see
  `test_transforms.py::test_wrapper_is_clean_under_strict_promotion`).
  """
  with jax.numpy_dtype_promotion("standard"):
    yield
