"""GPT-2 with weights on an FP8 grid after every step: freeze at init.

Reproduces the write-back freeze paper's claim, known from its Chinese
summary only (translated here, not the authors' wording): in a
124M-parameter GPT-2 transformer with weights constrained to an 8-bit
floating-point grid after every optimizer step, with no master weights, the
dense weights of both fp8 formats freeze at initialization -- predicted a
priori from the fp32 reference -- and validation loss plateaus while full
precision keeps improving. Stochastic rounding removes the persistent
freeze, which the same reference also predicts.

Arms: `fp32_reference` (float32; its trace predicts, for float8_e4m3fn and
float8_e5m2, the erased fraction under nearest write-back and the move
probability under stochastic write-back), `rn_e4m3` / `rn_e5m2` (weights on
the grid in float32 storage, nearest write-back, no master copy) and
`sr_e4m3` / `sr_e5m2` (stochastic write-back). The dense weights (token and
position embeddings, every kernel) are on the grid; LayerNorm gains and
biases (0.1% of GPT-2's parameters, 1.5% at CPU scale) stay in float32 as
in FP8 training recipes, and the prediction covers the same parameters
(`lowprec.keep_float32`). Write-back arms also log the realized trajectory
of 256 sampled coordinates, which shows which of them never move again.
Recipe of nanoGPT: init std 0.02, AdamW (lr 6e-4, betas 0.9/0.95, weight
decay 0.1), linear warmup, cosine to lr/10, gradient clipping at 1.

  python -m experiments.run --config configs/freeze_gpt2_fp8.py
  python -m scripts.reproduce freeze_gpt2_fp8   # runs, table and figure

CPU scale (default): the same recipe on a 2-layer d=64 GPT (byte-level
built-in corpus), 300 steps; 5 runs in about 2.5 minutes on 2 CPU cores.
Full scale (`:scale=full`): GPT-2 124M (exactly 124,439,808 parameters) on
token files in data.path (e.g. OpenWebText via scripts/prepare_text.py),
batch 512 x 1024 tokens, 5000 steps.
Expected (CPU scale): both RN arms cross at the first step with proposals
(step 2; the warmup's step 1 has lr 0), predicted and measured `at_init`;
e4m3fn erases every dense-weight proposal of the run (predicted and
measured mean 1.000), e5m2 0.959 predicted / 0.984 measured; 100%
(e4m3fn) and 64.5% (e5m2) of the sampled grid coordinates never move under
RN (98.4% of e5m2's not in the second half), 0% and 0.4% under SR;
final validation loss fp32 2.485, RN 5.13 / 4.83 (changes of -0.01 /
-0.03 over the second half, fp32 -0.21), SR 2.489 / 2.492.
"""

from configs import common, presets

FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def make_arms(formats: dict[str, str]) -> dict:
  """`fp32_reference` (its trace predicting every format, nearest and
  stochastic) and `rn_<short>` / `sr_<short>` write-back arms, from
  `{short name: format}`."""
  targets = tuple(formats.values())
  targets += tuple(f"{f}:stochastic" for f in formats.values())
  arms = {"fp32_reference": {"lowprec": {"trace_targets": targets}}}
  for rounding, prefix in (("nearest", "rn"), ("stochastic", "sr")):
    for short, fmt in formats.items():
      arms[f"{prefix}_{short}"] = {
        "lowprec": {
          "writeback": fmt,
          "rounding": rounding,
          "trace_targets": (fmt,),
          "trace_sample": 256,
        },
        "study": {"reference_arm": "fp32_reference", "cell": short},
      }
  return arms


def use_setting(c) -> None:
  """This study's training setting (nanoGPT's recipe; GPT-2 124M at full
  scale, the dense weights on the grid and norms and biases in float32),
  shared by the studies that run on the same GPT."""
  c.lowprec.keep_float32 = r".*/(norm_)?(bias|scale)"
  c.model.init_std = 0.02
  c.opt.update(dict(lr=6e-4, b1=0.9, b2=0.95, weight_decay=0.1))
  c.opt.update(dict(schedule="cosine", min_lr_ratio=0.1, clip_norm=1.0))
  c.opt.warmup_steps = 20
  c.train.steps = 300
  c.train.eval_every_steps = 25
  c.ckpt.every_steps = 100
  c.log.progress_every_steps = 50
  if c.study.scale == "full":
    presets.use(c, "gpt2_124m")
    c.data.update(dict(name="tokens", batch_size=512, eval_batches=20))
    # Microbatches of 8 x 1024 tokens: their activations (not the batch's)
    # are what a device holds (docs/scaling.md, scripts/plan_full_scale.py).
    c.train.virtual_shards = 64
    c.opt.warmup_steps = 500
    c.train.steps = 5000
    c.train.eval_every_steps = 250
    c.ckpt.every_steps = 500
  if c.study.scale == "smoke":
    common.shrink_to_smoke(c, 6)
    c.log.progress_every_steps = 3


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "freeze_gpt2_fp8"
  c.study.analysis = "fp8"
  c.study.figure = "fp8_panels"
  c.study.plan_arm = "rn_e4m3"
  c.study.arms = make_arms(FORMATS)
  use_setting(c)
  return c
