"""The storage engine: one way to write a value into stored bits, and to
count what the write did.

`codec` encodes a value into a grid's stored dtype (and decodes it) under a
`Codec` (format, rounding, overflow; scaled formats with their scales);
`weights` puts parameter trees on their grids and applies updates;
`leafwise` runs a write per leaf; `counting` tallies moved, saturated,
non-finite and stalled coordinates; `rules` maps parameter paths to specs;
`record` keeps static recipe metadata on states. See `docs/engine.md`.

May import: lowprec.grids.
"""
