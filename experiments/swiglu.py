"""A SwiGLU MLP as an operator of your own (`lowprec.ops.Custom`).

`y = (silu(x W_gate) * (x W_up)) W_down` with the gate's activation output
`a = silu(g)` saved in float8 (stochastic, per-tensor scale): the down
projection multiplies the rounded `a~` (`swiglu.act@dw_down`), and silu's
derivative is written through the stored output, `silu'(g) = sigmoid(g) +
a (1 - sigmoid(g))`, as a backward that keeps only the activation's output
computes it (`swiglu.act@dact`). The tests derive and verify its table;
the benchmark times it against the same arithmetic written by hand.
"""

from __future__ import annotations

import jax

from lowprec import ops

SR8 = ops.Rounding("float8_e4m3fn", "stochastic")
USES = ("swiglu.act@dact", "swiglu.act@dw_down")
# What `audit.derive` finds (tests/user_ops_test.py derives and checks it).
TABLE = (("swiglu.act@dact", "original"), ("swiglu.act@dw_down", "rounded"))


@jax.custom_jvp
def silu_through_output(g, a, a_d):
  """Value `a` (= silu(g)); its derivative in `g` read through `a_d`."""
  return a


@silu_through_output.defjvp
def _silu_jvp(primals, tangents):
  g, a, a_d = primals
  s = jax.nn.sigmoid(g)
  return a, (s + a_d * (1 - s)) * tangents[0]


def forward(x, w_gate, w_up, w_down, read):
  """The operator's forward: each read of the activation through `read`."""
  g = x @ w_gate
  a = jax.nn.silu(g)  # the saved tensor swiglu.act
  act = silu_through_output(
    g, read("swiglu.act@dw_down", a), read.stored("swiglu.act@dact", a)
  )
  return (act * (x @ w_up)) @ w_down


def plain(x, w_gate, w_up, w_down):
  """The same function with no rounding (an oracle for gradients)."""
  return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def operator(rounding=SR8) -> ops.Custom:
  """The operator, its activation saved with `rounding`, no table yet."""
  return ops.Custom(
    "swiglu",
    forward,
    args=("x", "w_gate", "w_up", "w_down"),
    saved={"swiglu.act": rounding},
    uses=USES,
  )


def declared(rounding=SR8) -> ops.Custom:
  """The operator carrying `TABLE` (as `audit.derive` would give it)."""
  return operator(rounding).with_table(
    ops.Requirement(use, "swiglu.act", value, True, (), "")
    for use, value in TABLE
  )
