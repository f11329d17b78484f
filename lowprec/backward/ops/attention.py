"""Causal multi-head attention with rounded probabilities and output."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lowprec.backward.ops import saved
from lowprec.backward.ops.base import Op, per_value
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding
from lowprec.grids import choices

_TABLE = (
  Requirement(
    "attn.probs@dv",
    "probs",
    "rounded",
    True,
    ("v",),
    "O = P~ V, so dV = P~^T dO reads the P~ the forward multiplied",
  ),
  Requirement(
    "attn.probs@dscores",
    "probs",
    "original",
    True,
    ("q", "k"),
    "P = softmax(S) is evaluated before rounding, so dS = P * (dP - D) "
    "is the softmax Jacobian at the original P",
  ),
  Requirement(
    "attn.out@delta",
    "out",
    "original",
    True,
    ("q", "k"),
    "the row term D = rowsum(dP * P) = rowsum(dO * P V) reads the output "
    "of the original probabilities, before any rounding",
  ),
)

# What a `fresh` read of the output (`attn.out@delta`) draws anew.
FRESH_OUT = ("redraw", "output")


def _causal(t: int) -> jax.Array:
  return jnp.tril(jnp.ones((t, t), bool))


@dataclasses.dataclass(frozen=True)
class Attention(Op):
  """Causal multi-head attention; the backward reads per use.

  Inputs `q, k, v` are `[batch, length, heads, head_dim]`. Forward:

    S = q k^T / sqrt(head_dim) (causal mask),  P = softmax(S),
    P~ = round(P),  O = P~ V,  O~ = round(O)  (the output).

  Backward, with `dO` the incoming gradient rounded by `grad`:

    dV = P_v^T dO,  dP = dO V^T,  dS = P_s * (dP - D),
    dq = dS k / sqrt(d),  dk = dS^T q / sqrt(d)  (dS rounded by `grad`),

  where `P_v` is what `attn.probs@dv` reads, `P_s` what `attn.probs@dscores`
  reads, and the row term `D` is, per `attn.out@delta`: `rowsum(dO * O~)`
  (`rounded`, the flash-attention form reusing the output), the exact
  `rowsum(dP * P)` (`original`; equal to `rowsum(dO * P V)`),
  `rowsum(dO * Q_n(P V))` for `nearest`, and for `fresh` an independent
  copy of the output. With `fresh_out="redraw"` (the default) the copy is
  `Q_s(P~' V)`, where `P~'` is a new draw of the probabilities' rounding
  (in its own mode) and `Q_s` a new stochastic rounding of the output:
  every rounding upstream of the output is redrawn, so when both are
  stochastic the copy has the distribution of `O~` itself (mean `P V` and
  the same variance) and is independent of the forward. With
  `fresh_out="output"` only the output's rounding is drawn anew, from the
  original probabilities, `Q_s(P V)`: the same mean, less variance (it
  misses the probabilities' rounding). The original probabilities are
  recomputed from `q`, `k` and the row log-sum-exp, as flash attention
  does; only the rounded ones are stored (narrow).

  Requirements table (autodiff of the forward, roundings straight-through):

    attn.probs@dv       must read rounded: O = P~ V, so dV = P~^T dO.
    attn.probs@dscores  must read original: straight through P~ -> P, the
                        softmax Jacobian is taken at P: dS = P (dP - D).
                        Linear in the P read, so `fresh` is admissible;
                        `rounded` correlates with dO and is biased.
    attn.out@delta      must read original: D = rowsum(dP P) =
                        rowsum(dO (P V)), the output of the unrounded
                        probabilities. Linear, so a `fresh` copy is
                        admissible when its mean is `P V` (probabilities
                        stochastic or unrounded); reusing the rounded
                        output is biased: `dO` is computed from `O~`.

  Reuse is compared with the `redraw` copy, the only value from the
  distribution of `O~` (none exists when the output is rounded to nearest
  from stochastic probabilities).

  Scales: every rounding computes its scale from the values it rounds, by
  its format's rule (per-tensor amax, or per block for a scaled format).
  So the forward's `O~` is rounded with scales from `P~ V`, the `redraw`
  copy with scales from its own `P~' V` (the forward's map applied to a
  new draw: `O~`'s distribution), the `output` copy and a `nearest` read
  with scales from `P V`; a fresh draw of the probabilities reads the
  scales of `P`, the same as the forward's. A scaled format with blocks
  along the last axis blocks the probabilities along the keys (the axis
  `P~ V` sums over) and the output along its width, `heads * head_dim`,
  the axis the output projection sums over (as `[batch, length, width]`;
  `head_dim` alone is often shorter than a block).

  Attributes:
    probs: rounding of the probabilities (per-tensor scale: amax is 1).
    out: rounding of the output (blocks along the width, see above).
    grad: rounding of `dO` and `dS` (the gradients entering matmuls).
    fresh_out: what a `fresh` read of the output draws anew: `"redraw"`
      (the probabilities' rounding and the output's) or `"output"` (the
      output's rounding only, of `P V`).

  Example:
    ```python
    op = Attention(probs="float8_e4m3fn:stochastic",
                   out="float8_e4m3fn:stochastic")
    o = op(q, k, v, key=key, policy="attn.probs@dv=rounded,"
           "attn.probs@dscores=fresh,attn.out@delta=fresh")
    ```
  """

  probs: Rounding | str | None = None
  out: Rounding | str | None = None
  grad: Rounding | str | None = None
  fresh_out: str = "redraw"

  name = "attention"
  args = ("q", "k", "v")
  tensors = ("probs", "out")
  table = _TABLE

  def __post_init__(self):
    choices.check_choice("fresh_out", self.fresh_out, FRESH_OUT)
    self._coerce()

  def _redraws_probs(self) -> bool:
    """Whether a fresh read of the output redraws the probabilities."""
    return self.fresh_out == "redraw" and not self.probs.is_identity

  def produces(self, req, value: str) -> str:
    if req.tensor == "out" and value == "fresh" and self._redraws_probs():
      # The copy's mean is E[P~'] V: P V only if P~' is unbiased.
      return "draw" if self.probs.stochastic else "offset_draw"
    return super().produces(req, value)

  def copy_value(self, tensor: str) -> str | None:
    if tensor != "out" or self.probs.is_identity:
      return super().copy_value(tensor)
    if self.out.is_identity or self.out.stochastic:
      # O~ = Q_s(P~ V) (or P~ V): only the redraw has its distribution.
      return "fresh" if self.fresh_out == "redraw" else None
    # Nearest output: of deterministic probabilities a copy is O~ itself;
    # of stochastic ones no value reads Q_n(P~' V).
    return None if self.probs.stochastic else "rounded"

  def _needs_backward_key(self, values) -> bool:
    i = self.uses.index("attn.out@delta")
    redraw = values[i] == "fresh" and self._redraws_probs()
    return redraw or super()._needs_backward_key(values)

  def kind(self, tensor: str) -> str:
    own = super().kind(tensor)
    if tensor == "probs":
      return own
    # The rounded output O~ = round(P~ V) carries the probabilities' rounding.
    probs = super().kind("probs")
    if probs == "none":
      return own
    if "stochastic" in (own, probs):
      return "stochastic"
    return "deterministic"

  def _scores(self, q, k):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.where(_causal(q.shape[1]), s, -jnp.inf)

  def _forward(self, values, args, keys):
    q, k, v = args
    s = self._scores(q, k)
    m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    e = jnp.exp(s - m)
    den = jnp.sum(e, -1, keepdims=True)
    p = e / den
    if values is None:
      pr = saved.straight_through(self.probs, p, keys["probs"])
      o = jnp.einsum("bhqk,bkhd->bqhd", pr, v)
      orr = saved.straight_through(self.out, self._rows(o), keys["out"])
      return orr.reshape(o.shape), None
    reads = self.reads(values)
    # The probabilities: keep the narrow copies the reads name; the original
    # (and fresh draws of it) is recomputed from q, k and the log-sum-exp.
    narrow = reads["probs"] & {"rounded", "nearest"}
    pr, res_p = saved.save(self.probs, p, keys["probs"], narrow)
    res_p.pop("original", None)
    o = jnp.einsum("bhqk,bkhd->bqhd", pr, v)
    # The output: only a reused O~ is kept; the other reads need P V.
    reads_o = reads["out"] & {"rounded"}
    orr, res_o = saved.save(self.out, self._rows(o), keys["out"], reads_o)
    orr = orr.reshape(o.shape)
    if not reads_o:
      res_o = {}
    need_p = (
      self.probs.is_identity
      or reads["probs"] != narrow
      or reads["out"] != reads_o
    )
    lse = (m + jnp.log(den))[..., 0] if need_p else None
    return orr, dict(q=q, k=k, v=v, lse=lse, probs=res_p, out=res_o)

  def _read_probs(self, values, use, res, p, bkey):
    """The probabilities as `use` reads them."""

    def read(value):
      if self.probs.is_identity or value == "original":
        return p
      if value == "fresh":
        key = saved.key_for(bkey, use)
        return self.probs.round(p, key, mode="stochastic")[0]
      return res["probs"][value].value()

    return per_value(values[self.uses.index(use)], read)

  def _row_term(self, values, res, p, do, dp, bkey):
    """D, per `attn.out@delta`."""

    def read(value):
      if value == "rounded":
        out = res["out"]
        o = out["original"] if self.out.is_identity else out["rounded"].value()
        return jnp.einsum("bqhd,bqhd->bhq", do, o.reshape(do.shape))
      copy = value == "fresh" and self._redraws_probs()
      if value == "original" or (self.out.is_identity and not copy):
        return jnp.sum(dp * p, -1)
      if value == "fresh":
        o = self._output_copy(p, res["v"], bkey)
      else:
        pv = jnp.einsum("bhqk,bkhd->bqhd", p, res["v"])
        o = self._round_out(pv, None, "nearest")
      return jnp.einsum("bqhd,bqhd->bhq", do, o)

    return per_value(values[self.uses.index("attn.out@delta")], read)

  def _output_copy(self, p, v, bkey):
    """The `fresh` read of the output: a new stochastic rounding of
    `P~' V`, with `P~'` a new draw of the probabilities' rounding
    (`fresh_out="redraw"`) or `P` itself (`"output"`)."""
    if self._redraws_probs():
      kp = saved.key_for(bkey, "attn.out@delta:probs")
      p = self.probs.round(p, kp if self.probs.stochastic else None)[0]
    pv = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    if self.out.is_identity:
      return pv
    key = saved.key_for(bkey, "attn.out@delta")
    return self._round_out(pv, key, "stochastic")

  def _blocks_width(self) -> bool:
    """Whether the output's format has blocks along its last axis: they
    then run along the width `heads * head_dim` (see the class doc)."""
    f = self.out.format
    return (
      self.out.is_scaled_format and f.block is not None and f.axis in (-1, 3)
    )

  def _rows(self, o):
    """The output as its rounding sees it: `[b, q, h * d]` for a format
    blocked along the width, else `o` itself."""
    return o.reshape(*o.shape[:2], -1) if self._blocks_width() else o

  def _round_out(self, o, key, mode):
    """A new rounding of an output `o` (scales computed from `o`)."""
    return self.out.round(self._rows(o), key, mode=mode)[0].reshape(o.shape)

  def _backward(self, values, res, g):
    q, k, v, bkey = res["q"], res["k"], res["v"], res["backward_key"]
    p = None
    if res["lse"] is not None:
      s = self._scores(q, k)
      p = jnp.exp(s - res["lse"][..., None])
      p = jnp.where(_causal(q.shape[1]), p, 0.0)
    do = self._round_grad(g, bkey, "do")
    p_v = self._read_probs(values, "attn.probs@dv", res, p, bkey)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p_v, do)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, v)
    delta = self._row_term(values, res, p, do, dp, bkey)
    p_s = self._read_probs(values, "attn.probs@dscores", res, p, bkey)
    ds = self._round_grad(p_s * (dp - delta[..., None]), bkey, "ds")
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    return dq, dk, dv


def attention(q, k, v, *, policy=None, key=None, **config):
  """`Attention(**config)(q, k, v, policy=policy, key=key)`."""
  return Attention(**config)(q, k, v, policy=policy, key=key)
