"""Dense layer with rounded input and kernel: `y = x~ W~ + b`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lowprec.backward.ops.base import Op
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding

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
    y = jnp.matmul(xr, wr)
    if bias is not None:
      y = y + bias
    return y, res

  def _backward(self, values, res, g):
    bkey = res["backward_key"]
    g = self._round_grad(g, bkey, "dy")
    xv = self._read(values, "dense.in@dw", res, bkey)
    wv = self._read(values, "dense.kernel@dx", res, bkey)
    g2 = g.reshape(-1, g.shape[-1])
    dw = jnp.matmul(xv.reshape(-1, xv.shape[-1]).T, g2)
    dx = jnp.matmul(g, wv.T)
    return dx, dw, g2.sum(0)


def dense(x, kernel, bias=None, *, policy=None, key=None, **rounding):
  """`Dense(**rounding)(x, kernel, bias, policy=policy, key=key)`."""
  return Dense(**rounding)(x, kernel, bias, policy=policy, key=key)
