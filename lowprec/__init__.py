"""lowprec: numerics of low-precision training in JAX.

Formats and rounding (`get_format`, `round_nearest`, `round_stochastic`),
write-back without master weights (`writeback`, `in_float32`, `to_grid`,
`apply_updates`, `telemetry`, `telemetry_arrays`, `reseed`), compensated
write-back (`kahan_writeback`, `two_component_writeback`,
`remainder_writeback`), optimizer state in low precision (`store_state`),
memory (`bytes_per_param`), block- and tensor-scaled formats (`scaled`:
MX, NVFP4, per-tensor fp8; `get_scaled_format`), freeze
prediction and per-group advice (`freeze`), named recipes per tensor
group (`recipes`, `groups`), backward-state policies (`Policy`, `ops`, `audit`)
and Flax modules (`nn`; `nnx.Optimizer` for Flax NNX).
"""

__version__ = "0.2.0"

from lowprec import (  # noqa: E402
  audit,
  contract,
  freeze,
  groups,
  nn,
  nnx,
  ops,
  policy,
  recipes,
  scaled,
)
from lowprec.compensated import (
  CompensatedState,
  kahan_writeback,
  remainder_writeback,
  two_component_writeback,
)
from lowprec.eco import EcoState, eco
from lowprec.float32_views import in_float32
from lowprec.formats import Format, get_format, ieee_format, int_format
from lowprec.memory import BytesPerParam, bytes_per_param
from lowprec.policy import Policy
from lowprec.rounding import round_nearest, round_stochastic
from lowprec.scaled import ScaledFormat, get_scaled_format
from lowprec.split import SplitState, split_writeback
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
  "BytesPerParam",
  "CompensatedState",
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
  "scaled",
  "split_writeback",
  "store_state",
  "telemetry",
  "telemetry_arrays",
  "to_grid",
  "two_component_writeback",
  "writeback",
]
