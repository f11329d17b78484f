"""Grids: what a number may be and how a value lands on it.

Formats (`formats`: IEEE-like, float8, int grids; `scaled`: MX, NVFP4 and
per-tensor FP8 block-scaled formats), the roundings onto them (`rounding`:
nearest, stochastic, dead-zone on bit patterns), the counter-based random
bits they draw (`rng`), 8-bit and 4-bit code maps (`codemaps`), the names
and choices every layer validates against (`choices`), and the contract a
training step's low-precision arithmetic is checked against (`contract`).

Nothing here knows about optimizers, parameters or trees: each function
takes arrays and a format.

May import: nothing else in lowprec.
"""
