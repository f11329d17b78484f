"""The controlled two-layer grid: 72 cells, predicted vs measured crossings.

Reproduces: "In a controlled two-layer grid, 55/72 cells have measured and
predicted post-initialization crossings: times span 384x, 52/55 are within
15%, and 4/72 differ in category" (write-back freeze paper).

A two-layer perceptron (one hidden ReLU layer) on the 8x8 digits, Adam
without weight decay or clipping, no warmup. Cells: hidden width
{32, 128, 512} x learning rate {1e-3, 3e-3, 1e-2, 3e-2} x format {e8m5,
e8m6, bfloat16} x schedule {cosine to 0 over the run, constant} = 72. Per
(width, lr, schedule) one float32 arm `ref_<...>` records the predicted
erased fraction of the three formats in one run; per cell one arm trains
with the weights on the format's grid and nearest write-back.

The run is long enough for the span to be measured: a post-init crossing
is at step 2 or later, so a run of T steps caps the span at T/2 (300 steps:
150x, below the paper's 384x; 800 steps: 400x). The table also counts the
cells that cross at step 2: Adam's first update is +-lr (up to eps) at every
coordinate (m / sqrt(v) = g / |g| after bias correction) and the second
about lr, so a crossing there says the grid gap at the initial weights
decides, not the trajectory; it gives the span over all post-init
crossings and over those after step 2.

  python -m experiments.run --config configs/freeze_grid.py
  python -m scripts.make_tables freeze_grid

CPU scale (default): 800 steps, batch 32; 96 runs, 14 minutes on 2 CPU
cores (busy with other work; an XLA compilation cache shared by the runs).
Full scale (`:scale=full`): MNIST (IDX files in data.path), 3000 steps
(span cap 1500x).
Measured (CPU scale): 68/72 cells with predicted and measured post-init
crossings; measured crossing steps span 398x (step 2 to 795: the run's
400x cap, so the span is the run length's, not the grid's); 6/68 cross at
step 2 (predicted 6/68); the 62 after step 2 span 132x (step 6 to 795);
59/68 within 15% of the prediction; 2/72 categories differ; macro RMSE of
the erased fraction 0.0284, skill 0.802 against the leave-one-out curve.
"""

from configs import common

WIDTHS = (32, 128, 512)
LRS = (1e-3, 3e-3, 1e-2, 3e-2)
FORMATS = ("e8m5", "e8m6", "bfloat16")
SCHEDULES = ("cosine", "constant")


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "freeze_grid"
  c.study.analysis = "grid"
  c.study.figure = "crossing_scatter"
  widths, lrs, formats, schedules = WIDTHS, LRS, FORMATS, SCHEDULES
  if c.study.scale == "smoke":
    widths, lrs, formats, schedules = (16,), (1e-2,), FORMATS[::2], ("cosine",)
  arms = {}
  for w in widths:
    for lr in lrs:
      for sched in schedules:
        tag = f"w{w}_lr{lr:.0e}_{sched}"
        base = {"model": {"hidden": (w,)}, "opt": {"lr": lr, "schedule": sched}}
        arms[f"ref_{tag}"] = {**base, "lowprec": {"trace_targets": formats}}
        for fmt in formats:
          arms[f"{fmt}_{tag}"] = {
            **base,
            "lowprec": {"writeback": fmt},
            "study": {
              "reference_arm": f"ref_{tag}",
              "cell": f"w{w}/lr{lr:g}/{fmt}/{sched}",
            },
          }
  c.study.arms = arms
  c.model.kind = "mlp"
  c.data.update(dict(name="digits", batch_size=32))
  c.opt.update(dict(warmup_steps=0, min_lr_ratio=0.0))
  c.opt.update(dict(weight_decay=0.0, clip_norm=0.0))
  c.train.steps = 800  # a post-init crossing is >= step 2: span <= 400x
  c.train.eval_every_steps = 800
  c.train.virtual_shards = 0  # single device: the plain mean gradient
  c.ckpt.every_steps = 800
  c.ckpt.keep = 1
  c.log.progress_every_steps = 800
  if c.study.scale == "full":
    c.data.update(dict(name="mnist", batch_size=64, eval_batches=20))
    c.train.steps = 3000
    c.train.eval_every_steps = 1000
    c.ckpt.every_steps = 1000
  if c.study.scale == "smoke":
    c.train.steps = 6
    c.train.eval_every_steps = 6
    c.ckpt.every_steps = 6
  return c
