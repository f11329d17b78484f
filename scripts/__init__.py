"""Command-line wrappers, run from the repository root as modules.

  python -m scripts.reproduce <study>     run a study, then table and figure
  python -m scripts.make_tables <study>   the table from existing results
  python -m scripts.plot <study>          the figure from existing results
  python -m scripts.bench [names]         benchmarks
  python -m scripts.prepare_text ...      token files from your own text
  python -m scripts.refresh_goldens --why "..."   rewrite tests/goldens.json

The logic lives in importable modules (`experiments.analysis`,
`experiments.data`); each script parses arguments and calls one function.
"""
