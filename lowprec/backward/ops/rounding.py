"""How an operator rounds one tensor: format, mode and per-tensor scale.

`Rounding` is what a saved tensor, a kernel or an incoming gradient of a
`lowprec.ops` operator is configured with; `Stored` is the narrow form the
backward keeps. How saved tensors are kept and read per use is in
`lowprec.ops.saved`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.grids import choices
from lowprec.grids import rounding as rounding_lib
from lowprec.grids import scaled as scaled_lib
from lowprec.grids.formats import Format, get_format

MODES = ("nearest", "stochastic")

# Formats whose native dtype XLA converts to on every backend; others (FP6,
# FP4) are stored as float32 holding grid values.
_STORE_NATIVE_BITS = (8, 16)


@dataclasses.dataclass(frozen=True)
class Rounding:
  """How the forward rounds one tensor.

  With per-tensor scaling the tensor is rounded as `Q(x * s) / s` with
  `s = max_finite / amax(x)`, so its largest magnitude lands on the format's
  largest value; `s = 1` when `amax` is zero, not finite, or so small that `s`
  would overflow float32.

  A scaled format (`lowprec.scaled`: `"mxfp8_e4m3"`, `"nvfp4"`,
  `"float8_e4m3fn:tensor"`, or a `ScaledFormat`) rounds with its own
  block or tensor scales instead: the value is
  `lowprec.scaled.fake_quantize(x, format, mode, key)`, blocks along the
  last axis (whose length must be a multiple of the block size), and the
  backward keeps the elements and scales (`ScaledStored`).

  Attributes:
    format: a format name, `Format` or scaled format; `"float32"` means no
      rounding at all.
    mode: `"nearest"` (ties to even) or `"stochastic"` (unbiased).
    scaled: per-tensor scaling; default on for float formats of 8 bits or
      fewer, off otherwise; always on (the format's own) for scaled
      formats.

  Example:
    >>> Rounding("float8_e4m3fn", "stochastic")
    Rounding('float8_e4m3fn:stochastic')
    >>> Rounding.parse("float8_e5m2:stochastic").scaled
    True
    >>> Rounding.parse("float8_e4m3fn:tensor:stochastic")
    Rounding('float8_e4m3fn:tensor:stochastic')
  """

  format: Format | str = "float32"
  mode: str = "nearest"
  scaled: bool | None = None

  def __post_init__(self):
    choices.check_choice("rounding mode", self.mode, MODES)
    if scaled_lib.is_scaled(self.format):
      fmt = scaled_lib.get_scaled_format(self.format)
      object.__setattr__(self, "format", fmt)
      if self.scaled is False:
        raise ValueError(
          f"{fmt.name} is a scaled format and always uses its own scales; "
          f"for no scaling name its element format, "
          f"Rounding({fmt.element.name!r}, scaled=False)"
        )
      object.__setattr__(self, "scaled", True)
      return
    # An unknown name's error lists the scaled formats a rounding takes too.
    fmt = get_format(self.format, also_valid=scaled_lib.SCALED)
    object.__setattr__(self, "format", fmt)
    if self.scaled is None:
      object.__setattr__(self, "scaled", fmt.is_float and fmt.bits <= 8)

  @classmethod
  def parse(cls, spec: Rounding | str | None) -> Rounding:
    """A `Rounding` from itself, `None` (no rounding), a format object
    (rounded to nearest) or `"format[:mode]"`."""
    if spec is None:
      return cls()
    if isinstance(spec, Rounding):
      return spec
    if isinstance(spec, Format | scaled_lib.ScaledFormat):
      return cls(spec)
    if isinstance(spec, str):
      fmt, _, mode = spec.rpartition(":")
      if mode in MODES:
        return cls(fmt, mode)
      if not fmt or scaled_lib.is_scaled(spec):
        return cls(spec)
      return cls(fmt, mode)  # an unknown mode: the error lists them
    raise TypeError(f"expected a Rounding or 'format:mode', got {spec!r}")

  @property
  def is_identity(self) -> bool:
    return self.format.name == "float32"

  @property
  def stochastic(self) -> bool:
    return not self.is_identity and self.mode == "stochastic"

  @property
  def is_scaled_format(self) -> bool:
    return isinstance(self.format, scaled_lib.ScaledFormat)

  @property
  def saturates(self) -> bool:
    """Whether the rounding can clip a block's largest magnitudes: a scaled
    format whose scale rule lets them exceed the element format's top (the
    OCP floor rule; NVFP4's block scale rounded to nearest in E4M3, which
    rounds down about half the time). Stochastic rounding then is not
    unbiased: the clipped elements are pulled toward zero. Rounded-up
    (`noclip`) and per-tensor scales never clip."""
    return self.is_scaled_format and self.format.rule in ("ocp", "nvfp4")

  def __repr__(self) -> str:
    if self.is_identity:
      return "Rounding('float32')"
    if self.is_scaled_format:
      return f"Rounding('{self.format.name}:{self.mode}')"
    extra = "" if self.scaled == (self.format.bits <= 8) else ", unscaled"
    return f"Rounding('{self.format.name}:{self.mode}'{extra})"

  def scale(self, x) -> jax.Array | None:
    """The per-tensor scale of `x` (float32 scalar), or None if unscaled."""
    if not self.scaled or self.is_scaled_format:
      return None
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    tiny = np.float32(self.format.max_finite / np.finfo(np.float32).max)
    ok = jnp.isfinite(amax) & (amax > tiny)
    top = jnp.float32(self.format.max_finite)
    return jnp.where(ok, top / jnp.where(ok, amax, 1.0), jnp.float32(1.0))

  def round(self, x, key=None, *, mode: str | None = None):
    """Rounds `x` (with its scale).

    Args:
      x: float array.
      key: PRNG key; required when rounding stochastically.
      mode: overrides `self.mode` (the backward's `fresh` and `nearest`).

    Returns:
      `(value, stored)`: the rounded tensor in `x`'s dtype, and its narrow
        form for the backward (computed only if used: converting to a float8
        dtype costs more than the rounding on CPU).
    """
    mode = mode or self.mode
    if self.is_scaled_format:
      return self._round_scaled(x, key, mode)
    s = self.scale(x)
    xs = x.astype(jnp.float32) if s is None else x.astype(jnp.float32) * s
    if mode == "stochastic":
      if key is None:
        raise ValueError(
          f"stochastic rounding to {self.format.name} needs a PRNG key"
        )
      q = rounding_lib.round_stochastic(xs, self.format, key)
    else:
      q = rounding_lib.round_nearest(xs, self.format)
    if s is None:
      value = q
    else:
      # Everything downstream reads `value`, and a division is an op XLA
      # does not duplicate into each consumer: so the rounding (random bits
      # included) runs once instead of once per consumer. `value * s` is
      # within a few float32 ulps of the grid value `q`, so converting it to
      # the format gives `q` back.
      value = q / s
      q = value * s
    native = self.format.native_dtype
    # `bits`, not the dtype's itemsize: ml_dtypes gives FP6 and FP4 one byte.
    if native is not None and self.format.bits in _STORE_NATIVE_BITS:
      # `q` is on the grid up to those few ulps, so nearest rounding gives
      # the grid value back, emitted as the native code from its bits: a
      # convert to float8 inside a fusion is slow on XLA:CPU.
      q = rounding_lib.round_nearest(q, self.format, dtype=native)
    elif s is not None:
      q = rounding_lib.round_nearest(q, self.format)  # exactly on the grid
    return value.astype(x.dtype), Stored(q, s)

  def _round_scaled(self, x, key, mode: str):
    if mode == "stochastic" and key is None:
      raise ValueError(
        f"stochastic rounding to {self.format.name} needs a PRNG key"
      )
    q = scaled_lib.quantize(x, self.format, mode, key)
    stored = ScaledStored(q, self.format)
    return stored.value().astype(x.dtype), stored

  def quantize(self, x, key=None, *, mode: str | None = None) -> Stored:
    """The narrow stored form of `round(x, key, mode=mode)`."""
    return self.round(x, key, mode=mode)[1]


class Stored(NamedTuple):
  """A rounded tensor as kept for the backward."""

  data: jax.Array  # grid values of x * scale, native dtype where one exists
  scale: jax.Array | None  # float32 scalar; None when unscaled

  def value(self) -> jax.Array:
    v = self.data.astype(jnp.float32)
    return v if self.scale is None else v / self.scale


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ScaledStored:
  """A tensor rounded onto a scaled format, as kept for the backward: the
  narrow elements and their scales (`lowprec.scaled.Quantized`)."""

  quantized: scaled_lib.Quantized
  format: scaled_lib.ScaledFormat

  def value(self) -> jax.Array:
    return scaled_lib.dequantize(self.quantized, self.format)

  def tree_flatten(self):
    return (self.quantized,), self.format

  @classmethod
  def tree_unflatten(cls, fmt, children):
    return cls(children[0], fmt)
