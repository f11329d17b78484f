"""The analysis package: readable tables, the freeze figure, thin scripts.

The analyses themselves are checked on hand-made result files in
studies_test.py and bwd_studies_test.py; here, what a reader sees.
"""

import glob
import json
import math
import os
import re
import subprocess
import sys
import warnings

import matplotlib.pyplot as plt
import pytest

from experiments.analysis import (
  freeze_figures,
  freeze_panels,
  freeze_tables,
  plotting,
  runs,
  tables,
)

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
    ("val_minus_per_use", "val loss minus `per_use`"),  # an arm's name
    ("qkv_last_rel_err", "qkv: rel. error, last"),
    ("qkv_rel_err", "qkv: rel. error, mean"),
    ("gain_bias_z", "gain: bias z"),
    ("bytes_per_param", "bytes / param"),
    ("steps_per_s", "steps / s"),
    ("mu_erased_2nd_half", "mu updates erased, 2nd half"),
    ("nu_predicted_2nd_half", "nu updates erased, 2nd half, predicted"),
    ("step_time_vs_nearest", "step time / nearest's"),
    ("reuse_minus_outonly_threshold", "reuse - outonly, threshold (3 sd of "
     "outonly)"),
    ("some_new_key", "some new key"),  # a key no rule knows, in words
  ],
)  # fmt: skip
def test_heading(key, words):
  assert tables.heading(key) == words


# A snake_case identifier outside backticks: a row key, not words.
IDENTIFIER = re.compile(r"[A-Za-z0-9]_[A-Za-z0-9]")


def unworded(headings) -> list[str]:
  """The headings that hold an identifier outside backticks."""
  return [h for h in headings if IDENTIFIER.search(re.sub(r"`[^`]*`", "", h))]


def test_every_known_row_key_has_a_worded_heading():
  keys = [*tables.HEADINGS, "val_minus_fp32", "val_loss@150"]
  keys += [f"{m}_{k}_2nd_half" for m in ("mu", "nu") for k in ("erased",
           "predicted")]  # fmt: skip
  for a, b in (("reuse", "redraw"), ("redraw", "outonly")):
    keys += [f"{a}_minus_{b}{s}" for s in ("", "_per_seed", "_threshold",
             "_fails")]  # fmt: skip
  keys += [f"h_0_{s}" for s in ("1-cos", "rel_err", "last_rel_err", "bias_z")]
  assert unworded(tables.heading(k) for k in keys) == []
  assert unworded(["bytes_per_param", "a `per_use` b"]) == ["bytes_per_param"]


def test_pipes_in_headings_and_cells_are_escaped():
  rows = [{"error": 0.5, "note": "a | b"}]
  head, _, row = tables.to_markdown("s", rows, []).splitlines()[2:5]
  assert head == "| \\|predicted - nearest\\| | note |"
  assert row == "| 0.5 | a \\| b |"


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


# ---------------------------------------------------------------- figures


def _figure(width=6.0):
  fig, ax = plt.subplots(figsize=(width, 4))
  ax.plot([0, 1, 2], [1.0, 2.0, 3.0], label="a")
  ax.set_title("a title")
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  return fig, ax


def _problems(fig):
  try:
    return plotting.problems(fig)
  finally:
    plt.close(fig)


def test_a_clean_figure_has_no_problems():
  fig, _ = _figure()
  fig.set_layout_engine("constrained")
  assert _problems(fig) == []


@pytest.mark.parametrize(
  "spoil, needle",
  [
    (lambda fig, ax: ax.set_ylim(1.5, 3.5), "outside the axes"),
    (lambda fig, ax: ax.plot([0, 1, 2], [1.0, 2.0, 3.0]), "hidden under"),
    (lambda fig, ax: fig.add_subplot(2, 2, 4), "nothing drawn"),
    (lambda fig, ax: fig.text(0.97, 0.5, "a long note"), "cut at the"),
    (lambda fig, ax: ax.set_title("a title", fontsize=4), "px high"),
    (lambda fig, ax: ax.text(0.5, 1.01, "a second title", ha="center",
     transform=ax.transAxes), "overlap"),
  ],
  ids=["point-off-axes", "hidden-line", "empty-panel", "cut-text",
       "tiny-text", "overlap"],
)  # fmt: skip
def test_problems_finds_what_a_reader_cannot_read(spoil, needle):
  fig, ax = _figure()
  spoil(fig, ax)
  found = _problems(fig)
  assert any(needle in p for p in found), found


def test_save_raises_small_text_and_wraps_long_labels(tmp_path):
  fig, ax = _figure(width=14.0)  # shown at half size: 10 pt is too small
  ax.set_ylabel("a very long label that could never fit beside the axes " * 2)
  with warnings.catch_warnings():
    warnings.simplefilter("error", plotting.IllegibleFigure)
    path = plotting.save(fig, str(tmp_path / "f.png"))
  assert os.path.getsize(path) > 1000
  assert "\n" in ax.get_ylabel()
  assert ax.title.get_fontsize() >= 10 * 14 * 72 / 760 * 8 / 72 * 0.99


def _run(root, study, arm, config, records, summary=None):
  d = os.path.join(root, study, arm, "seed0")
  os.makedirs(d)
  base = {
    "study": {"name": study, "reference_arm": "", "cell": ""},
    "lowprec": {"writeback": "", "rounding": "nearest", "state": []},
  }
  for k, v in config.items():
    base[k] = {**base[k], **v}
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(base, f)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  with open(os.path.join(d, "summary.json"), "w") as f:
    json.dump(summary or {"steps_per_s": 5.0}, f)


def _losses(steps):
  """A validation loss that falls fast, then flattens (as trained models'
  do), every 50 steps (every 2 at smoke scale)."""
  every = 2 if steps < 50 else 50
  return [
    {"step": t, "val_loss": 2.4 + 3.1 * math.exp(-t / 30)}
    for t in range(0, steps, every)
  ]


def _state_study(root, steps):
  """Two arms with the same losses (as at smoke scale): the figure must
  still show both."""
  loss = _losses(steps)
  pred = [
    {"step": t, "pred_state/sr/erased/0/nu/w": t / steps,
     "pred_state/sr/changed/0/nu/w": 1.0}
    for t in range(1, steps)
  ]  # fmt: skip
  _run(root, "st", "fp32", {}, loss + pred)
  measured = [
    {"step": t, "state/erased/0/nu/w": t / steps, "state/changed/0/nu/w": 1.0}
    for t in range(1, steps)
  ]
  cfg = {
    "lowprec": {"state": ["nu=float8_e5m2"]},
    "study": {"reference_arm": "fp32", "cell": "sr"},
  }
  _run(root, "st", "sr_fp8", cfg, loss + measured)


def _remedies_study(root, steps):
  loss = _losses(steps)
  _run(root, "rm", "fp32", {}, loss)
  erased = [{"step": steps - 1, "erased_fraction": 0.02}]  # one point
  for arm in ("rn", "kahan"):
    lp = {"writeback": "bfloat16"}
    _run(root, "rm", arm, {"lowprec": lp}, loss + erased)


@pytest.mark.parametrize("steps", [5, 400], ids=["smoke", "cpu"])
@pytest.mark.parametrize(
  "name, build, draw",
  [
    ("st", _state_study, freeze_figures.state_figure),
    ("rm", _remedies_study, freeze_figures.remedies_figure),
  ],
  ids=["state_precision", "remedies"],
)
def test_state_and_remedies_figures_are_legible(
  tmp_path, name, build, draw, steps
):
  build(str(tmp_path), steps)
  with warnings.catch_warnings():
    warnings.simplefilter("error", plotting.IllegibleFigure)
    path = draw(name, str(tmp_path), str(tmp_path / "out"))
  assert os.path.getsize(path) > 1000
