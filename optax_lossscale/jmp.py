"""A drop-in replacement for DeepMind's jmp 0.0.4, with its bugs fixed.

Change `import jmp` to `from optax_lossscale import jmp`: the same names,
signatures, pytree layouts and results. `min_loss_scale` survives `jit` and
`lax.scan`, divisions stay exact under `jit`, `all_finite` is one pass (jmp's
update step compiles in a fraction of the time), and `to_loss_scale` carries
a jmp loss scale over to `optax_lossscale.LossScaleOptimizer`. jmp itself is
not needed. `dtype_to_names`, jmp's table of dtype names, is kept for code
that reads it from jmp's policy module; it is not part of jmp's `__all__`,
nor of this module's.
"""

from optax_lossscale._jmp_bridge import to_loss_scale as to_loss_scale
from optax_lossscale._jmp_loss_scale import (
  DynamicLossScale as DynamicLossScale,
)
from optax_lossscale._jmp_loss_scale import LossScale as LossScale
from optax_lossscale._jmp_loss_scale import NoOpLossScale as NoOpLossScale
from optax_lossscale._jmp_loss_scale import StaticLossScale as StaticLossScale
from optax_lossscale._jmp_loss_scale import select_tree as select_tree
from optax_lossscale._jmp_policy import Policy as Policy
from optax_lossscale._jmp_policy import cast_to_full as cast_to_full
from optax_lossscale._jmp_policy import cast_to_half as cast_to_half
from optax_lossscale._jmp_policy import dtype_to_names as dtype_to_names
from optax_lossscale._jmp_policy import get_policy as get_policy
from optax_lossscale._jmp_policy import half_dtype as half_dtype
from optax_lossscale._numerics import all_finite as all_finite

__all__ = [
  "DynamicLossScale",
  "LossScale",
  "NoOpLossScale",
  "Policy",
  "StaticLossScale",
  "all_finite",
  "cast_to_full",
  "cast_to_half",
  "get_policy",
  "half_dtype",
  "select_tree",
  "to_loss_scale",
]
