"""A LayerNorm or RMSNorm whose output is stored rounded and feeds a dense."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowprec.backward.ops import saved
from lowprec.backward.ops.base import Op, per_value
from lowprec.backward.ops.dense import _fp8_matmul, _is_fp8
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding
from lowprec.grids import choices

NORMS = ("layer", "rms")

_TABLE = (
  Requirement(
    "norm.out@dgain",
    "out",
    "original",
    True,
    ("gain",),
    "y = n * g + b is computed before rounding, so dL/dg = sum(dy * n) "
    "reads n of the original y",
  ),
  Requirement(
    "norm.out@dw",
    "out",
    "rounded",
    True,
    ("kernel",),
    "z = y~ W~ + c, so dL/dW = y~^T dz reads the y~ the next layer multiplied",
  ),
  Requirement(
    "norm.out@dx",
    "out",
    "original",
    True,
    ("x",),
    "dx = rstd (dn - mean(dn) - n mean(dn * n)) differentiates the "
    "normalisation at the original n; bilinear in n, so fresh draws one "
    "copy per factor",
  ),
  Requirement(
    "dense.kernel@dx",
    "kernel",
    "rounded",
    True,
    ("x", "gain", "shift"),
    "straight through y~ -> y, dL/dy = dz W~^T reads the W~ the forward "
    "multiplied",
  ),
)


def normalise(x, norm: str, eps: float):
  """`(n, mean, rstd)` of `x` over its last axis: LayerNorm's centred and
  scaled `n` (`mean` None for RMSNorm), in plain JAX (differentiable)."""
  if norm == "layer":
    mu = jnp.mean(x, -1, keepdims=True)
    xc = x - mu
    rstd = jax.lax.rsqrt(jnp.mean(xc * xc, -1, keepdims=True) + eps)
  else:
    mu = None
    xc = x
    rstd = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
  return xc * rstd, mu, rstd


@dataclasses.dataclass(frozen=True)
class NormDense(Op):
  """A norm whose output is stored rounded and feeds a dense layer.

  Forward (per row of the last axis):

    LayerNorm:  n = (x - mean x) * rstd,  rstd = 1 / sqrt(var x + eps)
    RMSNorm:    n = x * rstd,             rstd = 1 / sqrt(mean x^2 + eps)
    y = n * g + b (b optional),   z = y~ W~ + c (c optional),

  with `y~` rounded by `out` and `W~` by `kernel`. The backward rounds `dz`
  by `grad`, then reads `y` three times, each as the policy says: for the
  next layer's weight gradient, for the gain gradient and for the norm's
  input gradient; and the kernel once, for `dL/dy`. Where the gain and
  input gradients need `n`, a read `r` of `y` gives `n = (r - b) / g` (as a
  backward that stores only the output must), and `original` gives `n`.

  Requirements table (autodiff of the forward, roundings straight-through):

    norm.out@dgain   must read original: y = n g + b is computed before the
                     rounding, so dg = sum(dy n) with the original n. `fresh`
                     is admissible (linear in n); `rounded` is biased.
    norm.out@dw      must read rounded: the next layer multiplied y~, so
                     dW = y~^T dz. `original` and `fresh` are biased.
    norm.out@dx      must read original: the normalisation's Jacobian at n,
                     dx = rstd (dn - mean dn - n mean(dn n)). Bilinear in n:
                     `fresh` draws an independent copy for each factor, so
                     it is admissible (one copy for both would be biased by
                     Var(n)/d).
    dense.kernel@dx  must read rounded: dL/dy = dz W~^T.

  So no single copy serves both gain and weight: reading the original for
  both biases dW; reading the rounded value for both biases dg.

  Attributes:
    norm: `"layer"` or `"rms"`.
    eps: added to the variance (GPT-2 uses 1e-5).
    out: rounding of the norm output `y`.
    kernel: rounding of the dense kernel.
    grad: rounding of the incoming gradient `dz`.
    native_fp8: the forward product `y~ W~` as a float8 dot where `out`
      and `kernel` both round to a float8 format (`ops.Dense.native_fp8`
      says what that computes).

  Example:
    ```python
    op = NormDense(out="float8_e4m3fn:stochastic")
    z = op(x, gain, shift, w, c, key=key, policy=(
      ("norm.out@dw|dense.kernel@dx", "rounded"), (".*", "original")))
    ```
  """

  norm: str = "layer"
  eps: float = 1e-5
  out: Rounding | str | None = None
  kernel: Rounding | str | None = None
  grad: Rounding | str | None = None
  native_fp8: bool = False

  name = "norm_dense"
  args = ("x", "gain", "shift", "kernel", "bias")
  tensors = ("out", "kernel")
  table = _TABLE

  def __post_init__(self):
    choices.check_choice("norm", self.norm, NORMS)
    self._coerce()

  def __call__(self, x, gain, shift, kernel, bias=None, **kwargs):
    return super().__call__(x, gain, shift, kernel, bias, **kwargs)

  def _normalise(self, x):
    return normalise(x, self.norm, self.eps)

  def _forward(self, values, args, keys):
    x, gain, shift, kernel, bias = args
    n, mu, rstd = self._normalise(x)
    y = n * gain if shift is None else n * gain + shift
    if values is None:
      yr = saved.straight_through(self.out, y, keys["out"])
      wr = saved.straight_through(self.kernel, kernel, keys["kernel"])
      res = None
    else:
      reads = self.reads(values)
      # Narrow copies of y are kept as such; the original y (and fresh
      # draws of it) is recomputed from x and the row statistics.
      narrow = reads["out"] & {"rounded", "nearest"}
      yr, res_y = saved.save(self.out, y, keys["out"], narrow)
      res_y.pop("original", None)
      need_x = self.out.is_identity or bool(reads["out"] - narrow)
      res = dict(
        out=res_y,
        x=x if need_x else None,
        mu=mu,
        rstd=rstd,
        gain=gain,
        shift=shift,
      )
      wr = self._round("kernel", kernel, keys, reads, res)
    if self.native_fp8 and _is_fp8(self.out) and _is_fp8(self.kernel):
      z = _fp8_matmul(self.out, yr, y, self.kernel, wr, kernel)
    else:
      z = jnp.matmul(yr, wr)
    if bias is not None:
      z = z + bias
    return z, res

  def _read_y(self, values, use, res, bkey, draw=""):
    """`(y, n)` as `use` reads the norm output (`draw` names a fresh copy)."""
    key = None if bkey is None else saved.key_for(bkey, use + draw)
    return per_value(
      values[self.uses.index(use)], lambda v: self._read_y_as(v, res, key)
    )

  def _read_y_as(self, value, res, key):
    x, mu, gain, shift = res["x"], res["mu"], res["gain"], res["shift"]
    if value in ("original", "fresh") or self.out.is_identity:
      n = (x if mu is None else x - mu) * res["rstd"]
      y = n * gain if shift is None else n * gain + shift
      if value != "fresh" or self.out.is_identity:
        return y, n
      y = self.out.round(y, key, mode="stochastic")[0]
    else:
      y = res["out"][value].value()
    shifted = y if shift is None else y - shift
    safe = jnp.where(gain == 0, 1.0, gain)
    return y, jnp.where(gain == 0, 0.0, shifted / safe)

  def _backward(self, values, res, g):
    bkey = res["backward_key"]
    dz = self._round_grad(g, bkey, "dz")
    dz2 = dz.reshape(-1, dz.shape[-1])
    y_w, _ = self._read_y(values, "norm.out@dw", res, bkey)
    dkernel = jnp.matmul(y_w.reshape(-1, y_w.shape[-1]).T, dz2)
    wv = self._read(values, "dense.kernel@dx", res, bkey)
    dy = jnp.matmul(dz, wv.T)
    _, n_g = self._read_y(values, "norm.out@dgain", res, bkey)
    lead = tuple(range(dy.ndim - 1))
    dgain = jnp.sum(dy * n_g, lead)
    dshift = jnp.sum(dy, lead)
    _, n_x = self._read_y(values, "norm.out@dx", res, bkey)
    _, n_x2 = self._read_y(values, "norm.out@dx", res, bkey, draw="#2")
    dn = dy * res["gain"]
    proj = jnp.mean(dn * n_x2, -1, keepdims=True)
    if self.norm == "layer":
      dx = res["rstd"] * (dn - jnp.mean(dn, -1, keepdims=True) - n_x * proj)
    else:
      dx = res["rstd"] * (dn - n_x * proj)
    return dx, dgain, dshift, dkernel, dz2.sum(0)


def norm_dense(
  x, gain, shift, kernel, bias=None, *, policy=None, key=None, **config
):
  """`NormDense(**config)(x, gain, shift, kernel, bias, ...)`."""
  return NormDense(**config)(
    x, gain, shift, kernel, bias, policy=policy, key=key
  )
