"""One of two processes of the multi-process check (see test_multidevice.py)."""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
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
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
data = NamedSharding(mesh, P("data"))
replicated = NamedSharding(mesh, P())

tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**10, 2))


def _last_skip(state):
  """The last skip an unbatched state records, or None."""
  reports = ols.skip_reports(state)
  assert len(reports) <= 1 and all(r.member is None for r in reports)
  return reports[0] if reports else None


@jax.jit
def step(params, state, grads):
  # Per-example gradients, sharded over the data axis, averaged globally.
  grads = {"w": jnp.mean(grads, axis=0)}
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


params = jax.device_put({"w": jnp.zeros(3)}, replicated)
state = jax.device_put(tx.init({"w": jnp.zeros(3)}), replicated)
for t in range(2):
  local = np.full((2, 3), 2.0**10, np.float32)
  if t == 0 and rank == 1:
    local[1, 2] = np.nan  # only this process's shard is poisoned
  grads = jax.make_array_from_process_local_data(data, local, (4, 3))
  params, state = step(params, state, grads)
  applied = bool(state.should_apply)
  assert applied == (t == 1), (t, applied)

# The state's arrays span both processes: each checks the shards it holds.
assert not state.retries.is_fully_addressable
assert ols.check_state(state) is state
ols.DynamicLossScale(
  2.0**10, 2, current_loss_scale=state.loss_scale.current_loss_scale
)
negative = jax.jit(lambda s: s._replace(retries=s.retries - 1))(state)
try:
  ols.check_state(negative)
  raise AssertionError("check_state accepted a negative counter")
except ValueError as e:
  assert "`tree.retries` must be non-negative, got -1." in str(e), e

result = np.concatenate(
  [
    np.asarray(params["w"].addressable_data(0)).ravel(),
    [float(state.loss_scale.current_loss_scale.addressable_data(0))],
    [int(state.skipped_steps.addressable_data(0))],
  ]
)
np.save(out, result)

# An Explicit mesh (jax.make_mesh's default) over both processes, with
# FSDP-sharded parameters: a NaN in this process's shard only makes both
# processes skip with the same scale, and the SkipMonitor raises on both.
mesh = jax.make_mesh((4,), ("data",))
with jax.set_mesh(mesh):
  fsdp = NamedSharding(mesh, P("data", None))
  tx = ols.LossScaleOptimizer(optax.adam(0.1), ols.DynamicLossScale(2.0**10))
  local = np.ones((4, 3), np.float32)  # this process's rows of an (8, 3) leaf
  params = {"w": jax.make_array_from_process_local_data(fsdp, local, (8, 3))}
  state = tx.init(params)
  assert jax.typeof(state.inner_state[0].mu["w"]).sharding.spec == P(
    "data", None
  )
  step = jax.jit(tx.apply_gradients, donate_argnums=(1, 2))
  monitor = ols.SkipMonitor(max_consecutive_skips=2, log=None)
  results = {"raised": False}
  for t in range(3):
    grads_local = np.full((4, 3), 0.5, np.float32)
    if t < 2 and rank == 1:
      grads_local[3, 1] = np.nan
    grads = {"w": jax.make_array_from_process_local_data(fsdp, grads_local)}
    params, state = step(grads, state, params)
    try:
      report = monitor(state)
    except ols.ConsecutiveSkipsError as error:
      results["raised"] = "2 consecutive steps skipped" in str(error)
      report = _last_skip(state)
      break
  assert jax.typeof(params["w"]).sharding.spec == P("data", None)
  results["scale"] = float(ols.get_loss_scale(state)().addressable_data(0))
  results["skipped"] = int(state.skipped_steps.addressable_data(0))
  results["nonfinite"] = list(report.nonfinite)
  results["unchanged"] = bool(
    np.all(np.asarray(params["w"].addressable_data(0)) == 1.0)
  )
with open(out + ".explicit.json", "w") as f:
  json.dump(results, f)
jax.distributed.shutdown()
