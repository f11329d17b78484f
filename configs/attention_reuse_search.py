"""Does reusing attention's rounded output cost loss, against a true copy?

In attention's backward the row term `D = rowsum(dO * O)` must read the
output of the unrounded probabilities. A flash-attention backward that keeps
its rounded output reuses `O~ = Q(P~ V)` instead (`reuse`). The contrast the
backward-state paper draws is reuse against "a new rounding from the same
distribution": here `redraw`, which reads `Q_s(P~' V)` with both the
probabilities' and the output's roundings drawn anew (the distribution of
`O~`, independent of the forward; `Attention(fresh_out="redraw")`). The
earlier contrast, `outonly`, rounds `P V` of the original probabilities
anew (`fresh_out="output"`): the same mean, less variance, so reuse against
it mixes the effect of reuse with that of the probabilities' variance.

Setting: `attention_reuse` (2-layer d=64 GPT, 400 steps, lr 3e-3, every
saved activation rounded stochastically with per-tensor scaling, kernels
e4m3 nearest, gradients e5m2 stochastic), with the saved activations in

  e4m3   float8_e4m3fn (the attention_reuse setting)
  e5m2   float8_e5m2: one mantissa bit fewer, more range
  e3m2   float6_e3m2fn: one mantissa bit fewer
  e2m1   float4_e2m1fn: two mantissa bits fewer

Each setting runs `reuse`, `redraw` and `outonly` on seed pairs 0, 1, 2
(same data, init and forward draws within a seed). Failure criterion, fixed
before the runs, for reuse against each copy `c` (`redraw` first, `outonly`
second): the setting fails when the mean over the three seeds of the final
validation loss of reuse minus `c` exceeds three times the standard
deviation over seeds of `c`'s final validation loss, or when a reuse run
diverges (non-finite loss, or a final validation loss above its initial
one) and its `c` pair does not. The table also gives `redraw` minus
`outonly` (the variance of the probabilities' rounding alone), and every
arm's pooled QKV gradient bias from the probe.

  python -m experiments.run --config configs/attention_reuse_search.py
  python -m scripts.make_tables attention_reuse_search
  python -m scripts.plot attention_reuse_search

CPU scale (default): 36 runs of 70 to 300 seconds each (plus
compilation), 100 minutes on 2 shared CPU cores. Expected (CPU scale,
measured on an AVX2 CPU): final validation loss reuse minus redraw +0.006
(e4m3), +0.022 (e5m2), +0.008 (e3m2), none failing (thresholds 0.08 to
0.11); at e2m1 +0.148 (per seed +0.104, +0.132, +0.207; threshold 0.074):
fails; reuse minus outonly +0.154 (fails), redraw minus outonly +0.006
(does not). Pooled QKV bias of reuse 3.5e-3, 1.3e-2, 1.3e-2, 0.44 (z =
+3.3, +3.3, +3.3, +1.5); of redraw at most 2.3e-3 (z <= +1.6); of outonly
0. docs/bwd_studies.md has the table and figure.
"""

from configs import attention_reuse

SETTINGS = {  # in order of increasing dose (the table's order)
  "e4m3": {"lowprec": {"fwd_format": "float8_e4m3fn"}},
  "e5m2": {"lowprec": {"fwd_format": "float8_e5m2"}},
  "e3m2": {"lowprec": {"fwd_format": "float6_e3m2fn"}},
  "e2m1": {"lowprec": {"fwd_format": "float4_e2m1fn"}},
}


def get_config(arg=None):
  c = attention_reuse.get_config(arg)
  c.study.name = "attention_reuse_search"
  c.study.analysis = "attention_search"
  c.study.figure = "search_dose_response"
  c.study.settings = tuple(SETTINGS)  # the table's order: increasing dose
  c.study.plan_arm = ""
  arms = {}
  for setting, overrides in SETTINGS.items():
    for kind, reads in attention_reuse.ARMS.items():
      arm = {k: dict(v) for k, v in overrides.items()}
      arm.setdefault("lowprec", {}).update(reads)
      arms[f"{setting}_{kind}"] = arm
  c.study.arms = arms
  # Fewer, smaller probes than attention_reuse (9 of 16 draws per run): the
  # search needs each setting's bias to within a factor, not its 4th digit.
  if c.study.scale != "smoke":
    c.train.probe_every_steps = 50
    c.train.probe_draws = 16
  if c.study.scale == "smoke":
    c.study.arms = {
      k: v for k, v in arms.items() if k.startswith(("e4m3_", "e2m1_"))
    }
  return c
