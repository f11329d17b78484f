"""lowprec: numerics of low-precision training in JAX.

Formats and rounding (`get_format`, `round_nearest`, `round_stochastic`),
write-back without master weights (`writeback`, `in_float32`, `to_grid`,
`apply_updates`, `telemetry`, `telemetry_arrays`, `reseed`), optimizer
state in low precision (`store_state`), block- and tensor-scaled formats
(`scaled`: MX, NVFP4, per-tensor fp8; `get_scaled_format`), freeze
prediction (`freeze`), backward-state policies (`Policy`, `ops`, `audit`)
and Flax modules (`nn`; `nnx.Optimizer` for Flax NNX).
"""

__version__ = "0.2.0"

from lowprec import audit, freeze, nn, nnx, ops, policy, scaled  # noqa: E402
from lowprec.float32_views import in_float32
from lowprec.formats import Format, get_format, ieee_format, int_format
from lowprec.policy import Policy
from lowprec.rounding import round_nearest, round_stochastic
from lowprec.scaled import ScaledFormat, get_scaled_format
from lowprec.state_storage import (
  StateCounts,
  StateFormat,
  StoredState,
  store_state,
)
from lowprec.storage import apply_updates, check_on_grid, to_grid
from lowprec.telemetry import reseed, telemetry, telemetry_arrays
from lowprec.writeback import WritebackState, writeback

__all__ = [
  "Format",
  "Policy",
  "ScaledFormat",
  "StateCounts",
  "StateFormat",
  "StoredState",
  "WritebackState",
  "apply_updates",
  "audit",
  "check_on_grid",
  "freeze",
  "get_format",
  "get_scaled_format",
  "ieee_format",
  "in_float32",
  "int_format",
  "nn",
  "nnx",
  "ops",
  "policy",
  "reseed",
  "round_nearest",
  "round_stochastic",
  "scaled",
  "store_state",
  "telemetry",
  "telemetry_arrays",
  "to_grid",
  "writeback",
]
