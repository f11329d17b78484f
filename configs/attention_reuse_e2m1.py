"""Attention reuse that breaks training: the failing setting of the search.

`attention_reuse` with every saved activation rounded to `float4_e2m1fn`
(stochastically, per-tensor scaled) instead of `float8_e4m3fn`: the only
setting of `attention_reuse_search` at which reuse fails by its pre-stated
criterion. Arms, seeds and probe as in the search (`reuse`:
`attn.out@delta=rounded`; `redraw`: a fresh copy with the probabilities'
and the output's roundings redrawn, the distribution of the reused output;
`outonly`: a fresh rounding of `P V` only; seed pairs 0, 1, 2; a probe of
16 draws every 50 steps), so its runs are the search's `e2m1_*` runs
(the resolved configs are equal, tested).

  python -m experiments.run --config configs/attention_reuse_e2m1.py
  python -m scripts.reproduce attention_reuse_e2m1   # runs, table and figure

CPU scale (default): 2-layer d=64 GPT, built-in corpus, 400 steps; about
25 minutes for the nine runs on 2 shared CPU cores. Expected (CPU scale,
the search's e2m1 runs, AVX2 CPU): final validation loss reuse 2.320 (sd
0.046 over seeds), redraw 2.172 (sd 0.025), outonly 2.166 (sd 0.033);
reuse minus redraw +0.148 (per seed +0.104, +0.132, +0.207), twice the
failure threshold 3 sd(redraw) = 0.074; redraw minus outonly +0.006: the
copy's extra variance costs nothing, the reuse does. Pooled QKV gradient
relative bias of reuse 0.44 rms (z = +1.5 over 24 probes), of either copy
0. Full scale (`:scale=full`): the 390M preset as in `attention_reuse`.
"""

from configs import attention_reuse, attention_reuse_search


def get_config(arg=None):
  c = attention_reuse.get_config(arg)
  c.study.name = "attention_reuse_e2m1"
  c.study.analysis = "attention_reuse"
  c.study.figure = "attention_curves"
  c.study.plan_arm = ""
  c.lowprec.update(attention_reuse_search.SETTINGS["e2m1"]["lowprec"])
  if c.study.scale != "smoke":
    c.train.probe_every_steps = 50
    c.train.probe_draws = 16
  if c.study.scale == "full":
    # The full-scale probe and cadence of attention_reuse.
    full = attention_reuse.get_config(arg).train
    c.train.probe_every_steps = full.probe_every_steps
    c.train.probe_draws = full.probe_draws
  return c
