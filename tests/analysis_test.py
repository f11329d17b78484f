"""The analysis package: readable tables, the freeze figure, thin scripts.

The analyses themselves are checked on hand-made result files in
studies_test.py and bwd_studies_test.py; here, what a reader sees.
"""

import glob
import json
import os
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest

from experiments.analysis import freeze_panels, freeze_tables, runs, tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(root, arm, rounding, records, writeback="bfloat16"):
  d = os.path.join(root, "s", arm, "seed0")
  os.makedirs(d)
  config = {
    "study": {
      "name": "s",
      "analysis": "freeze",
      "figure": "freeze_panels",
      "reference_arm": "ref" if writeback else "",
      "cell": "",
    },
    "lowprec": {"writeback": writeback, "rounding": rounding},
  }
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for rec in records:
      f.write(json.dumps(rec) + "\n")


def _study(root):
  """A float32 reference, a nearest and a stochastic run, 6 steps each."""
  n = 6
  erased = [0.1, 0.2, 0.6, 0.9, 0.9, 1.0]
  ref = [
    {
      "step": t,
      "val_loss": 3.0 - 0.2 * t,
      "pred/bfloat16/erased_fraction": erased[t - 1],
      "pred/bfloat16_sr/move_prob": 0.4,
    }
    for t in range(1, n + 1)
  ]
  _write(root, "ref", "nearest", ref, writeback="")
  for arm, rounding in [("rn", "nearest"), ("sr", "stochastic")]:
    e = erased if rounding == "nearest" else [0.6] * n
    recs = [
      {
        "step": t,
        "val_loss": 3.0 - (0.1 if rounding == "nearest" else 0.2) * t,
        "erased_fraction": e[t - 1],
        "proposals": 10,
        "moved": round(10 * (1 - e[t - 1])),
      }
      for t in range(1, n + 1)
    ]
    _write(root, arm, rounding, recs)
  return runs.load_runs(root, "s")


def test_stochastic_runs_show_no_crossing_as_a_freeze(tmp_path):
  rows, _ = freeze_tables.freeze_table(_study(str(tmp_path)))
  by = {r["arm"]: r for r in rows}
  assert by["rn"]["measured_crossing"] == "3 (post_init)"
  # Under SR the per-step share is above 0.5 from step 1, but no freeze.
  assert by["sr"]["measured_crossing"] == (
    "not a freeze (per-step share >= 0.5 from step 1)"
  )
  assert by["sr"]["predicted_crossing"] == "none (stochastic)"


def test_markdown_headings_are_words_and_cell_is_not_repeated(tmp_path):
  rows, lines = freeze_tables.freeze_table(_study(str(tmp_path)))
  md = tables.to_markdown("s", rows, lines)
  head = md.splitlines()[2]
  assert head.startswith("| arm | seed | format | write-back | final val loss")
  assert "| fp32 val loss |" in head and "| within 15% |" in head
  assert "cell" not in head and "_" not in head
  assert "| yes |" in md and "True" not in md  # booleans as words
  # The CSV keeps the row keys, for programs.
  tables.write_csv(str(tmp_path / "s.csv"), rows)
  with open(tmp_path / "s.csv") as f:
    assert f.readline().startswith("arm,cell,seed,format,rounding,")


@pytest.mark.parametrize(
  "key, words",
  [
    ("final_val_loss", "final val loss"),
    ("val_loss@150", "val loss at step 150"),
    ("after_100_steps", "after 100 steps"),
    ("val_minus_per_use", "val loss minus per_use"),
    ("qkv_last_rel_err", "qkv: rel. error, last"),
    ("qkv_rel_err", "qkv: rel. error, mean"),
    ("gain_bias_z", "gain: bias z"),
    ("per_use", "per_use"),  # an arm name stays as it is
  ],
)
def test_heading(key, words):
  assert tables.heading(key) == words


def test_freeze_figure_puts_validation_loss_beside_the_erased_fraction(
  tmp_path,
):
  fig = freeze_panels.figure(_study(str(tmp_path)))
  try:
    rn, sr = fig.axes[:2], fig.axes[2:]
    assert [a.get_ylabel() for a in rn] == [
      "erased fraction",
      "validation loss",
    ]
    legend = [t.get_text() for t in rn[1].get_legend().get_texts()]
    assert legend == ["fp32 reference (1.800)", "rn (2.400)"]
    assert len(rn[1].lines) == 3  # both losses and the measured crossing
    labels = [t.get_text() for t in sr[0].get_legend().get_texts()]
    assert "measured (stochastic; not a freeze)" in labels
    assert len(sr[1].lines) == 2  # no crossing marked under SR
  finally:
    plt.close(fig)


def test_no_script_edits_the_import_path():
  for path in glob.glob(os.path.join(ROOT, "scripts", "*.py")):
    with open(path) as f:
      assert "sys.path" not in f.read(), path


@pytest.mark.parametrize("name", ["make_tables", "plot", "reproduce"])
def test_analysis_scripts_parse_arguments_and_call_one_function(name):
  with open(os.path.join(ROOT, "scripts", f"{name}.py")) as f:
    text = f.read()
  assert "from experiments.analysis import" in text
  assert len(text.splitlines()) < 40


def test_make_tables_script_runs_as_a_module(tmp_path):
  _study(str(tmp_path))
  out = subprocess.run(
    [sys.executable, "-m", "scripts.make_tables", "s"]
    + ["--results", str(tmp_path)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr
  assert "| arm | seed | format | write-back |" in out.stdout
  assert (tmp_path / "s" / "tables" / "s.csv").exists()
