"""Optimizer state in low precision: AdamW's moments stored in bf16 / fp8.

Asks how much of the float32-state loss a run keeps when AdamW's moments
live on a low-precision grid between steps (`lowprec.store_state`, section
"Optimizer state storage" of the design): with b2 = 0.999 the second
moment's update `(1 - b2)(g^2 - nu)` is about 1e-3 of `nu` once `g^2 ~ nu`,
below half a bf16 gap, so nearest rounding stalls `nu` where stochastic
rounding keeps it right in the mean. Weights stay float32 in every arm.

Arms, each with seeds 0 and 1 (same init, data order and optimizer):
`fp32` (float32 state), `rn_bf16` (mu and nu bf16, nearest), `sr_bf16`
(both bf16, stochastic), `sr_fp8` (mu bf16 and nu float8_e5m2 with one
float32 scale per 128 elements, stochastic). The table gives each arm's
final validation loss minus the same seed's `fp32`, and the measured share
of state updates erased by storage over the second half of the run.

  python -m experiments.run --config configs/state_precision.py
  python -m scripts.make_tables state_precision

CPU scale (default): the small GPT of `freeze_small_gpt` (2 layers, d=64,
built-in corpus), AdamW lr 1e-3 with b2 = 0.999, 400 steps; 8 runs.
5.3 minutes on 2 CPU cores. Full scale (`:scale=full`): GPT-2 124M on
token files in data.path, 10000 steps.
Measured (CPU scale): final val loss minus the same seed's fp32 state:
rn_bf16 +0.0004 / +0.0008, sr_bf16 -0.0002 / -0.0026, sr_fp8 -0.0028 /
-0.0082 nats; state updates erased in the second half 0.341, 0.299,
0.491. The prediction made before the run (an erased share near 1 late
under nearest) did not hold at this scale.
"""

from configs import common, presets

ARMS = {
  "fp32": (),
  "rn_bf16": ("mu=bfloat16", "nu=bfloat16"),
  "sr_bf16": ("mu=bfloat16:stochastic", "nu=bfloat16:stochastic"),
  "sr_fp8": ("mu=bfloat16:stochastic", "nu=float8_e5m2:stochastic:block128"),
}


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "state_precision"
  c.study.analysis = "state"
  c.study.figure = "state_figure"
  c.study.seeds = (0, 1)
  c.opt.update(dict(lr=1e-3, b2=0.999, warmup_steps=20, min_lr_ratio=0.0))
  c.train.steps = 400
  c.train.eval_every_steps = 50
  c.ckpt.every_steps = 100
  c.log.progress_every_steps = 100
  arms = ARMS
  if c.study.scale == "full":
    presets.gpt2_124m_run(c)
  if c.study.scale == "smoke":
    common.shrink_to_smoke(c, 4)
    c.study.seeds = (0,)
    c.data.eval_batches = 2
    # Two arms: compiling the train step is most of a smoke run's time.
    arms = {k: ARMS[k] for k in ("fp32", "sr_bf16")}
  c.study.arms = {name: {"lowprec": {"state": s}} for name, s in arms.items()}
  return c
