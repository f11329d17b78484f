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
  """Sets `c.model`'s shape (layers, heads, width, vocabulary, length)."""
  c.model.update(PRESETS[name])
