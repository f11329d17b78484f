"""lowprec: numerics of low-precision training in JAX.

Formats and rounding (`get_format`, `round_nearest`, `round_stochastic`),
write-back without master weights (`writeback`, `in_float32`, `to_grid`,
`apply_updates`, `telemetry`, `telemetry_arrays`, `reseed`), compensated
write-back (`kahan_writeback`, `two_component_writeback`,
`remainder_writeback`), optimizer state in low precision (`store_state`;
Adam with 8- or 4-bit moments in one kernel per leaf, `scale_by_stored_adam`,
and with the write-back too, `stored_adamw_writeback`),
memory (`bytes_per_param`), block- and tensor-scaled formats (`scaled`:
MX, NVFP4, per-tensor fp8; `get_scaled_format`), freeze
prediction and per-group advice (`freeze`), named recipes per tensor
group (`recipes`, `groups`), backward-state policies (`Policy`, `ops`, `audit`)
and Flax modules (`nn`; `nnx.Optimizer` for Flax NNX).

The modules live in one folder per layer, each importing only the layers
below it: `grids` (formats, roundings), `engine` (writing values into
stored bits, counting), `optim` (the optax transforms), `freeze`
(predicting from a float32 run) and `backward` (policies, operators,
audit). See docs/architecture.md.
"""

__version__ = "0.3.0"

import sys

from lowprec import _moved

# Paths from before the layer folders (lowprec.store, ...) still import.
_moved.install(sys.modules[__name__])

from lowprec import freeze  # noqa: E402
from lowprec.backward import audit, nn, ops, policy  # noqa: E402
from lowprec.backward.policy import Policy  # noqa: E402
from lowprec.engine.weights import (  # noqa: E402
  apply_updates,
  check_on_grid,
  to_grid,
)
from lowprec.grids import contract, scaled  # noqa: E402
from lowprec.grids.formats import (  # noqa: E402
  Format,
  get_format,
  ieee_format,
  int_format,
)
from lowprec.grids.rounding import round_nearest, round_stochastic  # noqa: E402
from lowprec.grids.scaled import ScaledFormat, get_scaled_format  # noqa: E402
from lowprec.optim import groups, nnx, recipes  # noqa: E402
from lowprec.optim.compensated import (  # noqa: E402
  CompensatedState,
  kahan_writeback,
  remainder_writeback,
  two_component_writeback,
)
from lowprec.optim.eco import EcoState, eco  # noqa: E402
from lowprec.optim.float32_views import in_float32  # noqa: E402
from lowprec.optim.fused_adam import scale_by_stored_adam  # noqa: E402
from lowprec.optim.fused_adamw import stored_adamw_writeback  # noqa: E402
from lowprec.optim.memory import BytesPerParam, bytes_per_param  # noqa: E402
from lowprec.optim.split import SplitState, split_writeback  # noqa: E402
from lowprec.optim.stored_state import (  # noqa: E402
  StateCounts,
  StateFormat,
  StoredState,
  store_state,
)
from lowprec.optim.telemetry import (  # noqa: E402
  reseed,
  telemetry,
  telemetry_arrays,
)
from lowprec.optim.writeback import (  # noqa: E402
  BranchesState,
  CountedAndUncounted,
  WritebackState,
  counted_and_uncounted,
  counted_in_branches,
  writeback,
)

__all__ = [
  "BranchesState",
  "BytesPerParam",
  "CompensatedState",
  "CountedAndUncounted",
  "EcoState",
  "Format",
  "Policy",
  "ScaledFormat",
  "SplitState",
  "StateCounts",
  "StateFormat",
  "StoredState",
  "WritebackState",
  "apply_updates",
  "audit",
  "bytes_per_param",
  "check_on_grid",
  "contract",
  "counted_and_uncounted",
  "counted_in_branches",
  "eco",
  "freeze",
  "get_format",
  "get_scaled_format",
  "groups",
  "ieee_format",
  "in_float32",
  "int_format",
  "kahan_writeback",
  "nn",
  "nnx",
  "ops",
  "policy",
  "recipes",
  "remainder_writeback",
  "reseed",
  "round_nearest",
  "round_stochastic",
  "scale_by_stored_adam",
  "scaled",
  "split_writeback",
  "stored_adamw_writeback",
  "store_state",
  "telemetry",
  "telemetry_arrays",
  "to_grid",
  "two_component_writeback",
  "writeback",
]
