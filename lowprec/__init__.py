"""lowprec: numerics of low-precision training in JAX.

Formats and rounding (`get_format`, `round_nearest`, `round_stochastic`).
"""

from lowprec import freeze
from lowprec.formats import Format, get_format, ieee_format, int_format
from lowprec.rounding import round_nearest, round_stochastic
from lowprec.storage import apply_updates, check_on_grid, to_grid
from lowprec.telemetry import telemetry
from lowprec.writeback import WritebackState, writeback

__all__ = [
  "Format",
  "WritebackState",
  "apply_updates",
  "check_on_grid",
  "freeze",
  "get_format",
  "ieee_format",
  "int_format",
  "round_nearest",
  "round_stochastic",
  "telemetry",
  "to_grid",
  "writeback",
]
