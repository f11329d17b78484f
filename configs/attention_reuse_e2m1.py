"""Attention reuse that breaks training: the failing setting of the search.

`attention_reuse` with every saved activation rounded to `float4_e2m1fn`
(stochastically, per-tensor scaled) instead of `float8_e4m3fn`: the
smallest dose at which `attention_reuse_search` found reuse failing by its
pre-stated criterion. Arms, seeds and probe as in the search (`reuse`:
`attn.out@delta=rounded`, `fresh`: `attn.out@delta=fresh`; seed pairs 0,
1, 2; a probe of 16 draws every 50 steps), so its runs are the search's
`e2m1_reuse` and `e2m1_fresh` runs bit for bit.

  python -m experiments.run --config configs/attention_reuse_e2m1.py
  python -m scripts.reproduce attention_reuse_e2m1   # runs, table and figure

CPU scale (default): 2-layer d=64 GPT, built-in corpus, 400 steps; about
8 minutes for the six runs on 2 CPU cores. Expected (CPU scale, measured):
final validation loss reuse 2.360 (sd 0.058 over seeds), fresh 2.145 (sd
0.016); reuse minus fresh +0.215 (per seed +0.2121, +0.1604, +0.2722), more
than 4 times the failure threshold 3 sd(fresh) = 0.048 in every seed;
pooled QKV gradient relative bias of reuse 0.72 rms (z = +2.0 over 24
probes), of fresh 0 (z = -1.5). Fresh trains as well as the e4m3 runs of
the search (2.145 vs 2.108); reuse does not. Full scale (`:scale=full`):
the 390M preset as in `attention_reuse`.
"""

from configs import attention_reuse, attention_reuse_search


def get_config(arg=None):
  c = attention_reuse.get_config(arg)
  c.study.name = "attention_reuse_e2m1"
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
