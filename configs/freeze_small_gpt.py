"""Write-back freeze of a small GPT with bf16-equivalent weights.

Reproduces the write-back freeze paper's claim, known from its Chinese
summary only (translated here, not the authors' wording): in a small GPT
trained with standard AdamW plus cosine, with weights stored as
bf16-equivalent values, training proceeds normally, then freezes permanently
just past mid-run, within four steps of the a-priori prediction.

Arms: `fp32_reference` (float32 weights; `reference_trace` predicts the
bf16 erased fraction of every step), `rn_bf16` (weights on the bf16 grid in
float32 storage, nearest write-back, no master copy), `sr_bf16` (stochastic
write-back). The predicted crossing (erased fraction >= 0.5 from then on) of
the reference is compared with the measured crossing of `rn_bf16`.

  python -m experiments.run --config configs/freeze_small_gpt.py
  python -m scripts.make_tables freeze_small_gpt

CPU scale (default): 2-layer GPT, d=64, byte-level built-in corpus, 400
steps; about 3 minutes for the three arms on 2 CPU cores. Full scale
(`:scale=full`): 6 layers, d=384, 5000 steps on token files in data.path.
Expected (CPU scale): rn_bf16 crosses just past mid-run and within 4 steps of
the predicted crossing; sr_bf16 never crosses and ends with a lower loss.
"""

from configs import common


def use_setting(c) -> None:
  """This study's training setting (AdamW, 400 steps; its full-scale
  decoder), shared by the studies that run on the same small GPT."""
  c.opt.lr = 6.5e-4
  c.opt.min_lr_ratio = 0.0
  c.opt.warmup_steps = 20
  c.train.steps = 400
  c.train.eval_every_steps = 50
  c.ckpt.every_steps = 100
  c.log.progress_every_steps = 50
  if c.study.scale == "full":
    c.model.update(dict(n_layer=6, d_model=384, n_head=6, seq_len=256))
    c.data.update(dict(name="tokens", batch_size=64))
    c.model.vocab_size = 50304
    c.train.steps = 5000
    c.train.eval_every_steps = 250
    c.ckpt.every_steps = 500


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "freeze_small_gpt"
  c.study.arms = {
    "fp32_reference": {
      "lowprec": {"trace_targets": ("bfloat16", "bfloat16:stochastic")}
    },
    "rn_bf16": {
      "lowprec": {"writeback": "bfloat16"},
      "study": {"reference_arm": "fp32_reference"},
    },
    "sr_bf16": {
      "lowprec": {"writeback": "bfloat16", "rounding": "stochastic"},
      "study": {"reference_arm": "fp32_reference"},
    },
  }
  use_setting(c)
  if c.study.scale == "smoke":
    c.train.steps = 6
    c.train.eval_every_steps = 3
  return c
