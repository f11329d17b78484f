"""Smoke study: a tiny GPT for a few steps, three arms, in seconds on a CPU.

  python -m experiments.run --config configs/smoke.py

Arms: `fp32_reference` (float32, reference trace predicting bf16 erasures),
`rn_bf16` (bf16-grid weights, nearest write-back), `sr_bf16` (stochastic).
Runtime: about 10 s per arm on a 2-core CPU. Expected: every arm finishes
with a finite loss near 5.5 (byte-level vocabulary of 256).
"""

from configs import common


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "smoke"
  c.study.arms = {
    "fp32_reference": {"lowprec": {"trace_targets": ("bfloat16",)}},
    "rn_bf16": {"lowprec": {"writeback": "bfloat16"}},
    "sr_bf16": {"lowprec": {"writeback": "bfloat16", "rounding": "stochastic"}},
  }
  c.model.seq_len = 32
  c.model.n_layer = 1
  c.model.d_model = 32
  c.data.batch_size = 16
  c.train.steps = 8
  c.train.eval_every_steps = 4
  c.ckpt.every_steps = 4
  c.log.progress_every_steps = 2
  return c
