"""Simulated int3 write-back replayed from saved checkpoints of a reference.

Reproduces: "Simulated-INT3 Study 3 replays six checkpoints and observes a
7.3071-nat (69.71%) validation-loss reduction in one fixed seed" (write-back
freeze paper, study 3).

Arms: `fp32_reference` trains a decoder in float32 and saves six evenly
spaced checkpoints. Each `int3_from_<step>` arm starts from one of them
(`train.init_from_arm` / `train.init_from_step`, parameters only, fresh
optimizer state), puts every tensor on an int3 grid `s * {-3..3}` with its own
power-of-two scale `s` (the smallest with `3 s >= max |w|`:
`lowprec.int_scale = 0`), and trains a fixed number of steps with stochastic
int3 write-back (no master weights). `rn_int3_from_<last>` does the same
with nearest write-back at the last checkpoint. The table gives, per
checkpoint, the fp32 validation loss there, the loss right after putting the
weights on the int3 grid (step 0 of the replay), the loss at the end of the
replay, and the change.

  python -m experiments.run --config configs/int3_replay.py
  python -m scripts.make_tables int3_replay

CPU scale (default): the small GPT of `freeze_small_gpt`; reference 300
steps, checkpoints every 50; replays of 100 steps; 8 runs in about 2
minutes on 2 CPU cores. Full scale (`:scale=full`): 12-layer d=768 decoder
on token files in data.path.
Expected (CPU scale): putting the weights on the int3 grids changes the
validation loss by -0.03 to +0.16 nats; stochastic int3 write-back then lowers
it at every checkpoint, by 0.79 nats (24.7%) from step 50 down to 0.19
nats (7.5%) from step 300 (mean 0.37 nats, 12.9%); nearest int3 write-back
erases every proposal: change 0.0000.
"""

from configs import common

REPLAY_ROUNDING = "stochastic"


def get_config(arg=None):
  c = common.get_config(arg)
  c.study.name = "int3_replay"
  c.opt.lr = 1e-3
  c.opt.warmup_steps = 20
  c.train.steps = 300
  c.train.eval_every_steps = 50
  c.ckpt.every_steps = 50
  replay_steps, replay_eval = 100, 25
  if c.study.scale == "full":
    c.model.update(dict(n_layer=12, d_model=768, n_head=12, seq_len=1024))
    c.model.vocab_size = 50304
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
  replay = {
    "opt": {"schedule": "constant", "warmup_steps": 0},
    "train": {
      "steps": replay_steps,
      "eval_every_steps": replay_eval,
      "init_from_arm": "fp32_reference",
    },
    "lowprec": {"writeback": "int3", "int_scale": 0.0},
    "ckpt": {"every_steps": replay_steps, "keep": 1},
  }
  arms = {"fp32_reference": {}}
  for s in starts:
    arms[f"int3_from_{s}"] = _with(replay, s, REPLAY_ROUNDING)
  arms[f"rn_int3_from_{starts[-1]}"] = _with(replay, starts[-1], "nearest")
  c.study.arms = arms
  return c


def _with(replay: dict, step: int, rounding: str) -> dict:
  out = {k: dict(v) for k, v in replay.items()}
  out["train"]["init_from_step"] = step
  out["lowprec"]["rounding"] = rounding
  out["study"] = {"cell": f"step {step}"}
  return out
