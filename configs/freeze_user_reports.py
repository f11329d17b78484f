"""The freezes users report in bf16 training, predicted from a float32 run.

Users of pure bf16 training report RMSNorm gains that "remain all 1 and
seem not to get updated" after pretraining (fla-org/flame issue 47). A gain
of exactly 1.0 in bf16 has a gap of 2^-7 above and 2^-8 below, so nearest
write-back erases every AdamW proposal under 2^-8 up or 2^-9 down; with
lr 6.5e-4 Adam's proposals (at most about lr) and decoupled weight decay's
(`-lr * wd * w`, 6.5e-5 at a gain of 1) are all under that.

A small GPT with RMSNorm, every parameter on the bf16 grid (norm gains,
biases and embeddings included; float32 storage, no master weights), AdamW
(weight decay 0.1 on every tensor, optax's default) with warmup and cosine
decay. Arms: `fp32_reference` (float32 weights; its reference trace
predicts, per tensor, the coordinates a nearest bf16 run would leave at
their initial value, and `decay_erasure` which erased proposals would be
weight decay only), `nearest`, `stochastic` and `deadzone` bf16 write-back.
Per group of tensors (norm gains, embeddings, attention kernels, MLP
kernels, biases), `make_tables` reports the share of coordinates still at
their initial value at steps 50, 100, 200 and 400, predicted (reference
trace) and measured (`lowprec.freeze.stuck` on each run's checkpoints
against its initial params), and the share of erased proposals that are
weight decay only (gradient part zero or erased alone), predicted and
measured in the nearest run, over the run.

  python -m experiments.run --config configs/freeze_user_reports.py
  python -m scripts.make_tables freeze_user_reports  # and scripts.plot
  python -m scripts.reproduce freeze_user_reports     # all three

CPU scale (default): 2-layer GPT, d=64, byte-level built-in corpus, 400
steps; about 3 minutes for the four arms on 2 CPU cores. Expected (CPU
scale, seed 0; measured):
- norm gains under nearest write-back: every one still 1.0 at steps 50,
  100, 200 and 400, predicted 1.0 by the float32 trace;
- every group's predicted share within 0.05 of the measured one at every
  step (largest difference 0.0040, attention kernels at step 100);
- erased proposals that are weight decay only: 0.993 to 1.0 in every
  group, predicted within 0.004;
- stochastic / dead-zone write-back: no group stuck, norm gains never
  seen away from 1.0 0.228 / 0.222 at step 50, 0.016 / 0.013 at step 400,
  kernels and embeddings 0;
- final validation loss fp32 2.384, nearest 2.495, stochastic 2.383,
  dead-zone 2.362.
"""

from configs import freeze_small_gpt

GROUPS = (
  (r".*norm_scale", "norm gains"),
  (r"wte/embedding|wpe", "embeddings"),
  (r".*attn/.*/kernel", "attention kernels"),
  (r".*mlp/.*/kernel", "MLP kernels"),
  (r".*bias", "biases"),
)
STEPS = (50, 100, 200, 400)


def get_config(arg=None):
  # The small GPT, schedule and scales of freeze_small_gpt, with RMSNorm.
  c = freeze_small_gpt.get_config(arg)
  c.study.name = "freeze_user_reports"
  c.study.analysis = "user_reports"
  c.study.figure = "user_reports_panels"
  # What the analysis reads (from each run's config.json): the groups of
  # parameters, as (regex, name), and the checkpoint steps reported.
  c.study.groups = GROUPS
  c.study.report_steps = STEPS
  reference = {"study": {"reference_arm": "fp32_reference"}}
  c.study.arms = {
    "fp32_reference": {
      "lowprec": {
        "trace_targets": ("bfloat16",),
        "trace_at_init": True,
        "decay_erasure": True,
      }
    },
    "nearest": {
      "lowprec": {"writeback": "bfloat16", "decay_erasure": True},
      **reference,
    },
    "stochastic": {
      "lowprec": {"writeback": "bfloat16", "rounding": "stochastic"},
      **reference,
    },
    "deadzone": {
      "lowprec": {"writeback": "bfloat16", "rounding": "deadzone"},
      **reference,
    },
  }
  c.model.norm = "rmsnorm"
  c.ckpt.keep = 100
  # The steps at which the shares are measured.
  c.ckpt.every_steps = {"full": 500, "smoke": 3}.get(c.study.scale, 50)
  return c
