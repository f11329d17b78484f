"""Mantissa sweep e8m3..e8m10: the prediction transfers across models.

Reproduces the write-back freeze paper's claim, known from its Chinese
summary only (translated here, not the authors' wording): the condition
holds across frozen-feature regression, a mantissa-truncation simulator
spanning 128x in precision, small networks, and a CNN on MNIST: a computable
axis of low-precision training rather than diffuse noise.

Tasks: `regression` (a linear model on frozen random features, SGD),
`mlp` (one hidden layer on 8x8 digits, AdamW) and `cnn` (two conv layers on
digits, AdamW; MNIST at full scale). For each task an `<task>_fp32` arm
records the predicted erased fraction for the eight formats e8m3 ... e8m10
(3 to 10 mantissa bits: 128x in precision) in one float32 run, and an
`<task>_e8m<M>` arm per format trains with weights on that grid and nearest
write-back. Each (task, format) cell compares the predicted with the
measured crossing: 24 cells.

  python -m experiments.run --config configs/freeze_transfer.py
  python -m scripts.make_tables freeze_transfer

CPU scale (default): 300 steps per run, digits in place of MNIST (bundled
with scikit-learn, offline); 27 runs in about 2 minutes on 2 CPU cores.
Full scale (`:scale=full`): MLP and CNN on MNIST (IDX files in data.path),
3000 steps.
Expected (CPU scale): categories agree in 24/24 cells (2 at_init, 22
post-init); 20/22 post-init crossings within 15% (misses: regression e8m3,
CNN e8m7); macro RMSE 0.0217.
"""

from configs import common

MANTISSAS = tuple(range(3, 11))
TASKS = {
  "regression": {
    "model": {"kind": "regression"},
    "data": {"name": "regression", "batch_size": 32},
    "opt": {"name": "sgd", "lr": 0.01, "weight_decay": 0.0},
  },
  "mlp": {
    "model": {"kind": "mlp", "hidden": (64,)},
    "data": {"name": "digits", "batch_size": 32},
    "opt": {"lr": 3e-3},
  },
  "cnn": {
    "model": {"kind": "cnn", "channels": (8, 16)},
    "data": {"name": "digits", "batch_size": 32},
    "opt": {"lr": 3e-2},
  },
}


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "freeze_transfer"
  c.study.analysis = "transfer"
  c.study.figure = "transfer_scatter"
  mantissas = MANTISSAS if c.study.scale != "smoke" else (3, 10)
  tasks = dict(TASKS)
  if c.study.scale == "full":
    for task in ("mlp", "cnn"):
      tasks[task] = _merge(tasks[task], {"data": {"name": "mnist"}})
  arms = {}
  for task, over in tasks.items():
    formats = tuple(f"e8m{m}" for m in mantissas)
    arms[f"{task}_fp32"] = _merge(over, {"lowprec": {"trace_targets": formats}})
    for fmt in formats:
      arms[f"{task}_{fmt}"] = _merge(
        over,
        {
          "lowprec": {"writeback": fmt},
          "study": {"reference_arm": f"{task}_fp32", "cell": f"{task}/{fmt}"},
        },
      )
  c.study.arms = arms
  c.opt.update(dict(warmup_steps=0, min_lr_ratio=0.0, clip_norm=0.0))
  c.train.steps = 300
  c.train.eval_every_steps = 100
  c.train.virtual_shards = 0
  c.ckpt.every_steps = 300
  c.ckpt.keep = 1
  c.log.progress_every_steps = 300
  if c.study.scale == "full":
    c.train.steps = 3000
    c.train.eval_every_steps = 500
    c.ckpt.every_steps = 1000
    c.data.eval_batches = 20
  if c.study.scale == "smoke":
    c.train.steps = 4
    c.train.eval_every_steps = 2
    c.ckpt.every_steps = 4
  return c


def _merge(a: dict, b: dict) -> dict:
  out = {k: dict(v) for k, v in a.items()}
  for k, v in b.items():
    out[k] = {**out.get(k, {}), **v}
  return out
