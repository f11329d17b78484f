"""Recommendations `python -m scripts.advise` wrote, one module per study
(`LOWPREC`: the per-group keys an arm takes)."""
