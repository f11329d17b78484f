"""Rules: which leaf is stored how, in one language with two dialects.

A store is chosen per leaf by its "/"-joined path. Weights are named by
parameter paths ("params/Dense_0/kernel"), optimizer state by state paths
("0/mu/Dense_0/kernel"). The same forms serve both; they differ only where
the two kinds of tree differ:

* parameters (`format_lookup`): one format, a pytree of formats shaped
  like (a prefix of) the params, or ordered `(regex, format)` rules matched
  with `re.fullmatch` against the whole path; the first match wins and a
  parameter no rule matches is an error (every weight must be placed);
* state (`StateRules`): a dict or ordered `(regex, spec)` rules whose regex
  matches whole "/"-separated components of the path ("mu" matches
  "0/mu/dense/kernel"); a leaf no rule matches is kept as it is (a step
  count, a float32 leaf), and a rule that matches no leaf is an error (a
  typo would otherwise store nothing).

Values are parsed and regexes compiled when the rules are built, so a bad
name or regex fails at once, not at the first update.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.grids.formats import (
  Format,
  ScaledFormat,
  get_format,
  get_scaled_format,
  is_scaled,
)


def path_name(path) -> str:
  """The "/"-joined name of a pytree key path, e.g. "params/Dense_0/kernel".

  A trailing `.value` attribute is not part of the name: it is the box
  around an array (a Flax NNX `Variable`, a linen `Partitioned`), so that a
  parameter has the same name whether it is met boxed (as `nnx.Optimizer`
  hands it to `init`) or as a plain array (as it hands it to `update`).
  """
  path = tuple(path)
  while path and _is_box_key(path[-1]):
    path = path[:-1]
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _first(names, n: int) -> str:
  """The first `n` of `names`, quoted, and how many more there are."""
  more = f" and {len(names) - n} more" if len(names) > n else ""
  return ", ".join(repr(x) for x in names[:n]) + more


def _is_box_key(k) -> bool:
  return isinstance(k, jax.tree_util.GetAttrKey) and k.name in _BOX_FIELDS


# The attribute under which Flax boxes (nnx.Variable, linen Partitioned and
# LogicallyPartitioned) hold their array.
_BOX_FIELDS = ("value", "raw_value")


def is_array(x) -> bool:
  """Whether a pytree leaf is an array (concrete, traced or abstract)."""
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _compile(pattern: str, what: str, wrap: str = "{}") -> re.Pattern:
  try:
    return re.compile(wrap.format(pattern))
  except re.error as e:
    raise ValueError(f"bad regex {pattern!r} in {what}s: {e}") from e


def map_spec(spec, parse):
  """`spec` (rules, a pytree or one format) with every format given to
  `parse`, in the same form."""
  if _is_rules(spec):
    return [(p, parse(f)) for p, f in spec]
  return jax.tree.map(parse, spec, is_leaf=_is_format_leaf)


# ---- the parameter dialect ---------------------------------------------------


# A function from a parameter's key path to its format (None: untouched).
FormatLookup = Callable[[tuple], Format | None]


def _is_format_leaf(x) -> bool:
  return x is None or isinstance(
    x, str | Format | ScaledFormat | np.dtype | type
  )


def _is_rules(spec) -> bool:
  # Rules are a list (or tuple) of (regex, format) pairs: a sequence whose
  # every entry is a pair starting with a string. Pairs may be lists too.
  return (
    isinstance(spec, list | tuple)
    and bool(spec)
    and all(
      isinstance(r, tuple | list) and len(r) == 2 and isinstance(r[0], str)
      for r in spec
    )
  )


def _as_format(f) -> Format | ScaledFormat | None:
  if f is None:
    return None
  return get_scaled_format(f) if is_scaled(f) else get_format(f)


def format_lookup(spec) -> FormatLookup:
  """Parses a format specification (see the module docstring).

  Formats are parsed and regexes compiled here, so a bad name fails when the
  transform is built, not at its first update.

  Raises:
    ValueError: unknown format names, bad regexes; the returned lookup raises
      for a parameter path that the specification does not cover.
  """
  if _is_rules(spec):
    by_name = rule_lookup(
      spec,
      _as_format,
      what="format rule",
      fix="e.g. a last catch-all (r'.*', None) to leave the remaining "
      "parameters float32",
    )
    return lambda path: by_name(path_name(path))

  entries, _ = jax.tree_util.tree_flatten_with_path(
    spec, is_leaf=_is_format_leaf
  )
  table = {_key_names(p): _as_format(f) for p, f in entries}

  def by_tree(path) -> Format | None:
    keys = _key_names(path)
    # The longest prefix wins, so a format tree may stop above the leaves.
    for n in range(len(keys), -1, -1):
      if keys[:n] in table:
        return table[keys[:n]]
    known = sorted("/".join(k) for k in table)
    raise ValueError(
      f"the format pytree has no entry for parameter {path_name(path)!r} or "
      f"any prefix of it (entries: {_first(known, 8)}); add one, with None to "
      "leave it float32"
    )

  return by_tree


def rule_lookup(rules, parse, *, what: str, fix: str) -> Callable:
  """`name -> parse(value)` of the first `(regex, value)` rule whose regex
  `re.fullmatch`es the "/"-joined parameter name.

  Values are parsed and regexes compiled here, so a bad rule fails at once;
  a name that no rule matches raises a ValueError naming it, the rules and
  `fix`.
  """
  compiled = [(_compile(p, what), parse(v)) for p, v in rules]

  def lookup(name: str):
    for regex, value in compiled:
      if regex.fullmatch(name):
        return value
    shown = ", ".join(repr(p) for p, _ in rules)
    raise ValueError(
      f"no {what} matches parameter {name!r} (rules, matched with "
      f"re.fullmatch in order: {shown}); add a rule for it, {fix}"
    )

  return lookup


def _key_names(path) -> tuple[str, ...]:
  return tuple(path_name((k,)) for k in path)


# ---- the state dialect -------------------------------------------------------


class StateRule(NamedTuple):
  """One compiled state rule."""

  pattern: str
  regex: re.Pattern
  value: Any  # what the rule stores a leaf as; None keeps it


def state_rules(rules, parse) -> tuple[StateRule, ...]:
  """Compiled state rules; `parse` reads each value (None stays None)."""
  if isinstance(rules, Mapping):
    rules = list(rules.items())
  ok = isinstance(rules, list | tuple) and all(
    isinstance(r, list | tuple) and len(r) == 2 and isinstance(r[0], str)
    for r in rules
  )
  if not ok or not rules:
    raise ValueError(
      "store_state takes rules over state paths: a dict or a list of "
      "(regex, spec) pairs, e.g. {'mu': 'bfloat16:stochastic', 'nu': "
      f"'float8_e5m2:stochastic:block128'}}; got {rules!r:.80}"
    )
  out = []
  for pattern, value in rules:
    # Whole '/'-separated components of the path: 'mu' matches
    # '0/mu/dense/kernel' but not '0/mum/dense/kernel'.
    regex = _compile(pattern, "state rule", "(?:.*/)?(?:{})(?:/.*)?")
    out.append(StateRule(pattern, regex, parse(value)))
  return tuple(out)


def plan(rules, state, *, check: bool) -> dict[str, Any]:
  """State path -> format of every stored leaf, in leaf order.

  With `check`, raises for a rule that matches no leaf and for a stored
  leaf that is not a floating-point array.
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  out, used = {}, set()
  for path, x in flat:
    name = path_name(path)
    hits = [r for r in rules if r.regex.fullmatch(name)]
    used.update(r.pattern for r in hits)
    if not hits or hits[0].value is None:
      continue
    if check:
      _check_leaf(name, x, hits[0])
    out[name] = hits[0].value
  if check:
    unused = [r.pattern for r in rules if r.pattern not in used]
    if unused:
      paths = [path_name(p) for p, _ in flat]
      raise ValueError(
        f"store_state rule {unused[0]!r} matches no state leaf of the inner "
        f"transform (its leaves: {_first(paths, 10) or 'none'}); a rule's "
        "regex must re.fullmatch one or more whole '/'-separated components "
        "of a state path. Fix the regex or drop the rule"
      )
  return out


def _check_leaf(name: str, x, rule: StateRule) -> None:
  if is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
    return
  what = (
    f"holds {np.dtype(x.dtype).name} values"
    if is_array(x)
    else f"is a {type(x).__name__}, not an array"
  )
  count = " (a step count)" if name.split("/")[-1] == "count" else ""
  raise ValueError(
    f"store_state rule {rule.pattern!r} matches state leaf {name!r}, which "
    f"{what}{count}: only floating-point state arrays are stored in a "
    f"low-precision format. Narrow the rule, or put ({name!r}, None) "
    "before it to keep that leaf as it is"
  )
