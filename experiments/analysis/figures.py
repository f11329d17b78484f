"""Every study's figure, by the name its config declares.

`plot(study)` draws the figure the study's config names (`study.figure`, a
key of `FIGURES`, carried by every run's config.json) from its result files
and returns the path of the PNG (`results/<study>/tables/<study>.png` by
default). The freeze studies' figures are in `freeze_figures` (the default,
one panel per low-precision run, in `freeze_panels`), the backward-state
studies' in `bwd_figures`. Command line: `python -m scripts.plot <study>`.
"""

from __future__ import annotations

from experiments.analysis import (
  bwd_figures,
  freeze_figures,
  frontier,
  frontier_confirm,
)
from experiments.analysis.runs import declared, load_runs
from lowprec.grids import choices as names

FIGURES = {
  **freeze_figures.FIGURES,
  **bwd_figures.FIGURES,
  "frontier_figure": frontier.frontier_figure,
  "frontier_confirm": frontier_confirm.confirm_figure,
}


def plot(
  study: str,
  results: str = "results",
  out: str | None = None,
  figure: str | None = None,
) -> str:
  """Draws the figure the study declares (or `figure`); returns its path."""
  name = declared(load_runs(results, study), "figure", figure)
  names.check_choice("study.figure", name, FIGURES)
  return FIGURES[name](study, results, out)
