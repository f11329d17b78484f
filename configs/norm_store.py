"""Norm outputs stored in float8: which value the gain and the weight read.

Reproduces: "a normalization output stored in low precision feeds two
gradients: the gain's gradient needs the original, but the next layer's
weight gradient needs the rounded value that layer multiplied. Final loss
does not rule out the error of reading the original for both: it persists
in models trained with such a store, while planned loss comparisons stay
within a margin fixed in advance" (backward-state paper).

The decoder stores its saved activations, the norm outputs among them, in
`float8_e4m3fn` (round to nearest, per-tensor scale); weights and gradients
stay float32, so the only gradient errors are the reads. Arms (every other
use reads what the reference reads):

  per_use        norm.out@dgain=original, norm.out@dw=rounded: the
                 reference (exact);
  original_both  norm.out@dw=original: the gain reads the original, and so
                 does the next layer's weight gradient (the most accurate
                 copy, and wrong for dW);
  rounded_both   norm.out@dgain=rounded: both read the stored float8 value
                 (wrong for the gain).

The gradient probe (experiments/probes.py) measures during training, on a
fixed batch, the error of the gain gradients (`gain`: every norm_scale) and
of the weight gradients fed by a norm (`w`: the QKV and MLP-input kernels)
against the reference gradient. The planned loss comparison: each arm's
final validation loss minus per_use's, same seed, against the margin
`study.loss_margin`, fixed here before the runs.

  python -m experiments.run --config configs/norm_store.py
  python -m scripts.reproduce norm_store   # runs, table and figure

CPU scale (default): 2-layer d=64 GPT on the byte-level built-in corpus,
300 steps, seeds 0-2; about 4 minutes for the nine runs on 2 shared CPU
cores. Full scale (`:scale=full`): a 12-layer d=768 decoder on token files
in data.path (`--config.data.path=...`), 10000 steps.
Expected (CPU scale): per_use has no gradient error; original_both leaves
the gain gradients exact and gets the norm-fed weight gradients wrong by
1.2e-2 (relative, mean over the run; 1.1e-2 to 1.7e-2 at the last probe);
rounded_both gets the gain gradients wrong by 1.6e-2 (1.5e-2 to 2.8e-2 at
the end) and the weight gradients exact; the final validation losses stay
within the margin of per_use in 6 of 6 comparisons (differences +0.0049,
+0.0057, -0.0008 and +0.0039, +0.0046, -0.0000).
"""

from configs import common, presets

# Overrides of the reference policy (lowprec.ops.REFERENCE).
POLICIES = {
  "per_use": "",
  "original_both": "norm.out@dw=original",
  "rounded_both": "norm.out@dgain=rounded",
}


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "norm_store"
  c.study.analysis = "norm_store"
  c.study.figure = "norm_store_curves"
  c.study.arms = {a: {"lowprec": {"policy": p}} for a, p in POLICIES.items()}
  c.study.seeds = (0, 1, 2)
  # Fixed before the runs: final validation losses within this many nats of
  # per_use's (same seed) count as equivalent.
  c.study.loss_margin = 0.02
  c.lowprec.update(dict(fwd_format="float8_e4m3fn", fwd_rounding="nearest"))
  c.opt.update(dict(lr=3e-3, warmup_steps=20, min_lr_ratio=0.1))
  c.train.steps = 300
  c.train.eval_every_steps = 50
  c.train.probe_every_steps = 20
  c.train.probe_draws = 2  # nearest rounding, float32 gradients: no noise
  c.train.probe_groups = "gain=.*norm_scale,w=.*(qkv|fc)/kernel"
  c.ckpt.every_steps = 100
  c.log.progress_every_steps = 100
  if c.study.scale == "full":
    presets.gpt2_124m_run(c)
    c.train.probe_every_steps = 100
    c.train.probe_batch_size = 16
    c.log.progress_every_steps = 100
  if c.study.scale == "smoke":
    common.shrink_to_smoke(c, 4)
    c.study.seeds = (0,)
    c.train.probe_every_steps = 2
    c.log.progress_every_steps = 2
  return c
