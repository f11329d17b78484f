"""Requirements tables: which value each use must read, and what may replace it.

The *reference gradient* is the exact gradient of the forward as it actually
ran, with gradients passed through every rounding unchanged. For each use it
fixes the value the backward must read: `rounded` where the forward multiplied
`x~`, `original` where the derivative is of a function evaluated before
rounding. A substitute is *admissible* when, with the forward held fixed, it
gives the reference gradient on average over the backward's own randomness.

Whether a value read equals the must-read value depends on how the tensor was
rounded, summarised by its *kind*:

  none           not rounded: every value is `x`;
  nearest        rounded to nearest: `rounded` and `nearest` are the same;
  deterministic  rounded by a fixed map other than one nearest rounding;
  stochastic     rounded with a random draw.

`classify` turns (requirement, kind, value read) into a prediction:

  exact     the value read is the must-read value, bit for bit;
  unbiased  an admissible substitute: `fresh` where `original` is required
            and the gradient is linear in the value read (an independent
            unbiased draw averages to `original`);
  biased    anything else: the mean gradient differs from the reference
            whenever the downstream gradient depends on the forward's draw.
"""

from __future__ import annotations

import dataclasses

KINDS = ("none", "nearest", "deterministic", "stochastic")
VERDICTS = ("exact", "unbiased", "biased")


@dataclasses.dataclass(frozen=True)
class Requirement:
  """One row of an operator's requirements table.

  Attributes:
    use: the use name, e.g. `"attn.probs@dv"`.
    tensor: the operator field holding the saved tensor's `Rounding`.
    must_read: `"rounded"` or `"original"`: what the reference reads.
    linear: whether the gradient is linear in the value read, all other
      factors fixed (then `fresh` is admissible where `original` is required).
    feeds: names of the operator's inputs whose gradients this use enters.
    storage_only: the forward's output does not depend on the rounded value
      (it is rounded for storage only), so reusing the draw is no different
      on average from an independent copy.
    reason: the one-line derivation.
  """

  use: str
  tensor: str
  must_read: str
  linear: bool
  feeds: tuple[str, ...]
  reason: str
  storage_only: bool = False


def _canonical(value: str, kind: str, own_identity: bool) -> str:
  """The value a read actually produces, up to equality."""
  if value == "rounded":
    return {"none": "original", "nearest": "nearest"}.get(kind, "rounded")
  if value in ("fresh", "nearest") and own_identity:
    return "original"
  return value


def classify(req: Requirement, value: str, kind: str, own_identity: bool):
  """Predicted effect on the mean gradient of reading `value` for `req.use`.

  Args:
    req: the requirement.
    value: the policy value read (`rounded`, `original`, `fresh`, `nearest`).
    kind: how the tensor's rounded value was produced (one of `KINDS`).
    own_identity: whether the tensor's own rounding (used by `fresh` and
      `nearest`) is no rounding.

  Returns:
    `"exact"`, `"unbiased"` or `"biased"`.
  """
  got = _canonical(value, kind, own_identity)
  need = _canonical(req.must_read, kind, own_identity)
  if got == need:
    return "exact"
  if need == "original" and got == "fresh" and req.linear:
    return "unbiased"
  return "biased"


def copy_value(own_mode: str, own_identity: bool) -> str:
  """The policy value giving an independent copy of the forward's rounding."""
  if own_identity:
    return "original"
  return "fresh" if own_mode == "stochastic" else "nearest"


def reuse_differs(
  req: Requirement, kind: str, own_mode: str, own_identity: bool
) -> bool:
  """Whether reusing the forward's draw changes the mean gradient relative to
  an independent copy from the same distribution."""
  copy = copy_value(own_mode, own_identity)
  if _canonical("rounded", kind, own_identity) == _canonical(
    copy, kind, own_identity
  ):
    return False
  # Same distribution, and nothing downstream saw the forward's draw.
  return not (req.storage_only and kind == "stochastic")
