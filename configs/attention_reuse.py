"""Attention's backward reusing its rounded output vs a fresh rounding.

Reproduces: "in three pairs of 390M runs with an emulated FP8 backward,
training fails when attention's backward reuses the forward's rounded output
and succeeds with a new rounding from the same distribution"
(backward-state paper).

Numerics (both arms): saved activations (dense inputs, norm outputs,
attention probabilities and output, activation inputs) rounded to
`float8_e4m3fn` stochastically, kernels to `float8_e4m3fn` (nearest),
gradients entering the backward's matmuls to `float8_e5m2` stochastically,
all with per-tensor scaling (`lowprec.nn`). Every use reads what the
reference gradient reads except the row term of attention's backward,
`D = rowsum(dO * O)`, which must read the output of the unrounded
probabilities:

  reuse    `attn.out@delta=rounded`: the forward's rounded output `O~`, as
           a flash-attention backward that keeps its FP8 output does;
  redraw   `attn.out@delta=fresh` (`attn_fresh_out="redraw"`): a copy with
           the probabilities' and the output's roundings drawn anew, from
           the distribution of `O~` but independent of the forward;
  outonly  `attn.out@delta=fresh` with `attn_fresh_out="output"`: a new
           stochastic rounding of `P V` only (the same mean, less variance).

Seed pairs 0, 1, 2 (same data, init and forward draws within a pair). Every
`train.probe_every_steps` the gradient probe (experiments/probes.py)
compares, on a fixed batch and with each forward held fixed, the arm's
gradient of the attention QKV kernels with the reference gradient: cosine,
norm ratio and the bias left after the noise of the draws.

  python -m experiments.run --config configs/attention_reuse.py
  python -m scripts.reproduce attention_reuse   # runs, table and figure

CPU scale (default): 2-layer d=64 GPT on the byte-level built-in corpus,
400 steps, 21 probes of 32 forward draws per run; about 45 minutes for the
nine runs on 2 shared CPU cores. Full scale (`:scale=full`, this project's
choice of size): the 390M preset (27 layers, d=1024, 16 heads, 1024
tokens) on token files in data.path (`--config.data.path=...`), 20000
steps of 256 x 1024 tokens.
Expected (CPU scale, measured on an AVX2 CPU): reuse's QKV gradient is
biased, pooled over the three seeds' 60 probes z = +5.4 (relative bias
3.05e-3 rms, relative error 5.8e-3 at the last probe vs 2.5e-3 for
redraw); neither copy is (redraw z = +1.0, outonly z = +0.8); the loss
does not diverge at this scale: final validation loss reuse minus redraw
+0.0060 (per seed +0.0187, -0.0005, -0.0003).
"""

from configs import common, presets

# The arms' lowprec overrides: what attn.out@delta reads (on top of the
# reference policy, lowprec.ops.REFERENCE) and what its fresh read redraws.
ARMS = {
  "reuse": {"policy": "attn.out@delta=rounded"},
  "redraw": {"policy": "attn.out@delta=fresh", "attn_fresh_out": "redraw"},
  "outonly": {"policy": "attn.out@delta=fresh", "attn_fresh_out": "output"},
}


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "attention_reuse"
  c.study.analysis = "attention_reuse"
  c.study.figure = "attention_curves"
  c.study.plan_arm = "reuse"
  c.study.arms = {a: {"lowprec": dict(v)} for a, v in ARMS.items()}
  c.study.seeds = (0, 1, 2)
  c.lowprec.update(
    dict(
      fwd_format="float8_e4m3fn",
      fwd_rounding="stochastic",
      weight_format="float8_e4m3fn",
      bwd_format="float8_e5m2",
      bwd_rounding="stochastic",
    )
  )
  c.opt.update(dict(lr=3e-3, warmup_steps=20, min_lr_ratio=0.1))
  c.train.steps = 400
  c.train.eval_every_steps = 50
  c.train.probe_every_steps = 20
  c.train.probe_draws = 32
  c.train.probe_groups = "qkv=.*attn/qkv/kernel,all=.*"
  # Gradient rounding is unbiased: leaving it out of the probe keeps the
  # reads' bias and drops most of the noise.
  c.train.probe_grad_rounding = False
  c.ckpt.every_steps = 100
  c.log.progress_every_steps = 50
  if c.study.scale == "full":
    presets.gpt_390m_probe_run(c, probe_every_steps=100)
    c.log.progress_every_steps = 100
  if c.study.scale == "smoke":
    common.shrink_to_smoke(c, 4)
    c.study.seeds = (0,)
    c.train.probe_every_steps = 2
    c.train.probe_draws = 2
    c.log.progress_every_steps = 2
  return c
