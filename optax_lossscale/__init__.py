"""Loss scaling for mixed-precision training in JAX, as Optax transformations.

TensorFlow's loss scales as immutable JAX pytrees, `LossScaleOptimizer`
(skips non-finite steps with one `lax.cond`; hysteresis, retries, skip
reports and a stop rule read from its state), `unscale_gradients` for an
`optax.chain`, and `check_state` for restored checkpoints.
"""

import warnings as _warnings
from typing import Any as _Any

from optax_lossscale import _deprecated
from optax_lossscale._check import check_state
from optax_lossscale._loss_scale import (
  DynamicLossScale,
  FixedLossScale,
  LossScale,
  NoOpLossScale,
)
from optax_lossscale._numerics import all_finite
from optax_lossscale._optimizer import LossScaleOptimizer
from optax_lossscale._report import (
  ConsecutiveSkipsError,
  SkipMonitor,
  SkipReport,
  skip_reports,
)
from optax_lossscale._serialization import (
  deserialize,
  register_loss_scale,
  serialize,
)
from optax_lossscale._states import (
  LossScaleOptimizerState,
  UnscaleGradientsState,
)
from optax_lossscale._transforms import unscale_gradients
from optax_lossscale._value_and_grad import scaled_value_and_grad
from optax_lossscale._version import __version__

__all__ = [
  "ConsecutiveSkipsError",
  "DynamicLossScale",
  "FixedLossScale",
  "LossScale",
  "LossScaleOptimizer",
  "LossScaleOptimizerState",
  "NoOpLossScale",
  "SkipMonitor",
  "SkipReport",
  "UnscaleGradientsState",
  "__version__",
  "all_finite",
  "check_state",
  "deserialize",
  "register_loss_scale",
  "scaled_value_and_grad",
  "serialize",
  "skip_reports",
  "unscale_gradients",
]


def __getattr__(name: str) -> _Any:
  """0.1.0's names that another route replaces: they warn, and still work."""
  if name not in _deprecated.REPLACEMENTS:
    raise AttributeError(f"module 'optax_lossscale' has no attribute {name!r}")
  message = (
    f"`optax_lossscale.{name}` is deprecated and will be removed after 0.3;"
    f" use {_deprecated.REPLACEMENTS[name]}."
  )
  _warnings.warn(message, DeprecationWarning, stacklevel=2)
  return getattr(_deprecated, name)
