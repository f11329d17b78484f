"""lowprec: numerics of low-precision training in JAX.

Formats and rounding (`get_format`, `round_nearest`, `round_stochastic`).
"""

from lowprec import audit, freeze, nn, ops, policy
from lowprec.formats import Format, get_format, ieee_format, int_format
from lowprec.policy import Policy
from lowprec.rounding import round_nearest, round_stochastic
from lowprec.storage import apply_updates, check_on_grid, to_grid
from lowprec.telemetry import telemetry
from lowprec.writeback import WritebackState, writeback

__all__ = [
  "Format",
  "Policy",
  "WritebackState",
  "apply_updates",
  "audit",
  "check_on_grid",
  "freeze",
  "get_format",
  "ieee_format",
  "int_format",
  "nn",
  "ops",
  "policy",
  "round_nearest",
  "round_stochastic",
  "telemetry",
  "to_grid",
  "writeback",
]
