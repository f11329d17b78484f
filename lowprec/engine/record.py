"""Stored states carry their recipe.

A store's state holds codes whose meaning depends on how they were made:
uint8 codes of `dynamic8` read as `float8_e4m3fn` values, or an int8
correction read with the step of a 16-bit one (`K = 32767` instead of
127), give numbers, not errors. So the states of `lowprec.store_state`
and `lowprec.split_writeback` record the recipe that made them (per
stored leaf: format, rounding, scale, scale rule and scale dtype; the
correction's bits), and a transform refuses, at its first update, a state
recorded under another recipe, naming both.

The record is static metadata of the state's pytree (a node without
array leaves, hashable): it costs no memory, travels through `jax.jit`,
`vmap`, `scan` and `optax` wrappers, and is checked when an update is
traced. A checkpoint's arrays do not hold it: a state restored into a
template takes the template's record. `recipes_of(state)` gives the
records as strings, to be saved beside the arrays and compared with the
template's before restoring, as `experiments.checkpoint` does in each
checkpoint's metadata.
"""

from __future__ import annotations

import dataclasses

import jax

from lowprec.engine.weights import path_name

__all__ = ["Recipe", "check", "mismatch", "recipes_of"]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Recipe:
  """The recipe a stored state was made by (static: no arrays).

  Attributes:
    kind: the transform, e.g. "store_state" or "split_writeback".
    entries: `(name, spec)` pairs in a fixed order: per stored state path
      its `StateFormat` string, or a transform's settings.
    shapes: `(name, shape)` of each leaf stored with two codes to a byte
      (`lowprec.engine.codec.pack`): the shape its codes unpack to.
  """

  kind: str
  entries: tuple[tuple[str, str], ...]
  shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()

  def __str__(self) -> str:
    shown = ", ".join(f"{n}={s}" for n, s in self.entries)
    return f"{self.kind}({shown})"

  def to_json(self) -> dict:
    """A JSON-able dict (`from_json` reads it back)."""
    out = {"kind": self.kind, "entries": [list(e) for e in self.entries]}
    if self.shapes:
      out["shapes"] = [[n, list(shape)] for n, shape in self.shapes]
    return out

  @classmethod
  def from_json(cls, d: dict) -> Recipe:
    """The record `to_json` gave `d` for."""
    return cls(
      str(d["kind"]),
      tuple((str(n), str(s)) for n, s in d["entries"]),
      tuple(
        (str(n), tuple(int(k) for k in shape))
        for n, shape in d.get("shapes", ())
      ),
    )


def mismatch(
  recorded, expected: Recipe, this: str = "this transform"
) -> str | None:
  """None where `recorded` is `expected`; else the entries that differ,
  each with both values (at most three, and how many more), the
  expected one called `this`."""
  if recorded == expected:
    return None
  if not isinstance(recorded, Recipe):
    return f"the state has no recipe record (got {type(recorded).__name__})"
  if recorded.kind != expected.kind:
    return f"the state is {recorded.kind}'s, not {expected.kind}'s"
  old, new = dict(recorded.entries), dict(expected.entries)
  diff = [n for n in dict.fromkeys([*old, *new]) if old.get(n) != new.get(n)]
  shown = "; ".join(
    f"{n}: recorded {old.get(n, 'not stored')!r}, {this} "
    f"{new.get(n, 'not stored')!r}"
    for n in diff[:3]
  )
  more = f"; and {len(diff) - 3} more" if len(diff) > 3 else ""
  return shown + more


def check(recorded, expected: Recipe, fix: str) -> None:
  """Raises ValueError where `recorded` (a state's record) is not
  `expected` (the transform's), naming both and `fix`."""
  why = mismatch(recorded, expected)
  if why is not None:
    raise ValueError(
      f"{expected.kind}: the state was made under another recipe ({why}); "
      "its codes would be read as values they do not stand for. " + fix
    )


def recipes_of(tree) -> dict[str, Recipe]:
  """`{path: Recipe}` of every recipe record in `tree` (an optimizer
  state, or a training state holding one), by the record's path."""

  def is_record(x) -> bool:
    return isinstance(x, Recipe)

  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_record)[0]
  return {path_name(p): x for p, x in flat if isinstance(x, Recipe)}
