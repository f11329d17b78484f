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

What a read gives, up to equality, is its *product* (`produces`):

  original     `x` itself;
  rounded      the forward's `x~`, the draw the forward went on with;
  nearest      the round-to-nearest of `x` (a fixed map);
  draw         a random value independent of everything the forward
               computed, with mean `x`: a `fresh` read, and the forward's
               own draw of a tensor rounded for storage only (the forward
               went on with `x`, so nothing downstream saw the draw);
  offset_draw  independent of the forward, but with a mean other than `x`
               (a fresh copy of a value whose rounding chain holds a
               deterministic rounding; a stochastic rounding whose block
               scales can clip the block's largest values);
  requantized  a deterministic rounding other than the forward's (a
               block-scaled tensor quantized along another axis).

`classify` turns (requirement, product read, product required) into a
prediction:

  exact     the value read is the must-read value, bit for bit;
  unbiased  an admissible substitute: a `draw` where `original` is required
            and the gradient is affine in the value read (an independent
            unbiased draw then averages to `original`);
  biased    anything else: the mean gradient differs from the reference
            whenever the downstream gradient depends on the forward's draw.
"""

from __future__ import annotations

import dataclasses

KINDS = ("none", "nearest", "deterministic", "stochastic")
PRODUCTS = (
  "original",
  "rounded",
  "nearest",
  "draw",
  "offset_draw",
  "requantized",
)
VERDICTS = ("exact", "unbiased", "biased")


@dataclasses.dataclass(frozen=True)
class Requirement:
  """One row of an operator's requirements table.

  Attributes:
    use: the use name, e.g. `"attn.probs@dv"`.
    tensor: the operator field holding the saved tensor's `Rounding`.
    must_read: `"rounded"` or `"original"`: what the reference reads.
    linear: whether the gradient is affine in the value read, all other
      factors fixed (then an independent unbiased draw, `fresh`, is
      admissible where `original` is required).
    feeds: names of the operator's inputs whose gradients this use enters.
    storage_only: the forward's output does not depend on the rounded value
      (it is rounded for storage only), so the stored stochastic draw is,
      for the backward, an independent unbiased draw: reusing it is on
      average the same as an independent copy, and admissible wherever
      `fresh` is.
    reason: the one-line derivation.
  """

  use: str
  tensor: str
  must_read: str
  linear: bool
  feeds: tuple[str, ...]
  reason: str
  storage_only: bool = False


def produces(
  value: str,
  kind: str,
  own_identity: bool,
  storage_only: bool = False,
  saturating: bool = False,
) -> str:
  """The product (one of `PRODUCTS`) of reading `value` of a saved tensor.

  Args:
    value: the policy value (`rounded`, `original`, `fresh`, `nearest`).
    kind: how the tensor's rounded value was produced (one of `KINDS`).
    own_identity: whether the tensor's own rounding (used by `fresh` and
      `nearest`) is no rounding.
    storage_only: the forward went on with the original, not the draw.
    saturating: the tensor's rounding can clip (`Rounding.saturates`): its
      stochastic draws then have a mean other than `x` (`offset_draw`).
  """
  draw = "offset_draw" if saturating else "draw"
  if value == "original":
    return "original"
  if value == "rounded":
    if kind == "stochastic" and storage_only:
      return draw
    return {"none": "original", "nearest": "nearest"}.get(kind, "rounded")
  if own_identity:
    return "original"
  return draw if value == "fresh" else "nearest"


def classify(req: Requirement, got: str, need: str) -> str:
  """Predicted effect on the mean gradient of a read producing `got` where
  the reference reads `need` (products, see `produces`).

  Returns:
    `"exact"`, `"unbiased"` or `"biased"`.
  """
  if got == need:
    return "exact"
  if need == "original" and got == "draw" and req.linear:
    return "unbiased"
  return "biased"


def copy_value(own_mode: str, own_identity: bool) -> str | None:
  """The policy value giving an independent copy of the forward's rounding
  from the same distribution (None: the tensor is not rounded)."""
  if own_identity:
    return None
  return "fresh" if own_mode == "stochastic" else "nearest"


def reuse_differs(rounded: str, copy: str | None) -> bool | None:
  """Whether reusing the forward's draw (product `rounded`) changes the mean
  gradient relative to an independent copy from the same distribution
  (product `copy`; None: no value reads such a copy)."""
  if copy is None:
    return None
  # Equal products: the same value (nearest, deterministic), or two
  # independent draws of one distribution (a tensor rounded for storage).
  return rounded != copy
