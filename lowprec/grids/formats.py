"""Number formats: grids, gaps and native dtypes.

A format is a finite set of representable values (its grid) plus how special
values behave. Three families:

* named formats, spelled as their `ml_dtypes` / `jnp.dtype` names
  (`bfloat16`, `float16`, `float8_e4m3fn`, `float8_e5m2`, the `fnuz` variants,
  `float8_e3m4`, `float8_e4m3`, `float6_e2m3fn`, `float6_e3m2fn`,
  `float4_e2m1fn`), plus `float32`;
* generic IEEE-like `eXmY`: X exponent bits (2..8), Y explicit mantissa bits
  (0..23), bias `2**(X-1) - 1`, subnormals, inf and NaN. `e8m7` has
  bfloat16's grid, `e5m10` float16's;
* symmetric integer grids `intK` with a scale s: the values
  `s * {-(2**(K-1) - 1), ..., 2**(K-1) - 1}`, e.g. `int3` is `s * {-3..3}`.

Every grid value is exactly representable in float32, so values may be stored
in float32 (always possible) or in the native dtype where one exists.

Scaled formats (`ScaledFormat`, the registry `SCALED`, `get_scaled_format`)
put the elements of one of these grids under per-block or per-tensor
scales: MX, NVFP4 and per-tensor fp8. Their data live here, the rounding
onto them in `lowprec.scaled`; `writeback_refusal` says which of them a
write-back refuses, and why.

Example:
  >>> fmt = get_format("float8_e4m3fn")
  >>> fmt.max_finite, fmt.min_subnormal
  (448.0, 0.001953125)
  >>> float(fmt.gap_down(jnp.float32(1.0))), float(fmt.gap_up(1.0))
  (0.0625, 0.125)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from lowprec.grids import _bits, choices

# What happens at the top of the exponent range:
#   "ieee":    all-ones exponent is inf (mantissa 0) or NaN (otherwise);
#   "max_code": no inf; only the all-ones code is NaN (OCP e4m3fn);
#   "negzero": no inf, no -0; the -0 code is the only NaN (fnuz);
#   "none":    no inf, no NaN; every code is finite (OCP FP6 / FP4).
_SPECIALS = ("ieee", "max_code", "negzero", "none")


@dataclasses.dataclass(frozen=True)
class Format:
  """A number format. Hashable, so it can be a static argument under jit.

  Use `get_format` to build one from a name. Float formats have `exp_bits`,
  `man_bits` and `bias`; integer formats have `int_bits` and `scale`.
  """

  name: str
  kind: str  # "float" or "int"
  exp_bits: int = 0
  man_bits: int = 0
  bias: int = 0
  specials: str = "ieee"
  native: str | None = None  # ml_dtypes / jnp dtype name, if any
  int_bits: int = 0
  scale: float | None = None

  # ---- static facts -------------------------------------------------------

  @property
  def is_float(self) -> bool:
    return self.kind == "float"

  @property
  def bits(self) -> int:
    """Storage width in bits."""
    if self.is_float:
      return 1 + self.exp_bits + self.man_bits
    return self.int_bits

  @property
  def emin(self) -> int:
    """Exponent of the smallest normal value (float formats)."""
    return 1 - self.bias

  @property
  def emax(self) -> int:
    """Exponent of the largest finite value (float formats)."""
    top = (1 << self.exp_bits) - 1
    return top - 1 - self.bias if self.specials == "ieee" else top - self.bias

  @property
  def int_max(self) -> int:
    return (1 << (self.int_bits - 1)) - 1

  @property
  def max_finite(self) -> float:
    if not self.is_float:
      return float(np.float32(self.int_max * self.scale))
    ones = 2 if self.specials == "max_code" else 1  # e4m3fn loses one code
    frac = 2.0 - ones * 2.0**-self.man_bits if self.man_bits else 1.0
    if self.specials == "max_code" and self.man_bits == 0:
      raise ValueError(f"{self.name}: max_code needs mantissa bits")
    return float(frac * 2.0**self.emax)

  @property
  def min_normal(self) -> float:
    if not self.is_float:
      return float(self.scale)
    return float(2.0**self.emin)

  @property
  def min_subnormal(self) -> float:
    if not self.is_float:
      return float(self.scale)
    return float(2.0 ** (self.emin - self.man_bits))

  @property
  def has_inf(self) -> bool:
    return self.is_float and self.specials == "ieee"

  @property
  def has_nan(self) -> bool:
    return self.is_float and self.specials != "none"

  @property
  def has_negative_zero(self) -> bool:
    return self.is_float and self.specials != "negzero"

  @property
  def native_dtype(self) -> np.dtype | None:
    """The dtype that stores this grid natively, or None (float32 storage)."""
    if self.native is None:
      return None
    return np.dtype(getattr(ml_dtypes, self.native, self.native))

  def __str__(self) -> str:
    return self.name

  # ---- grid arithmetic on arrays (jit-able) -------------------------------

  def gap_up(self, w) -> jax.Array:
    """Distance from grid value `w` to its neighbour above (inf at the top)."""
    return _signed_gap(self, w, up=True)

  def gap_down(self, w) -> jax.Array:
    """Distance from grid value `w` to its neighbour below (inf at -max)."""
    return _signed_gap(self, w, up=False)

  def ulp(self, w) -> jax.Array:
    """`gap_up(|w|)`: the spacing of the grid just above |w|."""
    return self.gap_up(jnp.abs(jnp.asarray(w)))

  def next_up(self, w) -> jax.Array:
    """The grid value above grid value `w` (inf above the largest finite)."""
    return _signed_next(self, w, up=True)

  def next_down(self, w) -> jax.Array:
    """The grid value below grid value `w` (-inf below the most negative)."""
    return _signed_next(self, w, up=False)

  def is_on_grid(self, x) -> jax.Array:
    """Whether each element of `x` is a value of this format.

    Zero of either sign is on every grid; inf only where the format has inf;
    NaN never.
    """
    x, lay = _bits.carrier(x)
    if not self.is_float:
      # Grid values are float32(k * scale); x / scale need not give k back
      # exactly when the scale is not a power of two.
      k = jnp.round(x / jnp.float32(self.scale))
      return (jnp.abs(k) <= self.int_max) & (k * jnp.float32(self.scale) == x)
    a = _bits.to_bits(x, lay) & _bits.u(lay.sign_mask - 1, lay)
    finite = a <= _bits.u(lay.bits_of(self.max_finite), lay)
    on = finite & (_bits.bracket(a, self, lay).frac == 0)
    if self.has_inf:
      on = on | (a == _bits.u(lay.inf_bits, lay))
    return on

  def values(self) -> np.ndarray:
    """All finite nonnegative grid values, ascending (float64, numpy).

    Enumerated from the definition, for tests and small tables; refuses
    formats with more than `2**20` nonnegative values.
    """
    if not self.is_float:
      return np.arange(self.int_max + 1) * float(self.scale)
    if self.exp_bits + self.man_bits > 20:
      raise ValueError(f"{self.name} has too many values to enumerate")
    m = self.man_bits
    sub = np.arange(1 << m) * 2.0 ** (self.emin - m)
    e = np.arange(self.emin, self.emax + 1)[:, None]
    normal = ((1 << m) + np.arange(1 << m))[None, :] * 2.0 ** (e - m)
    vals = np.concatenate([sub, normal.ravel()])
    return vals[vals <= self.max_finite]


def _gap_abs(fmt: Format, a, lay, up: bool):
  """Gap above (or below) the nonnegative grid value with bits `a`."""
  e = _bits.exponent(a, lay)
  if not up:
    mant_zero = (a & _bits.u((1 << lay.man) - 1, lay)) == 0
    e = e - (mant_zero & (a != 0)).astype(jnp.int32)
  g = _bits.from_bits(
    _bits.pow2_bits(jnp.maximum(e, fmt.emin) - fmt.man_bits, lay), lay
  )
  return g


def _signed_gap(fmt: Format, w, up: bool):
  w, lay = _bits.carrier(w)
  if not fmt.is_float:
    g = jnp.full_like(w, fmt.scale)
    top = w >= fmt.max_finite if up else w <= -fmt.max_finite
    return jnp.where(top, jnp.inf, g).astype(w.dtype)
  b = _bits.to_bits(w, lay)
  a = b & _bits.u(lay.sign_mask - 1, lay)
  neg = b >= _bits.u(lay.sign_mask, lay)
  # Above a negative value lies the gap below its magnitude, and vice versa.
  toward_zero = neg if up else ~neg
  g = jnp.where(
    toward_zero, _gap_abs(fmt, a, lay, up=False), _gap_abs(fmt, a, lay, True)
  )
  at_edge = (~toward_zero) & (a >= _bits.u(lay.bits_of(fmt.max_finite), lay))
  return jnp.where(at_edge, jnp.inf, g).astype(w.dtype)


def _next_abs(fmt: Format, a, lay, up: bool):
  """Bits of the neighbour above (below) nonnegative grid value bits `a`."""
  step = _bits.u(1 << (lay.man - fmt.man_bits), lay)
  if fmt.emin == lay.emin:
    # One bit step walks the whole grid, subnormals included.
    return a + step if up else a - step
  x = _bits.from_bits(a, lay)
  g = _gap_abs(fmt, a, lay, up)
  # Normal-range float arithmetic only: the smallest gap is >= 2**-85 here.
  return _bits.to_bits(x + g if up else x - g, lay)


def _signed_next(fmt: Format, w, up: bool):
  w, lay = _bits.carrier(w)
  if not fmt.is_float:
    s = jnp.asarray(fmt.scale, w.dtype)
    out = w + s if up else w - s
    lim = fmt.max_finite
    return jnp.where(
      jnp.abs(out) > lim * (1 + 1e-6), jnp.sign(out) * jnp.inf, out
    )
  b = _bits.to_bits(w, lay)
  sign = b & _bits.u(lay.sign_mask, lay)
  a = b & _bits.u(lay.sign_mask - 1, lay)
  neg = sign != 0
  away = neg != up  # moving away from zero in magnitude
  at_zero = a == 0
  far = _next_abs(fmt, a, lay, up=True)
  near = _next_abs(fmt, jnp.where(at_zero, _bits.u(1, lay), a), lay, up=False)
  mag = jnp.where(away, far, near)
  # From zero the step goes to the smallest subnormal of the moving sign.
  min_sub = _bits.u(lay.bits_of(fmt.min_subnormal), lay)
  new_sign = jnp.where(at_zero, _bits.u(0 if up else lay.sign_mask, lay), sign)
  mag = jnp.where(at_zero, min_sub, mag)
  over = mag > _bits.u(lay.bits_of(fmt.max_finite), lay)
  mag = jnp.where(over, _bits.u(lay.inf_bits, lay), mag)
  return _bits.from_bits(mag | new_sign, lay)


# ---- registry and parsing --------------------------------------------------


def _named(name, e, m, bias, specials, native=None) -> Format:
  return Format(name, "float", e, m, bias, specials, native or name)


NAMED: dict[str, Format] = {
  f.name: f
  for f in (
    _named("float32", 8, 23, 127, "ieee"),
    _named("bfloat16", 8, 7, 127, "ieee"),
    _named("float16", 5, 10, 15, "ieee"),
    _named("float8_e4m3fn", 4, 3, 7, "max_code"),
    _named("float8_e5m2", 5, 2, 15, "ieee"),
    _named("float8_e4m3fnuz", 4, 3, 8, "negzero"),
    _named("float8_e5m2fnuz", 5, 2, 16, "negzero"),
    _named("float8_e4m3b11fnuz", 4, 3, 11, "negzero"),
    _named("float8_e3m4", 3, 4, 3, "ieee"),
    _named("float8_e4m3", 4, 3, 7, "ieee"),
    _named("float6_e2m3fn", 2, 3, 1, "none"),
    _named("float6_e3m2fn", 3, 2, 3, "none"),
    _named("float4_e2m1fn", 2, 1, 1, "none"),
  )
}

_GENERIC = re.compile(r"^e(\d+)m(\d+)$")
_INT = re.compile(r"^int(\d+)$")


def ieee_format(exp_bits: int, man_bits: int) -> Format:
  """The generic IEEE-like format `eXmY` (subnormals, inf and NaN)."""
  if not 2 <= exp_bits <= 8 or not 0 <= man_bits <= 23:
    raise ValueError(
      f"e{exp_bits}m{man_bits}: eXmY needs X in 2..8 and Y in 0..23 so that "
      "every value fits in float32"
    )
  bias = (1 << (exp_bits - 1)) - 1
  return Format(f"e{exp_bits}m{man_bits}", "float", exp_bits, man_bits, bias)


def int_format(bits: int, scale: float) -> Format:
  """The symmetric integer grid `scale * {-K', ..., K'}`,
  `K' = 2**(bits-1) - 1`."""
  if not 2 <= bits <= 8:
    raise ValueError(f"int{bits}: intK needs K in 2..8")
  if scale is None or not np.isfinite(scale) or scale <= 0:
    raise ValueError(
      f"int{bits} needs a positive finite scale, e.g. "
      f"get_format('int{bits}', scale=0.0625)"
    )
  return Format(f"int{bits}", "int", int_bits=bits, scale=float(scale))


def format_names() -> list[str]:
  """Named formats plus the generic spellings."""
  return [*NAMED, "eXmY (X in 2..8, Y in 0..23)", "intK (K in 2..8, scale=)"]


def get_format(
  fmt: str | Format,
  *,
  scale: float | None = None,
  also_valid: Iterable[str] = (),
) -> Format:
  """Returns the `Format` for a name (or passes a `Format` through).

  Args:
    fmt: a named format (`"float8_e4m3fn"`), `"eXmY"`, `"intK"`, a numpy /
      ml_dtypes dtype, or a `Format`.
    scale: the grid step of an `intK` format (required there, refused
      elsewhere).
    also_valid: other names the caller takes where it asks for this
      format (e.g. the MX names of `SCALED`, which are not grids): an
      unknown name's error suggests and lists them too.

  Raises:
    ValueError: unknown name (the message lists the valid ones and
      suggests the closest, `also_valid` included), `intK` without a
      scale, or a scale given to a float format.
  """
  if isinstance(fmt, Format):
    return fmt
  if isinstance(fmt, np.dtype) or isinstance(fmt, type):
    fmt = np.dtype(fmt).name
  if not isinstance(fmt, str):
    raise TypeError(f"expected a format name or Format, got {fmt!r}")
  name = fmt.strip()
  if m := _INT.match(name):
    return int_format(int(m.group(1)), scale)
  if scale is not None:
    raise ValueError(f"scale= applies to intK formats only, not {name!r}")
  if name in NAMED:
    return NAMED[name]
  if m := _GENERIC.match(name):
    return ieee_format(int(m.group(1)), int(m.group(2)))
  if name in SCALED:
    raise ValueError(
      f"{name!r} is a scaled format (elements under per-block or per-tensor "
      "scales), not a grid: use it where scaled formats are taken "
      "(lowprec.scaled.quantize / fake_quantize, lowprec.ops.Rounding, "
      "lowprec.writeback), or name its element format here, e.g. "
      f"{SCALED[name].element.name!r}"
    )
  also = [n for n in also_valid if n not in NAMED]
  also_text = f"; also valid here: {', '.join(also)}" if also else ""
  raise ValueError(
    f"unknown format {name!r}.{choices.suggest(name, [*NAMED, *also])} Valid "
    f"formats: {', '.join(format_names())}{also_text}"
  )


# ---- scaled formats --------------------------------------------------------
# Element grids under per-block or per-tensor scales: the formats' data.
# Computing the scales and rounding onto them is `lowprec.scaled`.

SCALE_RULES = ("ocp", "noclip")  # the power-of-two (E8M0) rules
_TENSOR = ("float8_e4m3fn", "float8_e5m2")  # the elements of "<fp8>:tensor"


@dataclasses.dataclass(frozen=True)
class ScaledFormat:
  """A scaled format: element format, block, scale type and scale rule.

  Hashable, so it can be a static argument under jit. Build one with
  `get_scaled_format`.

  Attributes:
    name: the base name, e.g. `"mxfp8_e4m3"`, `"nvfp4"`,
      `"float8_e4m3fn:tensor"`.
    element: the element `Format`.
    block: elements per block, or None for one scale per tensor.
    scale_type: `"e8m0"` (power of two), `"e4m3"` (NVFP4's block scale,
      times a float32 tensor scale) or `"float32"`.
    rule: `"ocp"`, `"noclip"`, `"nvfp4"` or `"amax"` (the rules are
      defined in `lowprec.scaled`).
    axis: the axis cut into blocks (default the last).
  """

  name: str
  element: Format
  block: int | None
  scale_type: str
  rule: str
  axis: int = -1

  def __str__(self) -> str:
    return self.name

  @property
  def max_finite(self) -> float:
    """The element format's largest value."""
    return self.element.max_finite

  # What lowprec.storage asks of a format: a scaled grid has no dtype of
  # its own (its values are elements times scales) and no inf.
  native_dtype = None
  has_inf = False

  @property
  def element_dtype(self) -> np.dtype:
    """How `quantize` stores elements: the native dtype of one-byte
    elements, float32 (holding grid values) for FP6 and FP4, whose
    conversions XLA does not support on every backend."""
    native = self.element.native_dtype
    if native is not None and self.element.bits == 8:
      return native
    return np.dtype(np.float32)


def _mx(name, element) -> ScaledFormat:
  return ScaledFormat(name, NAMED[element], 32, "e8m0", "ocp")


SCALED: dict[str, ScaledFormat] = {
  f.name: f
  for f in (
    _mx("mxfp8_e4m3", "float8_e4m3fn"),
    _mx("mxfp8_e5m2", "float8_e5m2"),
    _mx("mxfp6_e3m2", "float6_e3m2fn"),
    _mx("mxfp6_e2m3", "float6_e2m3fn"),
    _mx("mxfp4_e2m1", "float4_e2m1fn"),
    ScaledFormat("nvfp4", NAMED["float4_e2m1fn"], 16, "e4m3", "nvfp4"),
    *(
      ScaledFormat(f"{e}:tensor", NAMED[e], None, "float32", "amax")
      for e in _TENSOR
    ),
  )
}


def is_scaled(fmt) -> bool:
  """Whether `fmt` is a `ScaledFormat` or the name of one."""
  if isinstance(fmt, ScaledFormat):
    return True
  return isinstance(fmt, str) and fmt.strip() in SCALED


def get_scaled_format(
  fmt: str | ScaledFormat,
  *,
  rule: str | None = None,
  block: int | None = None,
  axis: int | None = None,
) -> ScaledFormat:
  """Returns the `ScaledFormat` for a name, with optional changes.

  Args:
    fmt: a name from `SCALED` (`"mxfp8_e4m3"`, `"nvfp4"`,
      `"float8_e4m3fn:tensor"`, ...) or a `ScaledFormat`.
    rule: for MX formats, `"ocp"` (default) or `"noclip"`.
    block: elements per block (MX default 32, NVFP4 16); a block size
      other than the standard one leaves the OCP / NVFP4 definition but
      keeps its rule. Not for per-tensor formats.
    axis: the axis cut into blocks (default -1).

  Raises:
    ValueError: an unknown name (the message lists the valid ones and
      points an unscaled name to `get_format`), a rule the format does not
      have, or a block size that is not a positive integer.
  """
  if not isinstance(fmt, ScaledFormat):
    if not isinstance(fmt, str):
      raise TypeError(f"expected a scaled format name, got {fmt!r}")
    name = fmt.strip()
    if name not in SCALED:
      hint = (
        f" {name!r} is an unscaled format: use lowprec.get_format, or "
        f"scale it per tensor as '{name}:tensor' (fp8) or per block as an "
        "MX name."
        if name in NAMED
        else choices.suggest(name, SCALED)
      )
      raise ValueError(
        f"unknown scaled format {name!r}.{hint} Valid scaled formats: "
        + ", ".join(SCALED)
      )
    fmt = SCALED[name]
  changes = {}
  if rule is not None:
    valid = SCALE_RULES if fmt.scale_type == "e8m0" else (fmt.rule,)
    choices.check_choice(f"scale rule for {fmt.name}", rule, valid)
    changes["rule"] = rule
  if block is not None:
    if fmt.block is None:
      raise ValueError(
        f"{fmt.name} has one scale per tensor and no block size; for "
        "blocks use an MX format, e.g. get_scaled_format('mxfp8_e4m3', "
        f"block={block})"
      )
    ok = isinstance(block, int | np.integer) and not isinstance(block, bool)
    if not ok or block < 1:
      raise ValueError(f"block must be a positive integer, got {block!r}")
    changes["block"] = int(block)
  if axis is not None:
    changes["axis"] = int(axis)
  return dataclasses.replace(fmt, **changes) if changes else fmt


# ---- which scaled formats a write-back takes -------------------------------

# Why a scaled format with float32 (not power-of-two) scales takes no
# write-back, and what to use instead, by scale rule.
_WRITEBACK_REFUSALS = {
  "nvfp4": (
    "Its scale s_b * s_t is a float32 product recomputed from the "
    "tensor's amax, and the grid is not a fixed point of its own "
    "rounding: rounding a tensor already on it recomputes s_t from the "
    "rounded amax and moves most values by a float32 rounding, so no "
    "parameter stays on the grid of its own scales (there is no "
    "state-free grid to write back onto), a step that moves the tensor "
    "amax moves every value (w' == w, 'erased', loses its meaning), and "
    "the float32 delta between two products e * s need not land exactly. "
    "Use 'mxfp4_e2m1' (the same E2M1 elements under power-of-two E8M0 "
    "scales), or lowprec.get_scaled_format('mxfp4_e2m1', block=16) for "
    "NVFP4's block size (docs/scaled.md)"
  ),
  "amax": (
    "Its one float32 scale amax / max_E follows the tensor's largest "
    "|w|, so a step that moves that value moves every value of the "
    "tensor by a float32 rounding (w' == w, 'erased', loses its "
    "meaning), and the float32 delta between two products e * s of a "
    "scale that is not a power of two need not land exactly. Use the "
    "element format itself (e.g. 'float8_e4m3fn', scale 1) or an MX "
    "format with power-of-two block scales (e.g. 'mxfp8_e4m3') "
    "(docs/scaled.md)"
  ),
}


def writeback_refusal(fmt) -> str | None:
  """Why a write-back refuses the scaled format `fmt`, and what to use.

  A write-back (`lowprec.writeback` and the predictions of it) takes every
  unscaled format and the scaled formats with power-of-two (E8M0) block
  scales, the MX formats; it refuses those whose scales are float32
  products (`nvfp4`, `<fp8>:tensor`).

  Args:
    fmt: a format or scaled format, or the name of one.

  Returns:
    None where a write-back takes `fmt`; else the reason, ending with the
      format to use instead.

  Example:
    >>> writeback_refusal("mxfp8_e4m3") is None
    True
    >>> writeback_refusal("nvfp4").startswith("Its scale s_b * s_t")
    True
  """
  if not is_scaled(fmt):
    return None
  fmt = get_scaled_format(fmt)
  if fmt.scale_type == "e8m0":
    return None
  return _WRITEBACK_REFUSALS[fmt.rule]


def check_writeback_format(fmt, where: str) -> None:
  """Raises where a write-back refuses `fmt` (see `writeback_refusal`).

  Args:
    fmt: a format or scaled format, or the name of one.
    where: what asks, the start of the message (e.g. "parameter 'w'").

  Raises:
    ValueError: `"{where}: write-back onto {fmt} is not supported.
      {reason}"` for a scaled format with float32 scales.
  """
  reason = writeback_refusal(fmt)
  if reason is not None:
    name = get_scaled_format(fmt).name
    raise ValueError(
      f"{where}: write-back onto {name} is not supported. {reason}"
    )
