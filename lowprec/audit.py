"""Predict, then verify by Monte Carlo, what a policy does to the mean gradient.

`predict(op, policy)` reads the operator's requirements table: for each use,
whether the value the policy reads is the one the reference gradient reads
(`exact`), an admissible substitute (`unbiased`), or neither (`biased`), and
whether reusing the forward's draw differs on average from an independent
copy.

`verify(op, policy, inputs, n_forward, n_backward, key)` measures the same
things on one operator, without training. It draws `n_forward` forward keys
and, for each, `n_backward` backward keys (fresh reads, gradient rounding).
Per forward key the forward runs once, and every variant's backward reads
its residuals, so the forward is held fixed exactly:

  reference      the must-read value for every use, no gradient rounding
                 (checked against `jax.grad` of the straight-through
                 forward: `reference_error`);
  use u as v     every use reads its reference value except u, which reads
                 v; for every use and every value, so the bias is attributed
                 to one use and the whole requirements table is checked;
  reuse vs copy  u read as `rounded` minus u read as an independent copy;
  total          the whole policy.

Gradients flow from a fixed loss of the output. The default,
`0.5 |y - y0|^2 + <c, y>` with `y0` the output with rounding off and `c`
along `y0` with the norm of one draw's rounding error, makes the downstream
gradient depend on the forward's draw (so reuse shows) and have a nonzero
mean (so a deterministic error shows).

For each variant and each input's gradient, the per-forward differences
`d_f` from the reference (averaged over the backward draws) are tested for
mean zero by a split-sample projection: the first half of the forward draws
estimates the direction `u` of the mean, the second half gives
`t_f = <d_f, u> / |u|`, and `z = mean(t) / se(t)` is standard normal under
no bias, whatever `u` is. Biases and standard errors are reported relative
to the root-mean-square norm of the reference gradient. A difference that is
zero for every draw is `exact`; one that is the same nonzero value for every
draw (no spread: a deterministic bias, as under nearest rounding) is
`biased` and reported as exact-different, with no z (there is no standard
error to divide by); `|z| >= z_threshold` is `biased`; otherwise
`unbiased`. With stochastic gradient rounding nothing is exact, so `exact`
predictions are compared as `unbiased`.

Example:
  >>> fp8 = ops.Rounding("float8_e4m3fn", "stochastic")
  >>> op = ops.Attention(probs=fp8, out=fp8)
  >>> pol = "attn.probs@.*=rounded,attn.out@delta=rounded"  # reuse
  >>> print(predict(op, pol))
  >>> v = verify(op, pol, (q, k, v), 512, 1, jax.random.key(0))
  >>> v.agrees, print(v)

Reference: "Backward-State Policy Is Part of the Learning Algorithm" (2026).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.ops import requirements as req_lib
from lowprec.ops.base import KEEP_ALL, Op
from lowprec.ops.saved import Rounding
from lowprec.policy import VALUES, Policy

# ---- prediction --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UsePrediction:
  """The predicted effect of one use's read on the mean gradient."""

  use: str
  value: str  # what the policy reads
  must_read: str  # what the reference reads
  kind: str  # how the tensor's rounded value is produced
  verdict: str  # "exact", "unbiased" or "biased"
  admissible: tuple[str, ...]  # values that are exact or unbiased here
  reuse_differs: bool | None  # rounded vs an independent copy; None: no copy


@dataclasses.dataclass(frozen=True)
class Prediction:
  """`predict`'s answer: one `UsePrediction` per use of the operator."""

  op: str
  policy: str
  uses: tuple[UsePrediction, ...]

  @property
  def biased(self) -> tuple[str, ...]:
    """The uses whose read changes the mean gradient."""
    return tuple(u.use for u in self.uses if u.verdict == "biased")

  def __getitem__(self, use: str) -> UsePrediction:
    return next(u for u in self.uses if u.use == use)

  def __str__(self) -> str:
    rows = [
      (u.use, u.value, u.must_read, "/".join(u.admissible), u.verdict,
       _yes_no(u.reuse_differs))
      for u in self.uses
    ]  # fmt: skip
    head = ("use", "reads", "must read", "admissible", "predicted",
            "reuse differs")  # fmt: skip
    return f"{self.op}: {self.policy}\n" + _table(head, rows)


def _classify(op: Op, req, value: str) -> str:
  """`requirements.classify` of reading `value` for `req.use` on `op`."""
  return req_lib.classify(
    req, op.produces(req, value), op.produces(req, req.must_read)
  )


def predict(op: Op, policy) -> Prediction:
  """Predicts, from the requirements table, which uses bias the mean gradient.

  Args:
    op: a configured operator (e.g. `ops.Attention(probs=..., out=...)`); its
      roundings decide which values coincide (no rounding: all of them;
      nearest: `rounded` and `nearest`).
    policy: a `Policy` or anything `Policy.parse` takes.

  Returns:
    A `Prediction`; `str()` of it is a table.

  Raises:
    ValueError: the policy does not cover the operator's uses.

  Example:
    >>> op = ops.NormDense(out="float8_e4m3fn:stochastic")
    >>> predict(op, "norm.out@.*=original,dense.kernel@dx=rounded").biased
    ('norm.out@dw',)
  """
  if not isinstance(op, Op):
    raise TypeError(f"expected an operator from lowprec.ops, got {op!r}")
  values = op.resolve(policy)
  out = []
  for req, value in zip(op.table, values, strict=True):
    verdicts = {v: _classify(op, req, v) for v in VALUES}
    copy = op.copy_value(req.tensor)
    differs = req_lib.reuse_differs(
      op.produces(req, "rounded"),
      None if copy is None else op.produces(req, copy),
    )
    admissible = tuple(v for v in VALUES if verdicts[v] != "biased")
    out.append(
      UsePrediction(req.use, value, req.must_read, op.kind(req.tensor),
                    verdicts[value], admissible, differs)
    )  # fmt: skip
  return Prediction(op.name, str(Policy.parse(policy)), tuple(out))


# ---- verification ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Mean difference of one input's gradient from its baseline.

  `bias` and `se` are along the split-sample direction, relative to the
  root-mean-square norm of that input's reference gradient; `z = bias / se`.
  `exact`: the difference was zero for every forward draw (up to float32
  reassociation roundoff, `ROUNDOFF` relative to the gradient's scale).
  `deterministic` ("exact-different"): it was the same nonzero value for
  every draw, up to that roundoff; then `se` is 0 and `z` is +-inf, as
  no z is computed, and the difference is biased at any threshold.
  """

  gradient: str
  bias: float
  se: float
  z: float
  exact: bool
  deterministic: bool = False

  def biased(self, z_threshold: float) -> bool:
    if self.exact:
      return False
    return self.deterministic or abs(self.z) >= z_threshold


@dataclasses.dataclass(frozen=True)
class ValueCheck:
  """One use read as one value, everything else as the reference reads."""

  value: str
  predicted: str  # "exact", "unbiased" or "biased"
  verdict: str  # measured, same words
  estimates: tuple[Estimate, ...]  # one per input gradient

  @property
  def agrees(self) -> bool:
    return (self.predicted == "biased") == (self.verdict == "biased")


@dataclasses.dataclass(frozen=True)
class UseVerification:
  """Measured effect of every value one use could read, and of reuse."""

  use: str
  value: str  # what the policy reads
  checks: tuple[ValueCheck, ...]  # one per value in `VALUES`
  reuse_predicted: bool | None  # None: the tensor is not rounded
  reuse_verdict: bool | None
  reuse: tuple[Estimate, ...] | None  # rounded minus an independent copy

  def check(self, value: str) -> ValueCheck:
    return next(c for c in self.checks if c.value == value)

  @property
  def predicted(self) -> str:
    return self.check(self.value).predicted

  @property
  def verdict(self) -> str:
    return self.check(self.value).verdict

  @property
  def agrees(self) -> bool:
    reuse = self.reuse_predicted == self.reuse_verdict
    return reuse and all(c.agrees for c in self.checks)


@dataclasses.dataclass(frozen=True)
class Verification:
  """`verify`'s answer. `agrees`: every verdict matches `predict`."""

  op: str
  policy: str
  n_forward: int
  n_backward: int
  z_threshold: float
  uses: tuple[UseVerification, ...]
  total: tuple[Estimate, ...]  # the whole policy against the reference
  total_predicted: str
  total_verdict: str
  reference_error: float  # median max |reference - autodiff| / max |ref|

  @property
  def agrees(self) -> bool:
    total = (self.total_predicted == "biased") == (
      self.total_verdict == "biased"
    )
    return total and all(u.agrees for u in self.uses)

  def __getitem__(self, use: str) -> UseVerification:
    return next(u for u in self.uses if u.use == use)

  def __str__(self) -> str:
    rows = []
    for u in self.uses:
      reuse = "-"
      if u.reuse is not None:
        top = _strongest(u.reuse)
        reuse = f"{_yes_no(u.reuse_predicted)} / {_yes_no(u.reuse_verdict)}"
        if top.deterministic:
          reuse += " (exact-different)"
        elif not top.exact:
          reuse += f" (z={_fmt_z(top)})"
      ests = u.check(u.value).estimates
      rows.append(_row(u.use, u.value, u.predicted, u.verdict, ests, reuse))
    rows.append(
      _row(
        "(all uses)", "policy", self.total_predicted, self.total_verdict,
        self.total, "",
      )
    )  # fmt: skip
    head = ("use", "reads", "predicted", "verified", "grad", "rel. bias",
            "z", "reuse differs: predicted / verified")  # fmt: skip
    every = [(u.use, *(_fmt_check(c) for c in u.checks)) for u in self.uses]
    return (
      f"{self.op}: {self.policy}\n"
      f"n_forward={self.n_forward}, n_backward={self.n_backward}, biased "
      f"when |z| >= {self.z_threshold:g}; reference gradient vs autodiff "
      f"of the straight-through forward: {_fmt_error(self.reference_error)}; "
      f"agrees with prediction: {self.agrees}\n\n"
      + _table(head, rows)
      + "\n\nEvery value of every use (predicted -> verified):\n\n"
      + _table(("use", *VALUES), every)
    )


def verify(
  op: Op,
  policy,
  inputs: tuple,
  n_forward: int,
  n_backward: int,
  key,
  *,
  loss: Callable | None = None,
  z_threshold: float = 4.0,
  chunk: int = 256,
) -> Verification:
  """Monte Carlo check of a policy, and of the requirements table, on one op.

  For every use and every value it could read (the others reading the
  reference values) and for the whole policy, estimates the mean difference
  from the reference gradient with the forward held fixed, and for every
  rounded tensor the mean difference between reusing the forward's draw and
  reading an independent copy; then compares each with `predict`.

  Args:
    op: a configured operator from `lowprec.ops`.
    policy: a `Policy` or anything `Policy.parse` takes.
    inputs: the operator's inputs, in `op.args` order (None for an absent
      optional input).
    n_forward: forward draws (at least 4): half estimate the direction of a
      bias, half test it.
    n_backward: backward draws (fresh reads, gradient rounding) per forward
      draw.
    key: PRNG key for all draws.
    loss: scalar function of the operator's output, from which gradients
      flow. Default: `0.5 * |y - y0|^2` with `y0` the output with rounding
      off, so the downstream gradient is the forward's own rounding error and
      any correlation with the forward's draw shows. A loss linear in `y`
      hides every bias that comes from reuse.
    z_threshold: `|z|` at or above which a difference is called biased.
    chunk: forward draws evaluated together (memory).

  Returns:
    A `Verification`; `str()` of it is a report with two tables.

  Raises:
    ValueError: the policy does not cover the operator; too few draws.
  """
  if n_forward < 4 or n_backward < 1:
    raise ValueError("verify needs n_forward >= 4 and n_backward >= 1")
  pred = predict(op, policy)
  values = op.resolve(policy)
  ref_values = op.resolve(None)
  inputs = tuple(inputs)
  table = tuple(
    _replace(ref_values, i, v) for i in range(len(values)) for v in VALUES
  )
  chunk = min(chunk, n_forward)
  n_chunks = -(-n_forward // chunk)
  loss_key, key = jax.random.split(key)
  kfs = jax.random.split(key, n_chunks * chunk).reshape(n_chunks, chunk)
  rows = jnp.array([[VALUES.index(v) for v in r] for r in (*table, values)])
  parts = [
    jax.device_get(
      _program(op, ref_values, loss, n_backward, inputs, kfs[c], loss_key, rows)
    )
    for c in range(n_chunks)
  ]
  ref, err, stacked = jax.tree.map(
    lambda *xs: np.concatenate(xs)[:n_forward], *parts
  )
  # stacked[gradient][forward, row, ...] -> diffs[row][gradient]
  diffs = [tuple(g[:, j] for g in stacked) for j in range(len(rows))]
  total = diffs[-1]

  names = [n for n, x in zip(op.args, inputs, strict=True) if x is not None]
  scale = [
    float(np.sqrt(np.mean(np.sum(np.square(r.reshape(len(r), -1)), 1)))) or 1.0
    for r in ref
  ]

  def estimates(d):
    return tuple(
      _estimate(n, np.asarray(x, np.float64), s)
      for n, x, s in zip(names, d, scale, strict=True)
    )

  def verdict(ests):
    if all(e.exact for e in ests):
      return "exact"
    return "biased" if any(e.biased(z_threshold) for e in ests) else "unbiased"

  uses = []
  for i, u in enumerate(pred.uses):
    req = op.table[i]
    checks = []
    for v in VALUES:
      ests = estimates(diffs[table.index(_replace(ref_values, i, v))])
      predicted = _noisy(_classify(op, req, v), op)
      checks.append(ValueCheck(v, predicted, verdict(ests), ests))
    reuse = reuse_v = None
    if u.reuse_differs is not None:
      copy = op.copy_value(req.tensor)
      dr = diffs[table.index(_replace(ref_values, i, "rounded"))]
      dc = diffs[table.index(_replace(ref_values, i, copy))]
      reuse = estimates(tuple(a - b for a, b in zip(dr, dc, strict=True)))
      reuse_v = any(e.biased(z_threshold) for e in reuse)
    uses.append(
      UseVerification(
        u.use, u.value, tuple(checks), u.reuse_differs, reuse_v, reuse
      )
    )
  total = estimates(total)
  total_pred = "exact"
  for u in pred.uses:
    if u.verdict == "biased" or (u.verdict, total_pred) == (
      "unbiased",
      "exact",
    ):
      total_pred = u.verdict
  total_pred = _noisy(total_pred, op)
  return Verification(
    op.name, pred.policy, n_forward, n_backward, z_threshold, tuple(uses),
    total, total_pred, verdict(total), float(np.median(err)),
  )  # fmt: skip


def _default_loss(op: Op, values, inputs, key):
  """`0.5 |y - y0|^2 + <c, y>`: `y0` the unrounded output, `c` along `y0`
  with the norm of one draw's rounding error `y1 - y0` (`c = y0` when the
  output does not depend on the rounding)."""
  y0 = op.unrounded().apply(values, inputs, None)
  y1 = op.apply(values, inputs, key)
  size = jnp.linalg.norm(y1 - y0) / jnp.maximum(jnp.linalg.norm(y0), 1e-30)
  c = jax.lax.stop_gradient(jnp.where(size > 0, size, 1.0) * y0)
  return lambda y: 0.5 * jnp.sum(jnp.square(y - y0)) + jnp.sum(c * y)


# Compiled once per (operator, loss, sizes) and reused across calls: the
# variants are data (indices into VALUES), so every policy shares a program.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _program(
  op: Op, ref_values, loss, n_backward, inputs, kfs, loss_key, variants
):
  """Per forward key: reference gradient, its relative deviation from
  autodiff of the straight-through forward, and for each variant the mean
  over backward keys of (gradient - reference).

  The forward runs once per key, keeping the residuals of every policy; each
  variant's backward then reads them, so the forward is held fixed exactly.
  """
  ref_op = op
  if hasattr(op, "grad"):
    ref_op = dataclasses.replace(op, grad=Rounding())
  if loss is None:
    loss = _default_loss(op, ref_values, inputs, loss_key)
  present = [i for i, x in enumerate(inputs) if x is not None]
  # Every variant runs through one traced backward: the reads are indices
  # into VALUES (see `ops.base.per_value`), vmapped over the variants. The
  # reference is the first row when the operator rounds no gradients, so
  # that a variant reading the same values gives bit-identical gradients.
  same = ref_op == op
  if same:
    ref_index = jnp.array([[VALUES.index(v) for v in ref_values]])
    variants = jnp.concatenate([ref_index, variants])

  def backward(o: Op, values, res, dy, kb):
    grads = o._backward(values, dict(res, backward_key=kb), dy)
    return tuple(grads[i] for i in present)

  def one(kf):
    out, res = op._forward(KEEP_ALL, inputs, op._forward_keys(kf))
    dy = jax.grad(loss)(out)
    kbs = jax.random.split(jax.random.fold_in(kf, 1), n_backward)

    def row(idx):
      g = jax.vmap(lambda kb: backward(op, tuple(idx), res, dy, kb))(kbs)
      return tuple(x.mean(0) for x in g)

    g = jax.vmap(row)(variants)
    if same:
      ref = tuple(x[0] for x in g)
      g = tuple(x[1:] for x in g)
    else:
      ref = backward(ref_op, ref_values, res, dy, None)
    diffs = tuple(x - r[None] for x, r in zip(g, ref, strict=True))
    auto_fn = lambda args: loss(op.reference(*args, key=kf))
    auto = [g for g in jax.grad(auto_fn)(inputs) if g is not None]
    top = jnp.max(jnp.stack([jnp.max(jnp.abs(r)) for r in ref]))
    err = jnp.max(
      jnp.stack(
        [jnp.max(jnp.abs(a - r)) for a, r in zip(auto, ref, strict=True)]
      )
    )
    return ref, err / jnp.where(top > 0, top, 1.0), diffs

  return jax.vmap(one)(kfs)


def _noisy(predicted: str, op: Op) -> str:
  """Stochastic gradient rounding makes every `exact` read `unbiased`."""
  if predicted == "exact" and op.grad_rounding.stochastic:
    return "unbiased"
  return predicted


def _replace(values: tuple, i: int, value: str) -> tuple:
  return values[:i] + (value,) + values[i + 1 :]


# Two float32 evaluations of the same gradient that XLA fuses or sums in a
# different order differ by reassociation roundoff; below this size relative
# to the reference gradient's scale a difference counts as none.
ROUNDOFF = 1e-5


def _estimate(name, d, scale) -> Estimate:
  """Split-sample projected mean of per-forward differences `d[f, ...]`."""
  if not np.any(d) or np.max(np.abs(d)) <= ROUNDOFF * scale:
    return Estimate(name, 0.0, 0.0, 0.0, True)
  x = d.reshape(d.shape[0], -1)
  half = x.shape[0] // 2
  u = x[:half].mean(0)
  un = np.linalg.norm(u)
  t = x[half:] @ (u / un) if un > 0 else np.zeros(x.shape[0] - half)
  mean = float(t.mean())
  roundoff = ROUNDOFF * max(scale, abs(mean))
  if np.max(np.abs(t - mean)) <= roundoff:
    # The same value at every draw: a z would divide by roundoff.
    if abs(mean) <= roundoff:  # and that value is none along `u`
      return Estimate(name, mean / scale, 0.0, 0.0, False)
    inf = math.copysign(math.inf, mean)
    return Estimate(name, mean / scale, 0.0, inf, False, deterministic=True)
  se = float(t.std(ddof=1) / math.sqrt(t.size))
  return Estimate(name, mean / scale, se / scale, mean / se, False)


def _row(use, value, predicted, verdict, ests, reuse) -> tuple:
  top = _strongest(ests)
  grad = "-" if top.exact else top.gradient
  return (use, value, predicted, verdict, grad, _fmt_bias(top), _fmt_z(top),
          reuse)  # fmt: skip


def _strongest(ests) -> Estimate:
  return max(ests, key=lambda e: (not e.exact, e.deterministic, abs(e.z)))


def _fmt_bias(e: Estimate) -> str:
  if e.exact:
    return "0 (exact)"
  if e.deterministic:
    return f"{e.bias:+.1e} (exact-different)"
  return f"{e.bias:+.1e} ± {e.se:.1e}"


def _fmt_z(e: Estimate) -> str:
  if e.exact or e.deterministic:
    return "-"
  return f"{e.z:+.1f}" if abs(e.z) < 1e4 else f"{e.z:+.1e}"


def _fmt_check(c: ValueCheck) -> str:
  top = _strongest(c.estimates)
  if top.exact:
    z = ""
  elif top.deterministic:
    z = " (exact-different)"
  else:
    z = f" (z={_fmt_z(top)})"
  mark = "" if c.agrees else " MISMATCH"
  return f"{c.predicted} -> {c.verdict}{z}{mark}"


def _fmt_error(e: float) -> str:
  # Below ROUNDOFF the digits are float32 reassociation, which differs
  # between CPUs and compilers: print the bound instead.
  return f"< {ROUNDOFF:.0e} (roundoff)" if e < ROUNDOFF else f"{e:.1e}"


def _yes_no(b) -> str:
  return "-" if b is None else ("yes" if b else "no")


def _table(head, rows) -> str:
  """A Markdown table."""
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(lines)


# Derivation builds on predict and verify, so it is imported last.
from lowprec.derive import Derivation, Evidence, derive  # noqa: E402, F401
