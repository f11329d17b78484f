"""Single-operator verification of a policy, no training: `run(config)`.

For each operator named in `checks.ops`, configured as `lowprec.nn`
configures it from the `lowprec` section (saved tensors rounded by
`fwd_format:fwd_rounding`, kernels by `weight_format` to nearest, gradients
by `bwd_format:bwd_rounding`), `lowprec.audit.predict` says from the
requirements table which uses of `lowprec.policy` change the mean gradient,
and `lowprec.audit.verify` measures it by Monte Carlo with the forward held
fixed. Inputs are standard normal draws from `numpy.random.default_rng`
seeded by the run's seed; the Monte Carlo keys come from the same seed.

Writes the usual layout under `results/<study>/<arm>/seed<k>/`:
config.json, env.json, summary.json (one row per operator and use, one per
operator for the whole policy, one per use and value read, and whether
every prediction held) and report.md (the verification reports).
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from experiments import ledger, models, results
from lowprec import audit, ops

# `checks.ops` entries: name -> (operator class, its keyword config)
OPERATORS = {
  "dense": (ops.Dense, {}),
  "norm_dense:layer": (ops.NormDense, {"norm": "layer"}),
  "norm_dense:rms": (ops.NormDense, {"norm": "rms"}),
  "attention": (ops.Attention, {}),
  "activation": (ops.Activation, {"fn": "gelu"}),
}


def build_op(name: str, num) -> ops.Op:
  """The operator `name` with the roundings of a `lowprec.nn.Numerics`."""
  if name not in OPERATORS:
    raise ValueError(
      f"unknown operator {name!r} in checks.ops; valid: " + ", ".join(OPERATORS)
    )
  cls, kw = OPERATORS[name]
  saved, weights, grads = num.saved, num.weights, num.grads
  if cls is ops.Dense:
    return cls(x=saved, kernel=weights, grad=grads, **kw)
  if cls is ops.NormDense:
    return cls(out=saved, kernel=weights, grad=grads, **kw)
  if cls is ops.Attention:
    return cls(probs=saved, out=saved, grad=grads, **kw)
  return cls(x=saved, **kw)


def make_inputs(name: str, ch, seed: int) -> tuple:
  """The operator's inputs, in `op.args` order (None: absent)."""
  rng = np.random.default_rng(seed)

  def normal(shape, scale=1.0, shift=0.0):
    return (shift + scale * rng.standard_normal(shape)).astype(np.float32)

  rows, width, out = ch.rows, ch.width, ch.out_width
  if name == "dense":
    return normal((rows, width)), normal((width, out), 0.25), None
  if name.startswith("norm_dense"):
    x, gain = normal((rows, width)), normal((width,), 0.1, 1.0)
    kernel = normal((width, out), 0.25)
    if name.endswith("rms"):
      return x, gain, None, kernel, None
    return x, gain, normal((width,), 0.1), kernel, np.zeros(out, np.float32)
  if name == "attention":
    shape = (1, ch.seq_len, ch.heads, ch.head_dim)
    return normal(shape), normal(shape), normal(shape)
  return (normal((rows, width), ch.act_scale),)


def check(name: str, config, seed: int) -> tuple[list, list, str]:
  """`(rows, value_rows, report)` of one operator under the config's policy.

  `rows`: one per use of the operator, then one for the whole policy
  (use `(all uses)`); `value_rows`: one per use and value read (the whole
  requirements table, the other uses reading the reference values).
  """
  ch = config.checks
  num = models.numerics_from(config.lowprec)
  op, policy = build_op(name, num), num.policy
  inputs = make_inputs(name, ch, seed)
  v = audit.verify(
    op,
    policy,
    inputs,
    ch.n_forward,
    ch.n_backward,
    jax.random.key(seed),
    z_threshold=ch.z_threshold,
  )
  pred = audit.predict(op, policy)
  n_test = ch.n_forward - ch.n_forward // 2
  common = dict(op=name, n_forward=ch.n_forward, n_backward=ch.n_backward)
  common["n_test"] = n_test
  rows, value_rows = [], []
  for u in v.uses:
    c = u.check(u.value)
    top = _strongest(c.estimates)
    reuse = None if u.reuse is None else _strongest(u.reuse)
    rows.append(
      dict(
        common,
        use=u.use,
        reads=u.value,
        must_read=pred[u.use].must_read,
        predicted=c.predicted,
        verified=c.verdict,
        gradient=top.gradient,
        rel_bias=top.bias,
        se=top.se,
        z=top.z,
        exact=top.exact,
        reuse_predicted=u.reuse_predicted,
        reuse_verified=u.reuse_verdict,
        reuse_z=None if reuse is None else reuse.z,
        reuse_exact=None if reuse is None else reuse.exact,
        agrees=c.agrees and u.reuse_predicted == u.reuse_verdict,
      )
    )
    for c in u.checks:
      top = _strongest(c.estimates)
      value_rows.append(
        dict(
          common,
          use=u.use,
          value=c.value,
          predicted=c.predicted,
          verified=c.verdict,
          z=top.z,
          exact=top.exact,
          agrees=c.agrees,
        )
      )
  top = _strongest(v.total)
  rows.append(
    dict(
      common,
      use="(all uses)",
      reads="policy",
      must_read="",
      predicted=v.total_predicted,
      verified=v.total_verdict,
      gradient=top.gradient,
      rel_bias=top.bias,
      se=top.se,
      z=top.z,
      exact=top.exact,
      reuse_predicted=None,
      reuse_verified=None,
      reuse_z=None,
      reuse_exact=None,
      agrees=(v.total_predicted == "biased") == (v.total_verdict == "biased"),
      reference_error=v.reference_error,
    )
  )
  return rows, value_rows, f"### {name}\n\n{v}\n"


def _strongest(ests) -> audit.Estimate:
  return max(ests, key=lambda e: (not e.exact, abs(e.z)))


def run(config, overrides: dict | None = None, options=None) -> dict:
  """Checks every operator of `checks.ops`; writes and returns the summary.

  The run directory is opened as a ledger (`ledger.open_run`): a finished
  run with the same config returns its summary.
  """
  with ledger.open_run(config, overrides, options) as entry:
    if entry.summary is not None:
      return entry.summary
    return _run(config, entry.path)


def _run(config, workdir: str) -> dict:
  t0 = time.time()
  seed = config.train.seed
  tag = f"[{config.study.name}/{config.study.arm or 'default'}/seed{seed}]"
  rows, value_rows, reports = [], [], []
  for name in config.checks.ops:
    r, vr, report = check(name, config, seed)
    rows += r
    value_rows += vr
    reports.append(report)
    ok = sum(x["agrees"] for x in r)
    print(f"{tag} {name}: {ok}/{len(r)} rows agree", flush=True)
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write("\n".join(reports))
  summary = {
    "status": "finished",
    "kind": "operator_checks",
    "policy": str(models.numerics_from(config.lowprec).policy),
    "rows": rows,
    "values": value_rows,
    "agrees": all(r["agrees"] for r in rows)
    and all(r["agrees"] for r in value_rows),
    "wall_s": time.time() - t0,
  }
  results.write_json(os.path.join(workdir, "summary.json"), summary)
  return summary
