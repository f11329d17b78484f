"""Names a user types: one did-you-mean hint, one check of a choice.

Every registry of lowprec, and of the runner built on it, checks a name
against its valid choices here, so an unknown name always reads the same:

  unknown rounding 'stochastc'; valid: nearest, stochastic, deadzone.
  Did you mean 'stochastic'?
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def suggest(name: str, valid: Iterable[str], cutoff: float = 0.6) -> str:
  """`" Did you mean 'x'?"` for the closest valid name, or `""`."""
  close = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=cutoff)
  return f" Did you mean {close[0]!r}?" if close else ""


def check_choice(what: str, value, valid: Iterable[str]) -> None:
  """Raises `ValueError` naming `what`, the valid choices and the closest,
  unless `value` is one of `valid`."""
  valid = list(valid)
  if value not in valid:
    raise ValueError(
      f"unknown {what} {value!r}; valid: {', '.join(valid)}."
      f"{suggest(value, valid)}"
    )
