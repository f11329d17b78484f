"""Tables and figures of the studies, from their result files alone.

  runs            a result run directory, read lazily (`Run`, `load_runs`)
  tables          `make(study)`: the study's Markdown and CSV table
  freeze_tables   the freeze studies' analyses: rows and summary lines
  bwd_tables      the backward-state studies' analyses
  figures         `plot(study)`: the study's figure (PNG)
  freeze_panels   erased fraction and losses, one panel per run
  freeze_figures  scatter plots and curves of the freeze studies
  bwd_figures     probe curves and |z| plots of the backward-state studies
  plotting        what every figure shares: arm styles, loss axes, saving
                  legibly at page width, and the checks (`problems`)
  studies         the study configs in configs/ (`names`, `summaries`)
  reproduce       `reproduce(study)`: run every arm, then table and figure

`scripts/` holds their command-line wrappers (`python -m scripts.<name>`).
"""
