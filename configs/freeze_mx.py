"""GPT with weights on a block-scaled (MX) grid after every step.

The setting of `freeze_gpt2_fp8` (nanoGPT's recipe, no master weights)
with the weights on a block-scaled grid: blocks of 32 along each kernel's
and embedding's last axis, one power-of-two (E8M0, OCP rule) scale per
block recomputed from the values written at every step
(`lowprec.writeback("mxfp8_e4m3")`). The gap at a coordinate is relative
to its block's maximum, not to the coordinate itself, and it moves when
that maximum moves. The fp32 reference's trace predicts, per step, the
share of proposals that nearest write-back onto that moving grid erases
(`q = FQ(w)`, erased iff `FQ(q + u) == q`, scales from `q + u`), and the
per-step move probability under stochastic write-back.

Arms: `fp32_reference` (float32; trace targets mxfp8_e4m3 and mxfp4_e2m1,
nearest and stochastic), `rn_mxfp8_e4m3` / `sr_mxfp8_e4m3` and
`rn_mxfp4_e2m1` / `sr_mxfp4_e2m1` (weights on the grid in float32
storage). NVFP4 is not an arm: write-back refuses it (its float32 scales
are not a fixed point of its own rounding; docs/scaled.md), and
`mxfp4_e2m1` has the same E2M1 elements under E8M0 scales. LayerNorm gains
and biases stay in float32, as in `freeze_gpt2_fp8`; write-back arms log
256 sampled coordinates' realized trajectories.

  python -m experiments.run --config configs/freeze_mx.py
  python -m scripts.reproduce freeze_mx   # runs, table and figure

CPU scale (default): a 2-layer d=64 GPT (byte-level built-in corpus), 300
steps, 3 seeds; 15 runs in about 12 minutes on 2 busy CPU cores.
Full scale (`:scale=full`): GPT-2 124M on token files in data.path, batch
512 x 1024 tokens, 5000 steps, as `freeze_gpt2_fp8`.
Expected (CPU scale, seeds 0/1/2): both RN arms cross at the first step
with proposals (step 2), predicted and measured `at_init`, every seed.
mxfp8_e4m3 RN erases 0.974-0.975 of the proposals at step 2 (predicted
equal within 1e-5), dips to 0.71-0.72 at the end of warmup (predicted
0.72-0.73; predicted within 0.017 of measured up to step 20), then rises
to 0.998 (predicted 0.985-0.988, the float32 trajectory having moved on);
mean erased fraction predicted 0.918-0.919, measured 0.947-0.950, curve
RMSE 0.034-0.038; 47-58% of the sampled grid coordinates never move, 91-92%
not in the second half. mxfp4_e2m1 RN erases 0.998-1.000 throughout
(predicted 0.996-0.998, RMSE 0.002); 99.2-99.6% never move. Stochastic
write-back: no persistent freeze; mean per-step share not moved predicted
0.858-0.859 / 0.980, measured 0.856-0.858 / 0.980-0.981 (mxfp8 / mxfp4);
0-0.4% / 2.8-4.4% of sampled coordinates never move. Final validation
loss: fp32 2.485 / 2.488 / 2.459; RN mxfp8_e4m3 4.284 / 4.274 / 4.178
(second-half change -0.04 to -0.05, fp32 -0.20 to -0.21); RN mxfp4_e2m1
5.144 / 5.158 / 5.055 (-0.01); SR mxfp8_e4m3 2.754 / 2.698 / 2.616; SR
mxfp4_e2m1 2.934 / 2.833 / 2.740.
"""

from configs import common, freeze_gpt2_fp8

FORMATS = {"mxfp8_e4m3": "mxfp8_e4m3", "mxfp4_e2m1": "mxfp4_e2m1"}


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "freeze_mx"
  c.study.analysis = "fp8"
  c.study.figure = "fp8_panels"
  c.study.plan_arm = "rn_mxfp8_e4m3"
  c.study.seeds = (0, 1, 2)
  c.study.arms = freeze_gpt2_fp8.make_arms(FORMATS)
  freeze_gpt2_fp8.use_setting(c)
  if c.study.scale == "smoke":
    c.study.seeds = (0,)
  return c
