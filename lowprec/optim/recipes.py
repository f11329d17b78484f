"""Named recipes: how a group of weights is stored, and its optimizer state.

A weight recipe (`WEIGHTS`) is a grid and a write-back onto it: plain
(nearest or stochastic), compensated (Kahan with a buffer, the 8-bit
split, the exact remainder) or ECO (the error folded into the first
moment). A state recipe (`STATES`) says how AdamW's moments are stored
between steps (`lowprec.store_state`). Each knows its bytes per parameter,
builds its optax transform around an optimizer (`Weights.apply`,
`State.apply`), and writes the same transform as source code
(`Weights.code`, `State.code`), so that a recommendation
(`lowprec.freeze.advise`) can be run as it is or pasted into a training
script and give the same bits.

    >>> from lowprec import recipes
    >>> recipes.WEIGHTS["bf16_kahan"].bytes, recipes.STATES["q8"].bytes
    (4.0, 2.03125)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

from lowprec.grids.formats import get_format, get_scaled_format, is_scaled
from lowprec.optim.compensated import (
  kahan_writeback,
  remainder_writeback,
)
from lowprec.optim.eco import eco
from lowprec.optim.float32_views import in_float32
from lowprec.optim.split import split_writeback
from lowprec.optim.stored_state import parse_state_format, store_state
from lowprec.optim.writeback import writeback

COMPENSATIONS = ("none", "kahan", "split", "remainder", "eco")


@dataclasses.dataclass(frozen=True)
class Weights:
  """A grid for the weights and the write-back onto it.

  Attributes:
    name: the recipe's name, e.g. "bf16_kahan".
    fmt: the grid (a format name, "mxfp8_e4m3" for MX); None keeps the
      weights in float32 (no write-back).
    rounding: "nearest" or "stochastic".
    compensation: one of `COMPENSATIONS`.
    buffer: Kahan's buffer format.
    correction_bits: the split's correction width (8 or 16).
  """

  name: str
  fmt: str | None
  rounding: str = "nearest"
  compensation: str = "none"
  buffer: str = "bfloat16"
  correction_bits: int = 8

  @property
  def weight_bytes(self) -> float:
    """Bytes per weight of the grid (MX: elements and one scale byte per
    block); 4 for float32."""
    if self.fmt is None:
      return 4.0
    if is_scaled(self.fmt):
      f = get_scaled_format(self.fmt)
      return f.element.bits / 8 + 1 / f.block
    return get_format(self.fmt).bits / 8

  @property
  def extra_bytes(self) -> float:
    """Bytes per weight the write-back keeps beside it (buffer, remainder,
    correction); ECO keeps its error in the optimizer's first moment."""
    return {
      "none": 0.0,
      "kahan": get_format(self.buffer).bits / 8,
      "split": self.correction_bits / 8,
      "remainder": 2.0,
      "eco": 0.0,
    }[self.compensation]

  @property
  def bytes(self) -> float:
    return self.weight_bytes + self.extra_bytes

  @property
  def config(self) -> dict:
    """The recipe as `experiments.run`'s `lowprec` keys."""
    if self.fmt is None:
      return {}
    out = {"writeback": self.fmt, "rounding": self.rounding}
    if self.compensation != "none":
      out["compensation"] = self.compensation
    if self.compensation == "kahan":
      out["buffer"] = self.buffer
    if self.compensation == "split":
      out["correction_bits"] = self.correction_bits
    return out

  def apply(self, inner, key: jax.Array | None = None):
    """`inner` (the optimizer, or its state store) followed by the
    write-back; for ECO, `inner` inside it. `key` feeds stochastic
    rounding (required for it)."""
    key = key if self.rounding == "stochastic" else None
    f, r, c = self.fmt, self.rounding, self.compensation
    if f is None:
      return inner
    if c == "eco":
      return eco(inner, f, r, key=key)
    write = {
      "none": lambda: writeback(f, r, key=key),
      "kahan": lambda: kahan_writeback(f, r, buffer=self.buffer, key=key),
      "split": lambda: split_writeback(f, correction_bits=self.correction_bits),
      "remainder": lambda: remainder_writeback(f),
    }[c]()
    return optax.chain(inner, write)

  def code(self, inner: str, key: str) -> str:
    """`apply` as Python source, `inner` and `key` being expressions."""
    f, r = repr(self.fmt), repr(self.rounding)
    k = f", key={key}" if self.rounding == "stochastic" else ""
    c = self.compensation
    if self.fmt is None:
      return inner
    if c == "eco":
      return f"lowprec.eco({inner}, {f}, {r}{k})"
    write = {
      "none": f"lowprec.writeback({f}, {r}{k})",
      "kahan": f"lowprec.kahan_writeback({f}, {r}, buffer={self.buffer!r}{k})",
      "split": f"lowprec.split_writeback({f}, correction_bits="
      f"{self.correction_bits})",
      "remainder": f"lowprec.remainder_writeback({f})",
    }[c]
    return f"optax.chain({inner}, {write})"


_SHAPE = (4096,)  # a leaf whose size every block divides


def _element_bytes(spec: str) -> float:
  codec = parse_state_format(spec).codec()
  return codec.nbytes(_SHAPE) / math.prod(_SHAPE)


@dataclasses.dataclass(frozen=True)
class State:
  """How AdamW's two moments are stored: `(moment, spec)` rules for
  `lowprec.store_state` (none: float32)."""

  name: str
  rules: tuple[tuple[str, str], ...] = ()

  @property
  def bytes(self) -> float:
    """Bytes per parameter of `mu` and `nu` together (codes and scales)."""
    specs = dict(self.rules)
    return sum(
      _element_bytes(specs[m]) if m in specs else 4.0 for m in ("mu", "nu")
    )

  @property
  def config(self) -> tuple[str, ...]:
    """The rules as `lowprec.state` entries ("mu=bfloat16:stochastic")."""
    return tuple(f"{m}={s}" for m, s in self.rules)

  def apply(self, inner, key: jax.Array | None = None):
    """`inner` with its state stored by the rules; without rules, run on
    float32 views (`lowprec.in_float32`), so that the moments stay float32
    next to bfloat16-typed weights (optax would make them bfloat16)."""
    if not self.rules:
      return in_float32(inner)
    return store_state(inner, dict(self.rules), key=key)

  def code(self, inner: str, key: str) -> str:
    if not self.rules:
      return f"lowprec.in_float32({inner})"
    return f"lowprec.store_state({inner}, {dict(self.rules)!r}, key={key})"


def _weights(*recipes) -> dict[str, Weights]:
  return {r.name: r for r in recipes}


# Cheapest first within each grid; `lowprec.freeze.advise` ranks by bytes.
WEIGHTS = _weights(
  Weights("float32", None),
  Weights("bf16_remainder", "bfloat16", compensation="remainder"),
  Weights("bf16_kahan", "bfloat16", compensation="kahan"),
  Weights("bf16_split8", "bfloat16", compensation="split"),
  Weights(
    "bf16_kahan_e5m2", "bfloat16", compensation="kahan", buffer="float8_e5m2"
  ),
  Weights("bf16_eco", "bfloat16", compensation="eco"),
  Weights("bf16_sr", "bfloat16", "stochastic"),
  Weights("bf16_rn", "bfloat16"),
  Weights(
    "fp8_kahan_e5m2",
    "float8_e4m3fn",
    compensation="kahan",
    buffer="float8_e5m2",
  ),
  Weights("mx_eco", "mxfp8_e4m3", compensation="eco"),
  Weights("mx_sr", "mxfp8_e4m3", "stochastic"),
  Weights("fp8_eco", "float8_e4m3fn", compensation="eco"),
  Weights("fp8_sr", "float8_e4m3fn", "stochastic"),
  Weights("fp8_rn", "float8_e4m3fn"),
)

STATES = {
  s.name: s
  for s in (
    State("float32"),
    State(
      "bf16", (("mu", "bfloat16:stochastic"), ("nu", "bfloat16:stochastic"))
    ),
    State(
      "q8",
      (
        ("mu", "dynamic8:stochastic:block256"),
        ("nu", "dynamic8u:stochastic:block256"),
      ),
    ),
  )
}


def get(name: str) -> tuple[Weights, State]:
  """`"bf16_sr+q8"` (a weight recipe, optionally `+` a state recipe) as
  its two parts; the state is float32 where it is left out.

  Raises:
    ValueError: an unknown name, listing the known ones.
  """
  w, _, s = name.partition("+")
  w, s = w.strip(), (s.strip() or "float32")
  if w not in WEIGHTS:
    raise ValueError(
      f"unknown weight recipe {w!r} in {name!r}; known: {', '.join(WEIGHTS)}"
    )
  if s not in STATES:
    raise ValueError(
      f"unknown state recipe {s!r} in {name!r}; known: {', '.join(STATES)}"
    )
  return WEIGHTS[w], STATES[s]


def bytes_per_param(name: str) -> float:
  """Weights, their write-back's own state and AdamW's moments, per
  parameter, of a recipe named as `get` takes it."""
  w, s = get(name)
  return w.bytes + s.bytes


def chain(optimizer, name: str, key: jax.Array | None = None):
  """The transform of recipe `name` around `optimizer` (e.g.
  `optax.adamw(lr)`): the state store inside, the write-back outside
  (ECO: the store around ECO, as `lowprec.eco` requires).

  The state store's key is `fold_in(key, 1)`, the write-back's `key`.
  """
  w, s = get(name)
  skey = None if key is None else jax.random.fold_in(key, 1)
  if w.compensation == "eco":
    return s.apply(w.apply(optimizer, key), skey)
  return w.apply(s.apply(optimizer, skey), key)


def code(name: str, optimizer: str, key: str) -> str:
  """`chain(...)` as Python source for recipe `name`, `optimizer` and
  `key` being Python expressions."""
  w, s = get(name)
  skey = f"jax.random.fold_in({key}, 1)"
  if w.compensation == "eco":
    return s.code(w.code(optimizer, key), skey)
  return w.code(s.code(optimizer, skey), key)
