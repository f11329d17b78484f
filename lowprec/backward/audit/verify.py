"""Monte Carlo verification of a policy on one operator (`verify`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.backward.audit.predict import classify, predict
from lowprec.backward.audit.report import (
  Estimate,
  estimate,
  fmt_bias,
  fmt_error,
  fmt_z,
  strongest,
  table,
  yes_no,
)
from lowprec.backward.ops.base import KEEP_ALL, Op


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
        top = strongest(u.reuse)
        reuse = f"{yes_no(u.reuse_predicted)} / {yes_no(u.reuse_verdict)}"
        if top.deterministic:
          reuse += " (exact-different)"
        elif not top.exact:
          reuse += f" (z={fmt_z(top)})"
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
    values = tuple(c.value for c in self.uses[0].checks) if self.uses else ()
    return (
      f"{self.op}: {self.policy}\n"
      f"n_forward={self.n_forward}, n_backward={self.n_backward}, biased "
      f"when |z| >= {self.z_threshold:g}; reference gradient vs autodiff "
      f"of the straight-through forward: {fmt_error(self.reference_error)}; "
      f"agrees with prediction: {self.agrees}\n\n"
      + table(head, rows)
      + "\n\nEvery value of every use (predicted -> verified):\n\n"
      + table(("use", *values), every)
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
    _replace(ref_values, i, v) for i in range(len(values)) for v in op.values
  )
  chunk = min(chunk, n_forward)
  n_chunks = -(-n_forward // chunk)
  loss_key, key = jax.random.split(key)
  kfs = jax.random.split(key, n_chunks * chunk).reshape(n_chunks, chunk)
  rows = jnp.array([[op.values.index(v) for v in r] for r in (*table, values)])
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
      estimate(n, np.asarray(x, np.float64), s)
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
    for v in op.values:
      ests = estimates(diffs[table.index(_replace(ref_values, i, v))])
      predicted = _noisy(classify(op, req, v), op)
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


def default_loss(op: Op, values, inputs, key):
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
  ref_op = op.without_grad_rounding()
  if loss is None:
    loss = default_loss(op, ref_values, inputs, loss_key)
  present = [i for i, x in enumerate(inputs) if x is not None]
  # Every variant runs through one traced backward: the reads are indices
  # into VALUES (see `ops.base.per_value`), vmapped over the variants. The
  # reference is the first row when the operator rounds no gradients, so
  # that a variant reading the same values gives bit-identical gradients.
  same = ref_op == op
  if same:
    ref_index = jnp.array([[op.values.index(v) for v in ref_values]])
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
  """With gradients rounded to nearest, or stochastically onto scales that
  can clip (`Rounding.saturates`), every read is `biased`; unbiased
  stochastic gradient rounding makes every `exact` read `unbiased`."""
  rs = [r for r in op.grad_roundings() if not r.is_identity]
  if any(r.mode == "nearest" or r.saturates for r in rs):
    return "biased"
  if predicted == "exact" and rs:
    return "unbiased"
  return predicted


def _replace(values: tuple, i: int, value: str) -> tuple:
  return values[:i] + (value,) + values[i + 1 :]


def _row(use, value, predicted, verdict, ests, reuse) -> tuple:
  top = strongest(ests)
  grad = "-" if top.exact else top.gradient
  return (use, value, predicted, verdict, grad, fmt_bias(top), fmt_z(top),
          reuse)  # fmt: skip


def _fmt_check(c: ValueCheck) -> str:
  top = strongest(c.estimates)
  if top.exact:
    z = ""
  elif top.deterministic:
    z = " (exact-different)"
  else:
    z = f" (z={fmt_z(top)})"
  mark = "" if c.agrees else " MISMATCH"
  return f"{c.predicted} -> {c.verdict}{z}{mark}"
