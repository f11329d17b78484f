"""Dense layer with rounded input and kernel: `y = x~ W~ + b`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.backward.ops.base import Op
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding
from lowprec.grids import rounding as rounding_lib

_TABLE = (
  Requirement(
    "dense.in@dw",
    "x",
    "rounded",
    True,
    ("kernel",),
    "y = x~ W~ + b, so dL/dW = x~^T dy reads the x~ the forward multiplied",
  ),
  Requirement(
    "dense.kernel@dx",
    "kernel",
    "rounded",
    True,
    ("x",),
    "straight through x~ -> x, dL/dx = dy W~^T reads the W~ the forward "
    "multiplied",
  ),
)


@dataclasses.dataclass(frozen=True)
class Dense(Op):
  """`y = x~ W~ + b` over the last axis of `x`; the backward reads per use.

  Forward: `x~` and `W~` are `x` and `W` rounded by `x` and `kernel` (format,
  nearest or stochastic, per-tensor scale); the product and the bias add are
  float32. Backward: the incoming gradient `dy` is rounded by `grad` (the
  emulated FP8 backward, e.g. `Rounding("float8_e5m2", "stochastic")`), then

    dW = x_r^T dy,   db = sum(dy),   dx = dy W_r^T,

  with `x_r` the value `dense.in@dw` reads and `W_r` the value
  `dense.kernel@dx` reads.

  Requirements table (from autodiff of the forward with every rounding
  straight-through):

    dense.in@dw      must read rounded: dL/dW = x~^T dy, the operand the
                     forward multiplied. `original` and `fresh` are biased.
    dense.kernel@dx  must read rounded: dL/dx = dy W~^T.

  Attributes:
    x: rounding of the input (a `Rounding` or `"format:mode"`).
    kernel: rounding of the kernel.
    grad: rounding of the incoming gradient.
    native_fp8: compute the forward product as a dot of float8 operands
      with a float32 result (`jax.lax.dot_general` with
      `preferred_element_type`), which XLA lowers to an FP8 GEMM on
      hardware that has one (Hopper, Ada, Blackwell), where `x` and
      `kernel` both round to a float8 format (e4m3 or e5m2, per-tensor
      scaled or not): `y = (q_x q_W) / (s_x s_W)` with `q` the float8
      codes and `s` the per-tensor scales. An fp8 x fp8 product is exact
      in float32, so `y` equals the emulated `x~ W~` up to float32
      accumulation order, and, with scales, the rounding of one division
      per output instead of one per operand (a few float32 ulps). Other
      roundings, and the backward's products, stay emulated.

  Example:
    ```python
    op = Dense(x="float8_e4m3fn:stochastic", kernel="float8_e4m3fn")
    y = op(x, w, b, key=jax.random.key(0))  # reference policy
    y = op(x, w, b, policy="dense.in@dw=fresh,dense.kernel@dx=rounded",
           key=jax.random.key(0))
    ```
  """

  x: Rounding | str | None = None
  kernel: Rounding | str | None = None
  grad: Rounding | str | None = None
  native_fp8: bool = False

  name = "dense"
  args = ("x", "kernel", "bias")
  tensors = ("x", "kernel")
  table = _TABLE

  def __post_init__(self):
    self._coerce()

  def __call__(self, x, kernel, bias=None, **kwargs):
    return super().__call__(x, kernel, bias, **kwargs)

  def _forward(self, values, args, keys):
    x, kernel, bias = args
    reads = None if values is None else self.reads(values)
    res = {}
    xr = self._round("x", x, keys, reads, res)
    wr = self._round("kernel", kernel, keys, reads, res)
    # ScaledDense shares this forward; its block-scaled operands have no
    # native float8 switch.
    if getattr(self, "uses_native_fp8", False):
      y = _fp8_matmul(
        self.rounding("x"), xr, x, self.rounding("kernel"), wr, kernel
      )
    else:
      y = jnp.matmul(xr, wr)
    if bias is not None:
      y = y + bias
    return y, res

  @property
  def uses_native_fp8(self) -> bool:
    """Whether the forward product runs as a float8 dot (`native_fp8`
    and both operands rounded to a float8 format)."""
    return self.native_fp8 and all(
      _is_fp8(self.rounding(t)) for t in ("x", "kernel")
    )

  def _backward(self, values, res, g):
    bkey = res["backward_key"]
    g = self._round_grad(g, bkey, "dy")
    xv = self._read(values, "dense.in@dw", res, bkey)
    wv = self._read(values, "dense.kernel@dx", res, bkey)
    g2 = g.reshape(-1, g.shape[-1])
    dw = jnp.matmul(xv.reshape(-1, xv.shape[-1]).T, g2)
    dx = jnp.matmul(g, wv.T)
    return dx, dw, g2.sum(0)


def _is_fp8(r: Rounding) -> bool:
  native = None if r.is_scaled_format else r.format.native_dtype
  return (
    native is not None
    and np.dtype(native).itemsize == 1
    and (r.format.bits == 8)
  )


def _codes(r: Rounding, value, raw):
  """`(float8 codes, scale or None)` of a value `r` rounded: the codes are
  the grid values of `value * s`, given back exactly by nearest rounding
  (`Rounding.round` makes `value` as `q / s`)."""
  s = r.scale(raw)
  q = value.astype(jnp.float32) if s is None else value.astype(jnp.float32) * s
  native = r.format.native_dtype
  return rounding_lib.round_nearest(q, r.format, dtype=native), s


def _fp8_matmul(rx, xr, x, rw, wr, w):
  """`xr @ wr` as a float8 dot with a float32 result, then the scales."""
  qx, sx = _codes(rx, xr, x)
  qw, sw = _codes(rw, wr, w)
  y = jax.lax.dot_general(
    qx,
    qw,
    (((qx.ndim - 1,), (0,)), ((), ())),
    preferred_element_type=jnp.float32,
  )
  scale = None
  for s in (sx, sw):
    if s is not None:
      scale = s if scale is None else scale * s
  return y if scale is None else y / scale


def dense(x, kernel, bias=None, *, policy=None, key=None, **rounding):
  """`Dense(**rounding)(x, kernel, bias, policy=policy, key=key)`."""
  return Dense(**rounding)(x, kernel, bias, policy=policy, key=key)
