"""The experiment runner: a study config in, result files out.

The data path of `python -m experiments.run --config configs/<study>.py`:

  run          flags (absl), `--config.*` overrides, one call; `cli` turns
               user mistakes into one message and an exit status
  study        every arm x seed resolved (`resolve`), all checked before
               anything runs (`validate`: every named choice against the
               registry that builds it, `study.choices()`; sizes and
               cadences in `config_checks`), then each handed to its runner
  train        one arm x seed (`train_and_evaluate`): `ledger` opens the
               run directory (lock, config fingerprint, config.json,
               env.json), `tasks` builds model, loss and data (`models`,
               `data`), `optim` the optax chain (lowprec's transforms
               last, their arguments read from the `lowprec` section by
               `lowprec_config`), `checkpoint` saves and restores, `probes`
               measures gradients against the reference; the loop writes
               through `results` (metrics.jsonl, summary.json)
  analysis     tables and figures from the result files only (`tables`,
               `figures`, each study's analysis and figure named in its
               config: `study.analysis`, `study.figure`)

Beside it: `operator_checks` (a study kind with no training: audit.verify
on single operators), `distributed` (several processes), `faults` (fault
injection for the tests), `costs` (what the full-scale configs cost),
`goldens` (pinned reference values), `swiglu` (an operator of one's own
the tests and benchmarks share), `device_report`, `xla_flags`.

Where to change what: a format -> lowprec/grids/formats.py; a write-back
rule or transform -> lowprec/optim/writeback.py (a stored recipe on the
engine: docs/engine.md); an operator -> lowprec/backward/ops/ (its
requirements table beside it); a study -> one file in configs/ (its
analysis and figure registered in analysis/tables.py ANALYSES and
analysis/figures.py FIGURES); a model -> experiments/models.py and
configs/presets.py; a data set -> experiments/data/ (the `DATASETS`
registry).
"""
