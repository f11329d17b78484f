"""Model shapes the full-scale configs share.

`use(c, name)` sets `c.model`'s shape keys to a preset. `gpt2_124m` is GPT-2
small exactly (124,439,808 parameters with tied embeddings); the `_padded`
variants round the vocabulary up to a multiple of 64 (50304), as decoders
trained on GPT-2 tokens commonly do; `gpt_390m` is this project's 390M
decoder (27 layers of width 1024).
"""

from __future__ import annotations

PRESETS = {
  "gpt2_124m": dict(
    n_layer=12, n_head=12, d_model=768, vocab_size=50257, seq_len=1024
  ),
  "gpt2_124m_padded": dict(
    n_layer=12, n_head=12, d_model=768, vocab_size=50304, seq_len=1024
  ),
  "gpt_390m": dict(
    n_layer=27, n_head=16, d_model=1024, vocab_size=50304, seq_len=1024
  ),
}


def use(c, name: str) -> None:
  """Sets `c.model`'s shape (layers, heads, width, vocabulary, length),
  with its blocks compiled once (`model.scan_layers`), stored stacked and
  attention fused where the arm allows them (`model.layer_storage`,
  `model.fused_attention`)."""
  c.model.update(PRESETS[name])
  c.model.scan_layers = True
  c.model.fused_attention = True
  c.model.layer_storage = "auto"


def gpt_390m_probe_run(c, probe_every_steps: int) -> None:
  """The 390M GPT on token files, 20000 steps of 256 x 1024 tokens (AdamW
  at 3e-4, 1000 warmup), evaluated every 500 steps and checkpointed every
  1000, with the lean gradient probe every `probe_every_steps`: the
  full-scale run of the backward-state training studies."""
  use(c, "gpt_390m")
  c.data.update(dict(name="tokens", batch_size=256, eval_batches=20))
  # Microbatches of 4 x 1024 tokens: their activations (not the batch's)
  # are what a device holds (docs/scaling.md, scripts/plan_full_scale.py).
  c.train.virtual_shards = 64
  c.opt.update(dict(lr=3e-4, warmup_steps=1000))
  c.train.steps = 20000
  c.train.eval_every_steps = 500
  c.train.probe_every_steps = probe_every_steps
  c.train.probe_draws = 4
  c.train.probe_batch_size = 8
  c.train.probe_chunk_rows = 1  # memory of one row's backward, not eight
  c.train.probe_lean = True  # one backward pass compiled and live at once
  c.ckpt.every_steps = 1000


def gpt2_124m_run(c) -> None:
  """GPT-2 124M on token files, 10000 steps of AdamW at 6e-4 (500 warmup),
  evaluated every 500 steps and checkpointed every 1000: the full-scale
  run of the studies that train that model from scratch."""
  use(c, "gpt2_124m_padded")
  c.data.update(dict(name="tokens", batch_size=256, eval_batches=20))
  c.opt.update(dict(lr=6e-4, warmup_steps=500))
  c.train.steps = 10000
  c.train.eval_every_steps = 500
  c.ckpt.every_steps = 1000
