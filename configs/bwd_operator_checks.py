"""Single-operator verification of the requirements tables, no training.

Reproduces: "we derive from this reference which value each use must read,
or which substitute gives the same gradient on average with the forward held
fixed, and check these per-use requirements on single operators, without
training ... the requirements predicted beforehand whether reuse changes
what the backward computes on average relative to an independent copy, and
every prediction held" (backward-state paper).

For every operator of `lowprec.ops` (dense, norm + dense with LayerNorm and
with RMSNorm, causal attention, GELU activation), configured as the GPT
studies configure them (saved tensors `float8_e4m3fn` stochastic, kernels
`float8_e4m3fn` nearest, gradients `float8_e5m2` stochastic, per-tensor
scaling; the activation rounds no gradients), and for every policy of
interest (the arms), `lowprec.audit.predict` says from the requirements
table alone which uses change the mean gradient, and `lowprec.audit.verify`
measures it by Monte Carlo with the forward held fixed: per use the relative
bias, its standard error and z (biased when |z| >= `checks.z_threshold`,
split-sample test over `checks.n_forward` forward draws), reuse vs an
independent copy, the whole policy, and every value of every use.

  rounded    every use reads the forward's rounded value (reuse);
  original   every use reads the original;
  fresh      every use reads a fresh stochastic rounding;
  per_use    what the reference reads (`lowprec.ops.REFERENCE`).

  python -m experiments.run --config configs/bwd_operator_checks.py
  python -m scripts.reproduce bwd_operator_checks   # checks, table, figure

CPU scale (default): inputs of 8 x 16 (attention: 8 tokens, 2 heads of 8),
4096 forward draws; about 15 s for the four arms on 2 CPU cores. Full
scale (`:scale=full`): wider inputs, 65536 draws.
Expected (CPU scale): prediction = verification for all 56 (use, policy)
rows, the 20 whole-policy rows, the 56 (use, value) cells of the
requirements tables and the 14 reuse-vs-copy checks; every cell predicted
biased has |z| >= 24, every other |z| <= 2.1.
"""

import ml_collections

from configs import common

ARMS = {
  "rounded": ".*=rounded",
  "original": ".*=original",
  "fresh": ".*=fresh",
  "per_use": "",  # the reference reads
}


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "bwd_operator_checks"
  c.study.analysis = "operator_checks"
  c.study.figure = "operator_z"
  c.study.kind = "operator_checks"
  c.study.arms = {a: {"lowprec": {"policy": p}} for a, p in ARMS.items()}
  c.lowprec.update(
    dict(
      fwd_format="float8_e4m3fn",
      fwd_rounding="stochastic",
      weight_format="float8_e4m3fn",
      bwd_format="float8_e5m2",
      bwd_rounding="stochastic",
    )
  )
  c.checks = ml_collections.ConfigDict()
  c.checks.ops = (
    "dense",
    "norm_dense:layer",
    "norm_dense:rms",
    "attention",
    "activation",
  )
  c.checks.n_forward = 4096  # forward draws (half direction, half test)
  c.checks.n_backward = 1  # backward draws per forward draw
  c.checks.z_threshold = 4.0
  c.checks.rows = 8  # dense / norm / activation inputs: rows x width
  c.checks.width = 16
  c.checks.out_width = 8
  c.checks.seq_len = 8  # attention: 1 x seq_len x heads x head_dim
  c.checks.heads = 2
  c.checks.head_dim = 8
  c.checks.act_scale = 2.0  # activation inputs ~ N(0, act_scale^2)
  if c.study.scale == "full":
    c.checks.update(dict(n_forward=65536, rows=32, width=64, out_width=32))
    c.checks.update(dict(seq_len=32, heads=4, head_dim=16))
  if c.study.scale == "smoke":
    c.checks.n_forward = 64
  return c
