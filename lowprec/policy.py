"""Backward-state policies: which value each backward read of a tensor takes.

A *saved tensor* is one the forward rounds (`x -> x~ = Q(x)`) and the backward
reads again. Each read is a *use*, named `<tensor>@<gradient>`, e.g.
`attn.probs@dv` (the attention probabilities read by the value gradient). A
policy says, per use, which value the read takes:

  rounded   the forward's `x~`, the same random draw;
  original  `x`, before rounding;
  fresh     a new stochastic rounding of `x` (same format and scale),
            independent of everything in the forward;
  nearest   round-to-nearest of `x` (same format and scale).

A policy is a tuple of ordered rules `(regex over use names, value)`: the first
rule whose regex matches the whole use name decides that use. Resolving a
policy for an operator fails when one of its uses matches no rule, or when a
rule matches no use name at all (a typo); both errors list the operator's uses.
A policy may cover the uses of several operators, so one policy can configure
a whole model.

Which value each use *must* read (the reference gradient) and which others are
admissible is the operators' business: see the requirements tables in
`lowprec.ops` and `lowprec.audit.predict`.

Example:
  >>> p = Policy.parse("attn.probs@dv=rounded,attn.(probs@ds.*|out@.*)=fresh")
  >>> p.resolve("attention")
  {'attn.probs@dv': 'rounded', 'attn.probs@dscores': 'fresh',
   'attn.out@delta': 'fresh'}
  >>> Policy.parse(str(p)) == p
  True

Reference: "Backward-State Policy Is Part of the Learning Algorithm" (2026).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence

VALUES = ("rounded", "original", "fresh", "nearest")

# Every operator of `lowprec.ops` and the uses of its saved tensors, in the
# order its backward reads them. The requirements tables are keyed by these.
USES: dict[str, tuple[str, ...]] = {
  "dense": ("dense.in@dw", "dense.kernel@dx"),
  "norm_dense": (
    "norm.out@dgain",
    "norm.out@dw",
    "norm.out@dx",
    "dense.kernel@dx",
  ),
  "attention": ("attn.probs@dv", "attn.probs@dscores", "attn.out@delta"),
  "activation": ("act.in@dact",),
}

ALL_USES: tuple[str, ...] = tuple(
  dict.fromkeys(u for v in USES.values() for u in v)
)

# Characters the string form uses as separators.
_RESERVED = (",", "=")


def _suggest(name: str, options: Sequence[str]) -> str:
  close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
  return f" Did you mean {close[0]!r}?" if close else ""


@dataclasses.dataclass(frozen=True)
class Policy:
  """Ordered rules `(regex, value)` choosing the value each use reads.

  Frozen and hashable, so it can be a static argument under `jax.jit` and a
  non-differentiable argument of a `jax.custom_vjp`. Build one with
  `Policy.parse` from a string, a dict or a list of rules.

  Attributes:
    rules: `((regex, value), ...)`; a regex must match a use name in full; a
      value is one of `VALUES`. The first matching rule wins.

  Raises:
    ValueError: a value not in `VALUES` (with a suggestion), a regex that does
      not compile, or a regex containing `,` or `=` (the string form's
      separators).
  """

  rules: tuple[tuple[str, str], ...] = ()

  def __post_init__(self):
    rules = tuple((str(p).strip(), str(v).strip()) for p, v in self.rules)
    for pattern, value in rules:
      if not pattern:
        raise ValueError("a policy rule has an empty use pattern")
      if any(c in pattern for c in _RESERVED):
        raise ValueError(
          f"use pattern {pattern!r} contains ',' or '=', which separate rules "
          "in the string form; rewrite it without them (e.g. 'a|b', not "
          "'a{1,2}')"
        )
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"use pattern {pattern!r} is not a regex: {e}") from e
      if value not in VALUES:
        raise ValueError(
          f"unknown policy value {value!r} for {pattern!r}."
          f"{_suggest(value, VALUES)} Valid values: {', '.join(VALUES)}"
        )
    object.__setattr__(self, "rules", rules)

  # ---- construction -------------------------------------------------------

  @classmethod
  def parse(cls, spec: Policy | str | Mapping[str, str] | Sequence) -> Policy:
    """Builds a policy from any of its forms.

    Args:
      spec: a `Policy` (returned as is); a string
        `"regex=value,regex=value"` (whitespace around items is ignored; the
        empty string has no rules); a dict `{regex: value}` (insertion order
        is rule order); or a sequence of `(regex, value)` pairs.

    Returns:
      The `Policy`. `Policy.parse(str(p)) == p` for every policy `p`.

    Raises:
      ValueError: an item without exactly one `=`, an empty pattern, an
        unknown value, or a bad regex. TypeError: any other kind of spec.

    Example:
      >>> Policy.parse({"norm.out@dw": "rounded", "norm.out@.*": "original"})
      Policy('norm.out@dw=rounded,norm.out@.*=original')
    """
    if isinstance(spec, Policy):
      return spec
    if isinstance(spec, str):
      return cls(_split(spec))
    if isinstance(spec, Mapping):
      return cls(tuple(spec.items()))
    if isinstance(spec, Sequence):
      rules = []
      for item in spec:
        if not (isinstance(item, Sequence) and len(item) == 2):
          raise ValueError(
            f"a policy rule must be a (regex, value) pair, got {item!r}"
          )
        rules.append((item[0], item[1]))
      return cls(tuple(rules))
    raise TypeError(
      "expected a Policy, a string 'use=value,...', a dict or a list of "
      f"(regex, value) rules, got {type(spec).__name__}"
    )

  def override(self, spec: Policy | str | Mapping[str, str] | Sequence):
    """A policy whose rules are `spec`'s, then this policy's (first wins)."""
    return Policy(Policy.parse(spec).rules + self.rules)

  # ---- use ------------------------------------------------------------------

  def resolve(self, op: str) -> dict[str, str]:
    """The value each use of operator `op` reads, in the op's use order.

    Args:
      op: an operator name, a key of `USES` (e.g. `"attention"`).

    Returns:
      `{use: value}` for every use of `op`.

    Raises:
      ValueError: unknown operator; a rule that matches no use name of any
        operator (most likely a typo; the message suggests the closest name);
        or a use of `op` that no rule covers. Each message lists `op`'s uses.
    """
    if op not in USES:
      raise ValueError(
        f"unknown operator {op!r}.{_suggest(op, USES)} Operators: "
        + ", ".join(USES)
      )
    uses = USES[op]
    listing = f"Uses of {op}: {', '.join(uses)}."
    for pattern, _ in self.rules:
      if not any(re.fullmatch(pattern, u) for u in ALL_USES):
        raise ValueError(
          f"policy rule {pattern!r} matches no use name."
          f"{_suggest(pattern, uses) or _suggest(pattern, ALL_USES)} "
          f"{listing}"
        )
    out = {}
    for use in uses:
      value = next(
        (v for p, v in self.rules if re.fullmatch(p, use) is not None), None
      )
      if value is None:
        raise ValueError(
          f"policy {str(self)!r} has no rule for use {use!r}. {listing} Add a "
          f"rule such as '{use}=<value>' (values: {', '.join(VALUES)})."
        )
      out[use] = value
    return out

  def __str__(self) -> str:
    return ",".join(f"{p}={v}" for p, v in self.rules)

  def __repr__(self) -> str:
    return f"Policy({str(self)!r})"


def _split(text: str) -> tuple[tuple[str, str], ...]:
  rules = []
  for item in text.split(","):
    item = item.strip()
    if not item and not text.strip():
      continue
    if item.count("=") != 1:
      raise ValueError(
        f"malformed policy item {item!r} in {text!r}: expected "
        "'use=value' items separated by commas, e.g. "
        "'attn.probs@dv=rounded,attn.probs@dscores=original'"
      )
    pattern, value = item.split("=")
    rules.append((pattern, value))
  return tuple(rules)
