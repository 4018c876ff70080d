"""Loss scaling for mixed-precision training in JAX, as Optax transformations.

TensorFlow's `FixedLossScale` and `DynamicLossScale` as immutable JAX pytrees,
`LossScaleOptimizer` (hysteresis, loss-aware skips, retries of overflowed
batches, and skip reports and a stop rule read from its state),
`unscale_gradients` to put them in an Optax optimizer, and `check_state` for
restored checkpoints.
"""

from optax_lossscale._check import check_state as check_state
from optax_lossscale._loss_scale import DynamicLossScale as DynamicLossScale
from optax_lossscale._loss_scale import FixedLossScale as FixedLossScale
from optax_lossscale._loss_scale import LossScale as LossScale
from optax_lossscale._loss_scale import NoOpLossScale as NoOpLossScale
from optax_lossscale._numerics import all_finite as all_finite
from optax_lossscale._optimizer import (
  LossScaleOptimizer as LossScaleOptimizer,
)
from optax_lossscale._report import (
  ConsecutiveSkipsError as ConsecutiveSkipsError,
)
from optax_lossscale._report import SkipMonitor as SkipMonitor
from optax_lossscale._report import SkipReport as SkipReport
from optax_lossscale._report import skip_reports as skip_reports
from optax_lossscale._serialization import deserialize as deserialize
from optax_lossscale._serialization import get as get
from optax_lossscale._serialization import (
  register_loss_scale as register_loss_scale,
)
from optax_lossscale._serialization import serialize as serialize
from optax_lossscale._states import (
  LossScaleOptimizerState as LossScaleOptimizerState,
)
from optax_lossscale._states import SkipRecord as SkipRecord
from optax_lossscale._states import (
  UnscaleGradientsState as UnscaleGradientsState,
)
from optax_lossscale._states import get_loss_scale as get_loss_scale
from optax_lossscale._transforms import apply_gradients as apply_gradients
from optax_lossscale._transforms import (
  loss_scale_optimizer as loss_scale_optimizer,
)
from optax_lossscale._transforms import unscale_gradients as unscale_gradients
from optax_lossscale._value_and_grad import (
  scaled_value_and_grad as scaled_value_and_grad,
)
from optax_lossscale._version import __version__ as __version__

__all__ = [
  "ConsecutiveSkipsError",
  "DynamicLossScale",
  "FixedLossScale",
  "LossScale",
  "LossScaleOptimizer",
  "LossScaleOptimizerState",
  "NoOpLossScale",
  "SkipMonitor",
  "SkipRecord",
  "SkipReport",
  "UnscaleGradientsState",
  "__version__",
  "all_finite",
  "apply_gradients",
  "check_state",
  "deserialize",
  "get",
  "get_loss_scale",
  "loss_scale_optimizer",
  "register_loss_scale",
  "scaled_value_and_grad",
  "serialize",
  "skip_reports",
  "unscale_gradients",
]
