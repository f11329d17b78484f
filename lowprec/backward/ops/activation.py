"""Elementwise activation whose input is stored rounded for the backward."""

from __future__ import annotations

import dataclasses
import functools

import jax

from lowprec.backward.ops.base import Op
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding
from lowprec.grids import choices

# name -> function; "gelu" is the tanh approximation GPT-2 uses.
ACTIVATIONS = {
  "gelu": functools.partial(jax.nn.gelu, approximate=True),
  "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
  "silu": jax.nn.silu,
  "relu": jax.nn.relu,
}

_TABLE = (
  Requirement(
    "act.in@dact",
    "x",
    "original",
    False,
    ("x",),
    "h = f(x) is computed from the original x (x~ is kept for the backward "
    "only), so dx = f'(x) dh; f' is nonlinear",
    storage_only=True,
  ),
)


@dataclasses.dataclass(frozen=True)
class Activation(Op):
  """`h = f(x)` computed exactly; `x` is kept rounded for the backward.

  The backward computes `dx = f'(x_r) dh` with `x_r` what `act.in@dact`
  reads. Storing `x` in a narrow format saves the memory of the widest
  activation of an MLP.

  Requirements table:

    act.in@dact  must read original: the forward evaluated f at x, so
                 dx = f'(x) dh. f' is nonlinear, so `rounded`, `fresh` and
                 `nearest` are all biased (by about f'''(x) Var/2 for an
                 unbiased draw). The forward's output does not depend on the
                 stored draw, so reusing it is, on average, the same as an
                 independent copy.

  Attributes:
    fn: a key of `ACTIVATIONS` (`gelu` is tanh-approximate, as in GPT-2).
    x: rounding of the stored input.

  Example:
    ```python
    h = Activation("gelu", x="float8_e4m3fn")(x)
    ```
  """

  fn: str = "gelu"
  x: Rounding | str | None = None

  name = "activation"
  args = ("x",)
  tensors = ("x",)
  table = _TABLE

  def __post_init__(self):
    choices.check_choice("activation", self.fn, ACTIVATIONS)
    self._coerce()

  def _forward(self, values, args, keys):
    (x,) = args
    h = ACTIVATIONS[self.fn](x)
    if values is None:
      return h, None
    res = {}
    self._round("x", x, keys, self.reads(values), res)
    return h, res

  def _backward(self, values, res, g):
    xv = self._read(values, "act.in@dact", res, res["backward_key"])
    _, pullback = jax.vjp(ACTIVATIONS[self.fn], xv)
    return pullback(g.astype(xv.dtype))


def activation(x, fn="gelu", *, policy=None, key=None, **config):
  """`Activation(fn, **config)(x, policy=policy, key=key)`."""
  return Activation(fn, **config)(x, policy=policy, key=key)
