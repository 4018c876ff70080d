"""One of two processes of the multi-process check (see test_multidevice.py).

`python tests/multiprocess_worker.py PORT RANK OUT`: two processes of two CPU
devices each, one Explicit mesh over the four, FSDP-sharded Adam. A NaN in
this process's shard only (rank 1) makes both processes skip with the same
scale, and both `SkipMonitor`s raise; `check_state` reads the shards each
holds. Writes what it saw to OUT as JSON, for the test to compare.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_lossscale as ols  # noqa: E402

port, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
  f"127.0.0.1:{port}",
  num_processes=2,
  process_id=rank,
  initialization_timeout=60,
)
assert jax.device_count() == 4 and jax.local_device_count() == 2


def local(x):
  """This process's first shard of `x`, on the host."""
  return np.asarray(x.addressable_data(0))


mesh = jax.make_mesh((4,), ("data",))
results = {"raised": False}
with jax.set_mesh(mesh):
  fsdp = NamedSharding(mesh, P("data", None))
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(2.0**10))
  ones = np.ones((4, 3), np.float32)  # this process's rows of an (8, 3) leaf
  params = {"w": jax.make_array_from_process_local_data(fsdp, ones, (8, 3))}
  state = tx.init(params)
  assert jax.typeof(state.inner_state[0].mu["w"]).sharding.spec == fsdp.spec
  step = jax.jit(tx.apply_gradients, donate_argnums=(1, 2))
  monitor = ols.SkipMonitor(max_consecutive_skips=2, log=None)
  for t in range(3):  # NaNs at steps 0 and 1, in rank 1's rows only
    grads = np.full((4, 3), 0.5, np.float32)
    if t < 2 and rank == 1:
      grads[3, 1] = np.nan
    grads = {"w": jax.make_array_from_process_local_data(fsdp, grads)}
    params, state = step(grads, state, params)
    assert bool(local(state.should_apply)) == (t == 2), t
    try:
      monitor(state)
    except ols.ConsecutiveSkipsError as error:
      results["raised"] = "2 consecutive steps skipped" in str(error)
      results["nonfinite"] = list(error.report.nonfinite)
      results["scale"] = float(local(state.loss_scale()))
      results["skipped"] = int(local(state.skipped_steps))
      results["unchanged"] = bool(np.all(local(params["w"]) == 1.0))
  # The step after them applies on both: Adam's first step is -lr.
  assert jax.typeof(params["w"]).sharding.spec == fsdp.spec
  results["applied"] = local(params["w"]).tolist()

  # The state's arrays span both processes: each checks the shards it holds.
  assert not state.retries.is_fully_addressable
  assert ols.check_state(state) is state
  ols.DynamicLossScale(
    2.0**10, current_loss_scale=state.loss_scale.current_loss_scale
  )
  negative = jax.jit(lambda s: s._replace(retries=s.retries - 1))(state)
  try:
    ols.check_state(negative)
    raise AssertionError("check_state accepted a negative counter")
  except ValueError as e:
    assert "`tree.retries`" in str(e) and "got -1" in str(e), e

with open(out, "w") as f:
  json.dump(results, f)
jax.distributed.shutdown()
