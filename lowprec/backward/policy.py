"""Backward-state policies: which value each backward read of a tensor takes.

A *saved tensor* is one the forward rounds (`x -> x~ = Q(x)`) and the backward
reads again. Each read is a *use*, named `<tensor>@<gradient>`, e.g.
`attn.probs@dv` (the attention probabilities read by the value gradient). A
policy says, per use, which value the read takes:

  rounded   the forward's `x~`, the same random draw;
  original  `x`, before rounding;
  fresh     a new stochastic rounding of `x` (same format and scale),
            independent of everything in the forward;
  nearest   round-to-nearest of `x` (same format and scale);
  requantized  block-scaled operators only (`ops.ScaledDense`): a new
            quantization of `x` with blocks along the axis the reading
            GEMM contracts, as block-scaled hardware needs.

A policy is a tuple of ordered rules `(regex over use names, value)`: the first
rule whose regex matches the whole use name decides that use. Resolving a
policy for an operator fails when one of its uses matches no rule, or when a
rule matches no use name at all (a typo); both errors list the operator's uses.
A policy may cover the uses of several operators, so one policy can configure
a whole model.

Which use names exist is a `Registry`, an immutable value: `BUILTIN` holds
the operators of `lowprec.ops`, `BUILTIN.register(op)` returns a registry
with an operator of your own added (`lowprec.ops.Custom`), and a policy
carries the registry its rules are checked against (`Policy.parse(spec,
registry=...)`). Resolving takes the uses from the operator passed in, so
an operator of your own resolves without registering; registering is what
lets one policy name the uses of built-in operators and yours together.

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
import re
import types
from collections.abc import Mapping, Sequence

from lowprec.grids import choices

# What every operator's uses can read; block-scaled operators
# (`ops.ScaledDense`) also read `requantized`.
OP_VALUES = ("rounded", "original", "fresh", "nearest")
VALUES = (*OP_VALUES, "requantized")

# Characters the string form uses as separators.
_RESERVED = (",", "=")


def _suggest(name: str, options: Sequence[str]) -> str:
  return choices.suggest(name, options, cutoff=0.5)


def check_use_name(use: str) -> str:
  """`use` if it is a well-formed use name `<tensor>@<what it feeds>`.

  Raises:
    ValueError: no `@`, more than one, an empty side, whitespace, or one of
      the string form's separators `,` `=`.
  """
  if not isinstance(use, str) or use.count("@") != 1:
    raise ValueError(
      f"use name {use!r} must be '<tensor>@<what it feeds>', with exactly "
      "one '@' (e.g. 'swiglu.act@dw_down')"
    )
  tensor, feeds = use.split("@")
  if not tensor or not feeds:
    raise ValueError(f"use name {use!r} has an empty tensor or feed name")
  if any(c.isspace() or c in _RESERVED for c in use):
    raise ValueError(
      f"use name {use!r} contains whitespace, ',' or '=' (reserved by the "
      "policy string form)"
    )
  return use


@dataclasses.dataclass(frozen=True)
class Registry:
  """The operators a policy may configure, each with the uses it reads.

  A registry is a value: `register` returns a new registry and never
  changes the one it is called on, so no module state is shared between
  users, and a registry (like the `Policy` holding it) is hashable and can
  be a static argument under `jax.jit`. `BUILTIN` holds the operators of
  `lowprec.ops`; add your own with `BUILTIN.register(op)`.

  A policy consults its registry only to catch typos: a rule must match at
  least one use of some registered operator (or of the operator being
  resolved). Which value a use reads never depends on the registry.

  Attributes:
    ops: `((operator name, (use, ...)), ...)`, in registration order. Use
      names are `<tensor>@<what it feeds>`; two operators may share a use
      (the kernel of `dense` and `norm_dense` is read the same way).

  Raises:
    ValueError: an operator named twice, a malformed or repeated use name.

  Example:
    >>> reg = BUILTIN.register(("swiglu", ("swiglu.act@dw_down",)))
    >>> reg.uses("swiglu")
    ('swiglu.act@dw_down',)
    >>> "swiglu" in BUILTIN
    False
  """

  ops: tuple[tuple[str, tuple[str, ...]], ...] = ()

  def __post_init__(self):
    ops = tuple((str(n), tuple(u)) for n, u in self.ops)
    names = [n for n, _ in ops]
    for name in names:
      if names.count(name) > 1:
        raise ValueError(f"operator {name!r} is registered twice")
    for name, uses in ops:
      for use in uses:
        check_use_name(use)
      if len(set(uses)) != len(uses):
        raise ValueError(f"operator {name!r} lists a use twice: {uses}")
    object.__setattr__(self, "ops", ops)

  def register(self, op, uses: Sequence[str] | None = None) -> Registry:
    """A registry with `op` added (this one is unchanged).

    Args:
      op: an operator (anything with `name` and `uses`, e.g. an
        `ops.Custom`), or a `(name, uses)` pair, or a name with `uses`.
      uses: the operator's use names when `op` is a name.

    Returns:
      The new registry; this one itself if `op` is already registered with
        the same uses.

    Raises:
      ValueError: the name is registered with other uses (the message lists
        both), or a use name is malformed.
    """
    if uses is None:
      if isinstance(op, tuple) and len(op) == 2:
        op, uses = op
      else:
        op, uses = op.name, op.uses
    name, uses = str(op), tuple(uses)
    known = dict(self.ops)
    if name in known:
      if known[name] == uses:
        return self
      raise ValueError(
        f"operator {name!r} is already registered with uses "
        f"{', '.join(known[name])}; got {', '.join(uses)}. Give your "
        "operator another name."
      )
    return Registry((*self.ops, (name, uses)))

  def merge(self, other: Registry) -> Registry:
    """Both registries' operators (this one's first)."""
    out = self
    for name, uses in other.ops:
      out = out.register(name, uses)
    return out

  def uses(self, op: str) -> tuple[str, ...]:
    """The uses of operator `op`, in its backward's order.

    Raises:
      ValueError: `op` is not registered (with a suggestion and the list).
    """
    known = dict(self.ops)
    if op not in known:
      raise ValueError(
        f"unknown operator {op!r}.{_suggest(op, known)} Operators: "
        + ", ".join(known)
        + ". Register your own with lowprec.policy.BUILTIN.register(op) "
        "and pass the registry to Policy.parse(..., registry=...)."
      )
    return known[op]

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(n for n, _ in self.ops)

  @property
  def all_uses(self) -> tuple[str, ...]:
    """Every use of every operator, each once."""
    return tuple(dict.fromkeys(u for _, uses in self.ops for u in uses))

  def __contains__(self, op) -> bool:
    return op in self.names

  def __repr__(self) -> str:
    return f"Registry({', '.join(self.names)})"


# The operators of `lowprec.ops` and the uses of their saved tensors, in the
# order their backward reads them. The requirements tables are keyed by these.
BUILTIN = Registry(
  (
    ("dense", ("dense.in@dw", "dense.kernel@dx")),
    (
      "norm_dense",
      ("norm.out@dgain", "norm.out@dw", "norm.out@dx", "dense.kernel@dx"),
    ),
    ("attention", ("attn.probs@dv", "attn.probs@dscores", "attn.out@delta")),
    ("activation", ("act.in@dact",)),
    ("scaled_dense", ("sdense.in@dw", "sdense.kernel@dx")),
  )
)

# Read-only views of `BUILTIN`.
USES: Mapping[str, tuple[str, ...]] = types.MappingProxyType(dict(BUILTIN.ops))
ALL_USES: tuple[str, ...] = BUILTIN.all_uses


@dataclasses.dataclass(frozen=True)
class Policy:
  """Ordered rules `(regex, value)` choosing the value each use reads.

  Frozen and hashable, so it can be a static argument under `jax.jit` and a
  non-differentiable argument of a `jax.custom_vjp`. Build one with
  `Policy.parse` from a string, a dict or a list of rules.

  Attributes:
    rules: `((regex, value), ...)`; a regex must match a use name in full; a
      value is one of `VALUES`. The first matching rule wins.
    registry: the operators whose use names the rules may name (`BUILTIN`
      unless you add your own); it only serves to catch typos, see
      `resolve`. Not part of the string form.

  Raises:
    ValueError: a value not in `VALUES` (with a suggestion), a regex that does
      not compile, or a regex containing `,` or `=` (the string form's
      separators).
  """

  rules: tuple[tuple[str, str], ...] = ()
  registry: Registry = BUILTIN

  def __post_init__(self):
    if not isinstance(self.registry, Registry):
      raise TypeError(
        f"registry must be a lowprec.policy.Registry, got {self.registry!r}"
      )
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
  def parse(
    cls,
    spec: Policy | str | Mapping[str, str] | Sequence,
    registry: Registry | None = None,
  ) -> Policy:
    """Builds a policy from any of its forms.

    Args:
      spec: a `Policy` (returned as is, its registry merged with `registry`
        if one is given); a string
        `"regex=value,regex=value"` (whitespace around items is ignored; the
        empty string has no rules); a dict `{regex: value}` (insertion order
        is rule order); or a sequence of `(regex, value)` pairs.
      registry: the operators the rules may name (default `BUILTIN`).

    Returns:
      The `Policy`. `Policy.parse(str(p), p.registry) == p` for every
        policy `p`.

    Raises:
      ValueError: an item without exactly one `=`, an empty pattern, an
        unknown value, or a bad regex.
      TypeError: any other kind of spec.

    Example:
      >>> Policy.parse({"norm.out@dw": "rounded", "norm.out@.*": "original"})
      Policy('norm.out@dw=rounded,norm.out@.*=original')
    """
    if isinstance(spec, Policy):
      if registry is None or registry == spec.registry:
        return spec
      return cls(spec.rules, spec.registry.merge(registry))
    registry = BUILTIN if registry is None else registry
    if isinstance(spec, str):
      return cls(_split(spec), registry)
    if isinstance(spec, Mapping):
      return cls(tuple(spec.items()), registry)
    if isinstance(spec, Sequence):
      rules = []
      for item in spec:
        if not (isinstance(item, Sequence) and len(item) == 2):
          raise ValueError(
            f"a policy rule must be a (regex, value) pair, got {item!r}"
          )
        rules.append((item[0], item[1]))
      return cls(tuple(rules), registry)
    raise TypeError(
      "expected a Policy, a string 'use=value,...', a dict or a list of "
      f"(regex, value) rules, got {type(spec).__name__}"
    )

  def override(self, spec: Policy | str | Mapping[str, str] | Sequence):
    """A policy whose rules are `spec`'s, then this policy's (first wins);
    its registry holds the operators of both."""
    other = Policy.parse(spec, self.registry)
    return Policy(other.rules + self.rules, self.registry.merge(other.registry))

  def with_registry(self, registry: Registry) -> Policy:
    """This policy, its rules allowed to name `registry`'s uses too."""
    return Policy.parse(self, registry)

  # ---- use ------------------------------------------------------------------

  def resolve(self, op) -> dict[str, str]:
    """The value each use of operator `op` reads, in the op's use order.

    The uses come from `op` itself when it is an operator object (so an
    operator of your own resolves without being registered), else from the
    policy's registry. Every rule must match some use of the registry's
    operators or of `op`: a rule matching none is a typo.

    Args:
      op: an operator name in `self.registry` (e.g. `"attention"`), or an
        operator object with `name` and `uses` (e.g. an `ops.Custom`).

    Returns:
      `{use: value}` for every use of `op`.

    Raises:
      ValueError: unknown operator; a rule that matches no use name of any
        operator (most likely a typo; the message suggests the closest name);
        or a use of `op` that no rule covers. Each message lists `op`'s uses.
    """
    if isinstance(op, str):
      name, uses = op, self.registry.uses(op)
    else:
      name, uses = op.name, tuple(op.uses)
    known = tuple(dict.fromkeys((*uses, *self.registry.all_uses)))
    listing = f"Uses of {name}: {', '.join(uses)}."
    for pattern, _ in self.rules:
      if not any(re.fullmatch(pattern, u) for u in known):
        hint = ""
        if name not in self.registry:
          hint = (
            f" (Rules naming other operators' uses need them registered: "
            f"Policy.parse(..., registry=BUILTIN.register(op)); {name} is "
            "not in this policy's registry.)"
          )
        raise ValueError(
          f"policy rule {pattern!r} matches no use name."
          f"{_suggest(pattern, uses) or _suggest(pattern, known)} "
          f"{listing}{hint}"
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
      readable = getattr(op, "values", VALUES)
      if value not in readable:
        raise ValueError(
          f"policy {str(self)!r} reads {value!r} for use {use!r}, which "
          f"{name} cannot read (its uses read {', '.join(readable)}; "
          f"{value!r} is for block-scaled operators, ops.ScaledDense). "
          f"Give {use!r} a rule of its own before the one that matched."
        )
      out[use] = value
    return out

  def __str__(self) -> str:
    return ",".join(f"{p}={v}" for p, v in self.rules)

  def __repr__(self) -> str:
    extra = [n for n in self.registry.names if n not in BUILTIN]
    more = f", registry=+{'+'.join(extra)}" if extra else ""
    return f"Policy({str(self)!r}{more})"


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
