"""Remedies for write-back freezing, with weights on an FP8 grid.

The arms of `configs/remedies.py` (float32, mixed precision, nearest,
stochastic and dead-zone write-back, Kahan with a bfloat16 and with a
float8_e5m2 buffer, two-component; not the remainder, which splits a
float32 master into a bfloat16 view) with the dense weights on
float8_e4m3fn, in the setting of `freeze_gpt2_fp8` (nanoGPT's recipe on
the small GPT; norms and biases float32), where nearest write-back freezes
at the first step. Bytes per parameter: e4m3 weights 1, a bfloat16 buffer
2, an e5m2 buffer 1, the two-component error term 1, AdamW's moments 8.

  python -m experiments.run --config configs/remedies_fp8.py
  python -m scripts.make_tables remedies_fp8

CPU scale (default): 8 arms x 3 seeds of 300 steps of the 2-layer d=64
GPT on the built-in corpus; 6 minutes on 2 CPU cores (with a compilation
cache). Full scale (`:scale=full`): GPT-2 124M on token files in
data.path.
Measured (CPU scale, 3 seeds; docs/freeze_studies.md has the table):
nearest freezes at the first step (val loss 5.120 against 2.478); a bf16
buffer, stochastic and dead-zone rounding recover 1.001 of the gap, an
e5m2 buffer 0.967; the two-component pair 0.000: its e4m3 error term
rounds every residual to 0 (lost fraction 1.000, predicted 1.000 by the
float32 arm).
"""

from configs import common, freeze_gpt2_fp8, remedies


def get_config(arg=None):
  c = common.get_config(arg)
  freeze_gpt2_fp8.use_setting(c)
  remedies.use_study(
    c, "remedies_fp8", remedies.arms("float8_e4m3fn", remainder=False)
  )
  return c
