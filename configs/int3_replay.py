"""Simulated int3 write-back replayed from saved checkpoints of a reference.

Reproduces: "Simulated-INT3 Study 3 replays six checkpoints and observes a
7.3071-nat (69.71%) validation-loss reduction in one fixed seed" (write-back
freeze paper, study 3).

The paper's 7.3071 nats being 69.71% puts its replays' start at about
10.48 nats and their end at 3.17, with a ~50k-token vocabulary (uniform
loss ln 50257 = 10.82): the start is near uniform. A 256-byte model cannot
lose 7.3 nats (its uniform loss is ln 256 = 5.55), so the table compares
the relative reduction `(L0 - L1) / L0`, with `L0` the validation loss
right after the weights are put on the int3 grid (replay step 0) and `L1`
at the end of the replay, and gives `L0 / ln V` to show how near uniform
each replay starts.

Arms: `fp32_reference` trains a decoder in float32 and saves six evenly
spaced checkpoints. Each replay starts from one of them
(`train.init_from_arm` / `train.init_from_step`: parameters only, fresh
optimizer state, the data stream continuing from that step), puts the
weights on an int3 grid `s * {-3..3}` and trains a fixed number of steps
with int3 write-back (no master weights), with stochastic and, from every
checkpoint, with nearest rounding. Two quantizers:

- per tensor (`int3_from_<step>`, `rn_int3_from_<step>`): every tensor on
  its own grid, `s` the smallest power of two with `3 s >= max |w|` of the
  tensor (`lowprec.int_scale = 0`, `int_scale_scope = "tensor"`); clips
  nothing, and a trained model loses little on it.
- one step for the model (`int3m_from_<step>`, `rn_int3m_from_<step>`):
  `s` the smallest power of two with `3 s >= max |w|` over every tensor on
  the grid (`int_scale_scope = "model"`), which zeroes every weight below
  `s / 2` and so starts the replay near uniform. The step is computed from
  each checkpoint when the replay starts, rather than fixed with
  `lowprec.int_scale` (which sets one step for every tensor but has to be
  known before the run, and the largest |w| moves between checkpoints).
  Norm gains and biases stay float32 here, as in the FP8 studies: with the
  gains (about 1) on the grid the step would be 0.5 and zero every weight
  below 0.25, expected to include all of the embeddings at this scale; a
  model with zero embeddings has an exactly zero gradient everywhere (a
  fixed point no rounding can leave).

The table gives, per quantizer and checkpoint, the fp32 loss there, `L0`,
`L0 / ln V`, per rounding `L1`, `L1 - L0` and the relative reduction, and
stochastic minus nearest `L1` (nats, and relative to `L0`).

  python -m experiments.run --config configs/int3_replay.py
  python -m scripts.make_tables int3_replay

CPU scale (default): the small GPT of `freeze_small_gpt`; reference 300
steps, checkpoints every 50; replays of 100 steps, constant lr 1e-3;
25 runs, 8.7 minutes on 2 CPU cores (busy with other work). Full scale
(`:scale=full`): 12-layer d=768 decoder on token files in data.path, ~50k
vocabulary, six checkpoints of a 6000-step reference, replays of 1000
steps.
Measured (CPU scale, seed 0, six checkpoints): one step for the model:
start 0.46 to 0.61 of ln V (mean 0.52: not near uniform), stochastic
reduction 9.5% to 29.8% (mean 17.3%), nearest 2.1% to 10.3% (mean 3.9%),
stochastic minus nearest -0.17 to -0.73 nats (mean -0.40); per tensor:
start 0.45 to 0.58 of ln V, stochastic 7.5% to 24.7% (mean 12.9%), nearest
exactly 0 at every checkpoint (every update erased).
"""

from configs import common, presets

NORMS_AND_BIASES = r".*/(norm_)?(bias|scale)"
# arm prefix -> (int_scale_scope, keep_float32)
QUANTIZERS = {"int3": ("tensor", ""), "int3m": ("model", NORMS_AND_BIASES)}
ROUNDINGS = {"": "stochastic", "rn_": "nearest"}


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "int3_replay"
  c.study.analysis = "replay"
  c.study.figure = "replay_curves"
  c.opt.lr = 1e-3
  c.opt.warmup_steps = 20
  c.train.steps = 300
  c.train.eval_every_steps = 50
  c.ckpt.every_steps = 50
  replay_steps, replay_eval = 100, 25
  if c.study.scale == "full":
    presets.use(c, "gpt2_124m_padded")
    c.data.update(dict(name="tokens", batch_size=64))
    c.opt.lr = 6e-4
    c.opt.warmup_steps = 500
    c.train.steps = 6000
    c.train.eval_every_steps = 1000
    c.ckpt.every_steps = 1000
    replay_steps, replay_eval = 1000, 250
  if c.study.scale == "smoke":
    common.shrink_to_smoke(c, 4)
    c.ckpt.every_steps = 2
    replay_steps, replay_eval = 2, 1
  c.ckpt.keep = 8  # every replayed checkpoint stays
  c.log.progress_every_steps = c.train.eval_every_steps
  every, total = c.ckpt.every_steps, c.train.steps
  starts = list(range(every, total + 1, every))
  arms = {"fp32_reference": {}}
  for prefix, (scope, keep) in QUANTIZERS.items():
    for tag, rounding in ROUNDINGS.items():
      for s in starts:
        arms[f"{tag}{prefix}_from_{s}"] = _replay(
          s, rounding, scope, keep, replay_steps, replay_eval
        )
  c.study.arms = arms
  return c


def _replay(step, rounding, scope, keep, steps, eval_every) -> dict:
  """One replay's overrides; the per-tensor ones as the study first had
  them (so that runs already made are kept)."""
  lowprec = {"writeback": "int3", "int_scale": 0.0, "rounding": rounding}
  if scope != "tensor":
    lowprec.update(int_scale_scope=scope, keep_float32=keep)
  return {
    "opt": {"schedule": "constant", "warmup_steps": 0},
    "train": {
      "steps": steps,
      "eval_every_steps": eval_every,
      "init_from_arm": "fp32_reference",
      "init_from_step": step,
    },
    "lowprec": lowprec,
    "ckpt": {"every_steps": steps, "keep": 1},
    "study": {"cell": f"step {step}"},
  }
