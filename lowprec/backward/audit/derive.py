"""Derive an operator's requirements table from its reference gradient.

For an operator of your own (`ops.Custom`), `derive` finds, use by use,
what the hand-written tables of the built-in operators state:

  must_read     the value (`rounded` or `original`) with which the backward
                gives the reference gradient exactly: the gradient of the
                forward as it ran, roundings straight through (`jax.grad`
                of `op.reference`). Every combination of `rounded` and
                `original` over the uses is tried on a few forward draws;
                exactly one must reproduce the reference (up to float32
                reassociation, `ROUNDOFF` of the gradient's scale).
  feeds         the inputs whose gradients change when the use's read flips
                between `rounded` and `original`.
  linear        whether those gradients are affine in the value read: the
                read at the midpoint of `original` and `rounded` gives the
                midpoint of the two gradients (then an unbiased `fresh` draw
                averages to `original`: admissible where `original` is
                required).
  storage_only  whether the forward's output ignores the tensor's rounding
                (it is rounded for storage only; then reusing the draw is,
                on average, an independent copy).

These checks are deterministic. The table is then checked by Monte Carlo:
`audit.verify` with the reference policy measures every (use, value) with
standard errors and compares each with `audit.predict` on the table; the
`Derivation` carries that verification.

Example:
  ```python
  d = derive(op, (x, w), jax.random.key(0))
  print(d)         # the table, with the evidence for each row
  d.agrees         # every (use, value) verified as predicted
  op = d.op        # the operator carrying its derived table
  ```

Reference: "Backward-State Policy Is Part of the Learning Algorithm" (2026).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.backward.audit import predict as predict_lib
from lowprec.backward.audit import report
from lowprec.backward.audit import verify as verify_lib
from lowprec.backward.audit.report import ROUNDOFF
from lowprec.backward.ops.base import KEEP_ALL
from lowprec.backward.ops.custom import Custom
from lowprec.backward.ops.requirements import Requirement
from lowprec.backward.ops.rounding import Rounding
from lowprec.backward.policy import VALUES

# The rounding a tensor gets for the derivation when the operator does not
# round it (a table is a property of the forward, not of a format).
PROBE = Rounding("float8_e4m3fn", "stochastic")

# Combinations of `rounded` / `original` tried: 2 ** uses.
MAX_USES = 10


@dataclasses.dataclass(frozen=True)
class Evidence:
  """The deterministic checks behind one row of a derived table.

  `rounded` / `original`: the largest relative difference, over forward
  draws and input gradients, from the reference gradient when the use reads
  that value (the others reading their must-read values); `nonlinearity`:
  the same for the midpoint read against the midpoint of the gradients.
  """

  use: str
  rounded: float
  original: float
  nonlinearity: float


@dataclasses.dataclass(frozen=True)
class Derivation:
  """`derive`'s answer: the table, its evidence and its verification."""

  op: Custom  # the operator carrying `table`
  table: tuple[Requirement, ...]
  evidence: tuple[Evidence, ...]
  verification: verify_lib.Verification | None  # of the reference policy

  @property
  def agrees(self) -> bool:
    """Every (use, value) verified by Monte Carlo as the table predicts
    (False when the Monte Carlo check was skipped)."""
    return self.verification is not None and self.verification.agrees

  @property
  def counts(self) -> tuple[int, int]:
    """(checks verified as predicted, checks): every value of every use,
    reuse vs copy for each rounded use, and the whole policy."""
    v = self.verification
    ok = total = 0
    for u in v.uses:
      for c in u.checks:
        ok, total = ok + c.agrees, total + 1
      if u.reuse_predicted is not None:
        ok += u.reuse_predicted == u.reuse_verdict
        total += 1
    whole = (v.total_predicted == "biased") == (v.total_verdict == "biased")
    return ok + whole, total + 1

  def __str__(self) -> str:
    head = ("use", "must read", "admissible", "linear", "feeds",
            "storage only")  # fmt: skip
    pred = predict_lib.predict(self.op, self.op.reference_policy)
    rows = [
      (r.use, r.must_read, "/".join(pred[r.use].admissible),
       _yes_no(r.linear), ", ".join(r.feeds), _yes_no(r.storage_only))
      for r in self.table
    ]  # fmt: skip
    text = f"{self.op.name}: derived requirements\n\n" + report.table(
      head, rows
    )
    v = self.verification
    if v is None:
      return text + "\n\nnot verified by Monte Carlo (n_forward=0)"
    ok, total = self.counts
    return (
      text + f"\n\nverified by Monte Carlo (n_forward={v.n_forward}, "
      f"n_backward={v.n_backward}, |z| >= {v.z_threshold:g} biased): "
      f"{ok}/{total} checks as predicted"
    )


def derive(
  op: Custom,
  inputs: tuple,
  key,
  *,
  n_exact: int = 4,
  n_forward: int = 256,
  n_backward: int = 1,
  loss: Callable | None = None,
  z_threshold: float = 4.0,
) -> Derivation:
  """Derives `op`'s requirements table and verifies it by Monte Carlo.

  Args:
    op: an `ops.Custom` (its table, if any, is ignored). Tensors it does
      not round are probed with `PROBE` (float8_e4m3fn, stochastic).
    inputs: example inputs, in `op.args` order (None for an absent one).
    key: PRNG key for every draw.
    n_exact: forward draws for the deterministic checks.
    n_forward: forward draws for `audit.verify` (see there); 0 skips the
      Monte Carlo check (`verification` is None).
    n_backward: backward draws per forward draw for `audit.verify`.
    loss: scalar function of the output for both; default as in `verify`.
    z_threshold: `|z|` at or above which `verify` calls a difference biased.

  Returns:
    A `Derivation`; `.op` is `op` carrying the derived table (with `op`'s
      own roundings), `.agrees` whether Monte Carlo confirmed every row.

  Raises:
    TypeError: `op` is not an `ops.Custom`.
    ValueError: no combination of reads, or more than one, reproduces the
      reference gradient (a use whose read changes no gradient; a saved
      tensor the forward also uses without `read`), or too many uses.
  """
  if not isinstance(op, Custom):
    raise TypeError(f"derive takes an ops.Custom, got {type(op).__name__}")
  m = len(op.uses)
  if m > MAX_USES:
    raise ValueError(f"derive tries 2**uses combinations; {m} > {MAX_USES}")
  probe = op.with_roundings(
    **{t: PROBE for t in op.tensors if op.rounding(t).is_identity}
  )
  probe = dataclasses.replace(probe, table=None)
  inputs = tuple(inputs)
  exact_key, loss_key, mc_key = jax.random.split(key, 3)
  kfs = jax.random.split(exact_key, n_exact)
  combos = tuple(itertools.product((0, 1), repeat=m))  # 0 rounded, 1 original
  # The forward's own values are the first guess of the must-read values.
  guess = probe.forward_values(*inputs)
  diffs, storage, mids = jax.device_get(
    _exact_program(probe, loss, inputs, kfs, loss_key, jnp.array(combos), guess)
  )
  # diffs[f, combo, input]: relative max difference from the reference.
  worst = diffs.max(axis=(0, 2))
  exact = [c for c, d in zip(combos, worst, strict=True) if d <= ROUNDOFF]
  if len(exact) != 1:
    raise ValueError(_ambiguous(op, combos, worst, exact))
  best = exact[0]
  names = [n for n, x in zip(op.args, inputs, strict=True) if x is not None]
  values = tuple(VALUES[b] for b in best)
  if values != guess:
    mids = jax.device_get(
      _linearity_program(probe, loss, inputs, kfs, loss_key, values)
    )
  table, evidence = [], []
  for i, use in enumerate(op.uses):
    flip = best[:i] + (1 - best[i],) + best[i + 1 :]
    other = diffs[:, combos.index(flip)].max(0)  # per input
    tensor = op.tensor_of(use)
    must = VALUES[best[i]]
    # Below ROUNDOFF the flip is float32 reassociation, not a dependence.
    feeds = tuple(n for n, d in zip(names, other, strict=True) if d > ROUNDOFF)
    nonlin = float(mids[:, i].max())
    linear = nonlin <= ROUNDOFF
    storage_only = bool(storage[:, op.tensors.index(tensor)].all())
    d_other = float(other.max())
    evidence.append(
      Evidence(
        use,
        0.0 if must == "rounded" else d_other,
        0.0 if must == "original" else d_other,
        nonlin,
      )
    )
    alt = "original" if must == "rounded" else "rounded"
    reason = (
      f"derived: reading {must} reproduces the reference gradient exactly; "
      f"reading {alt} moves it by {d_other:.1e} (relative); the gradient is "
      + ("affine" if linear else f"not affine ({nonlin:.1e})")
      + " in the value read"
      + ("; the forward's output ignores the rounding" if storage_only else "")
    )
    table.append(
      Requirement(use, tensor, must, linear, feeds, reason, storage_only)
    )
  out = op.with_table(table)
  if n_forward == 0:
    return Derivation(out, tuple(table), tuple(evidence), None)
  verification = verify_lib.verify(
    out,
    out.reference_policy,
    inputs,
    n_forward,
    n_backward,
    mc_key,
    loss=loss,
    z_threshold=z_threshold,
  )
  return Derivation(out, tuple(table), tuple(evidence), verification)


def _rel(g, ref):
  top = jnp.max(jnp.abs(ref))
  return jnp.max(jnp.abs(g - ref)) / jnp.where(top > 0, top, 1.0)


def _loss(op, loss, inputs, loss_key):
  if loss is not None:
    return loss
  values = ("original",) * len(op.uses)  # the output ignores the policy
  return verify_lib.default_loss(op, values, inputs, loss_key)


def _setup(op, loss, inputs, kf):
  out, res = op._forward(KEEP_ALL, inputs, op._forward_keys(kf))
  dy = jax.grad(loss)(out)
  ref = jax.grad(lambda a: loss(op.reference(*a, key=kf)))(inputs)
  present = [i for i, x in enumerate(inputs) if x is not None]
  # Traced reads choose between rounded and original only (`choices`).
  res = dict(res, backward_key=None, choices=("rounded", "original"))
  return out, res, dy, [ref[i] for i in present], present


def _nonlinearity(op, res, dy, present, values):
  """Per use: how far the gradient at the midpoint read is from the
  midpoint of the gradients at `original` and `rounded`."""
  kept = res["kept"]
  out = []
  for u, use in enumerate(op.uses):
    t = op.tensor_of(use)

    def at(v, u=u, **kw):
      return op._backward(values[:u] + (v,) + values[u + 1 :], res, dy, **kw)

    g_r, g_o = at("rounded"), at("original")
    mid = {
      use: lambda x, t=t: (
        0.5 * (kept[t]["original"] + kept[t]["rounded"].value().astype(x.dtype))
      )
    }
    g_m = at(values[u], overrides=mid)
    rel = [_rel(g_m[i], 0.5 * (g_r[i] + g_o[i])) for i in present]
    out.append(jnp.max(jnp.stack(rel)))
  return jnp.stack(out)


@functools.partial(jax.jit, static_argnums=(0, 1, 6))
def _exact_program(op: Custom, loss, inputs, kfs, loss_key, combos, guess):
  """Per forward draw: each combo's relative difference from the reference
  per input; whether the output ignores each tensor's rounding; and the
  nonlinearity of each use with the others reading as in `guess`."""
  loss = _loss(op, loss, inputs, loss_key)

  def one(kf):
    out, res, dy, ref, present = _setup(op, loss, inputs, kf)

    def row(idx):
      g = op._backward(tuple(idx), res, dy)
      return jnp.stack(
        [_rel(g[i], r) for i, r in zip(present, ref, strict=True)]
      )

    diffs = jax.vmap(row)(combos)
    storage = []
    for t in op.tensors:
      off = op.with_roundings(**{t: None})
      y = off._forward(KEEP_ALL, inputs, off._forward_keys(kf))[0]
      storage.append(jnp.all(y == out))
    mids = _nonlinearity(op, res, dy, present, guess)
    return diffs, jnp.stack(storage), mids

  return jax.vmap(one)(kfs)


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def _linearity_program(op: Custom, loss, inputs, kfs, loss_key, values):
  """`_exact_program`'s nonlinearities for other reads `values`."""
  loss = _loss(op, loss, inputs, loss_key)

  def one(kf):
    _, res, dy, _, present = _setup(op, loss, inputs, kf)
    return _nonlinearity(op, res, dy, present, values)

  return jax.vmap(one)(kfs)


def _ambiguous(op, combos, worst, exact) -> str:
  def name(c):
    return ", ".join(
      f"{u}={VALUES[b]}" for u, b in zip(op.uses, c, strict=True)
    )

  if not exact:
    best = combos[int(np.argmin(worst))]
    return (
      f"no combination of rounded/original reads reproduces the reference "
      f"gradient of {op.name} (closest: {name(best)}, relative difference "
      f"{worst.min():.1e}). Does the forward use a saved tensor without "
      "read(), or pass read() a different array than the one it rounds?"
    )
  return (
    f"more than one combination of reads reproduces the reference gradient "
    f"of {op.name}: {'; '.join(name(c) for c in exact)}. A use whose read "
    "changes no gradient should not be declared."
  )


def _yes_no(b) -> str:
  return "yes" if b else "no"
