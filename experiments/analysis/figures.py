"""Every study's figure, by study name.

`plot(study)` draws the study's figure from its result files and returns
the path of the PNG (`results/<study>/tables/<study>.png` by default). The
freeze studies' figures are in `freeze_figures` (their default, one panel
per low-precision run, in `freeze_panels`), the backward-state studies' in
`bwd_figures`. Command line: `python -m scripts.plot <study>`.
"""

from __future__ import annotations

from experiments.analysis import bwd_figures, freeze_figures, freeze_panels

# study -> plot function (study, results, out=None) -> path of the PNG
PLOTS = {**freeze_figures.PLOTS, **bwd_figures.PLOTS}


def plot(study: str, results: str = "results", out: str | None = None) -> str:
  """Draws the study's figure; the default is the per-run freeze panels."""
  return PLOTS.get(study, freeze_panels.plot)(study, results, out)
