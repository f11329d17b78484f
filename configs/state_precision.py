"""Optimizer state in low precision: AdamW's moments stored in bf16 / fp8.

Asks how much of the float32-state loss a run keeps when AdamW's moments
live on a low-precision grid between steps (`lowprec.store_state`, section
"Optimizer state storage" of the design): with b2 = 0.999 the second
moment's update `(1 - b2)(g^2 - nu)` is about 1e-3 of `nu` once `g^2 ~ nu`,
below half a bf16 gap, so nearest rounding stalls `nu` where stochastic
rounding keeps it right in the mean; and whether one float32 run predicts
the share of state updates each store erases (`lowprec.freeze.state_trace`).

Two weight settings, each with four ways to keep the moments, seeds 0-2
(same init, data order and optimizer):

  weights float32             fp32, rn_bf16, sr_bf16, sr_fp8
  weights bfloat16, SR        bf16w_fp32, bf16w_rn_bf16, bf16w_sr_bf16,
  write-back (no master)      bf16w_sr_fp8

`fp32`: float32 moments; its trace predicts, for the three stores, the
erased share of each moment's updates. `rn_bf16`: mu and nu bf16, nearest.
`sr_bf16`: both bf16, stochastic. `sr_fp8`: mu float8_e4m3fn and nu
float8_e5m2, each with one float32 scale per 128 elements, stochastic. The
table gives each arm's final validation loss minus its setting's float32
state (same seed), the erased share of mu's and nu's updates over the
second half, predicted (from the setting's float32-state run) and
measured, bytes per parameter of weights and state, and steps/s.

  python -m experiments.run --config configs/state_precision.py
  python -m scripts.make_tables state_precision

CPU scale (default): the small GPT of `freeze_small_gpt` (2 layers, d=64,
built-in corpus), AdamW lr 1e-3 with b2 = 0.999, 400 steps; 24 runs,
18 minutes on 2 CPU cores. Full scale (`:scale=full`): GPT-2 124M on
token files in data.path, 10000 steps.
Measured (CPU scale, 3 seeds; docs/state.md has the table): nu updates
erased over the second half, measured / predicted: rn_bf16 0.670 / 0.668,
sr_bf16 0.588 / 0.590, sr_fp8 0.972 / 0.974 (mu 0.010, 0.010, 0.118,
predicted within 0.001); final val loss minus float32 state +0.0006,
-0.0010, -0.0060 nats (bf16 weights: +0.0006, -0.0012, -0.0060).
"""

from configs import common, presets

STORES = {
  "rn_bf16": ("mu=bfloat16", "nu=bfloat16"),
  "sr_bf16": ("mu=bfloat16:stochastic", "nu=bfloat16:stochastic"),
  "sr_fp8": (
    "mu=float8_e4m3fn:stochastic:block128",
    "nu=float8_e5m2:stochastic:block128",
  ),
}
# Weight settings: arm-name prefix -> lowprec overrides of the weights.
WEIGHTS = {
  "": {},
  "bf16w_": {"writeback": "bfloat16", "rounding": "stochastic"},
}


def targets() -> tuple[str, ...]:
  """Every store as a `lowprec.state_targets` entry, named as its arm."""
  return tuple(f"{n}: {'; '.join(r)}" for n, r in STORES.items())


def arms() -> dict:
  out = {}
  for prefix, weights in WEIGHTS.items():
    ref = f"{prefix}fp32"
    out[ref] = {"lowprec": {**weights, "state_targets": targets()}}
    for name, rules in STORES.items():
      out[prefix + name] = {
        "lowprec": {**weights, "state": rules},
        "study": {"reference_arm": ref, "cell": name},
      }
  return out


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "state_precision"
  c.study.analysis = "state"
  c.study.figure = "state_figure"
  c.study.seeds = (0, 1, 2)
  c.opt.update(dict(lr=1e-3, b2=0.999, warmup_steps=20, min_lr_ratio=0.0))
  c.train.steps = 400
  c.train.eval_every_steps = 50
  c.ckpt.every_steps = 100
  c.log.progress_every_steps = 100
  all_arms = arms()
  if c.study.scale == "full":
    presets.gpt2_124m_run(c)
  if c.study.scale == "smoke":
    common.shrink_to_smoke(c, 4)
    c.study.seeds = (0,)
    c.data.eval_batches = 2
    # Two arms: compiling the train step is most of a smoke run's time.
    all_arms = {k: all_arms[k] for k in ("bf16w_fp32", "bf16w_sr_fp8")}
  c.study.arms = all_arms
  return c
