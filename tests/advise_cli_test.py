"""`python -m scripts.advise` as a user runs it, on a run directory as the
runner leaves it: config.json and metrics.jsonl (one JSON line per step,
non-finite floats spelled "nan", "inf", "-inf"). The records are made by
hand with known shares, named after the smoke GPT's parameters.

Every mistake (an argument, a damaged or foreign record, a run too short
to advise from, a config that is not the run's) exits with status 2 and
one line on stderr naming the fix, and leaves the files it would write as
they were.
"""

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

import jax
import optax
import pytest

from experiments import results, study, tasks
from experiments.analysis import figures, tables
from lowprec import groups as groups_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24  # the window, the last half, holds 12 >= the 10 advice needs

CONFIG = '''"""The frontier study at smoke width, {steps} steps."""

from configs import frontier


def get_config(arg=None):
  c = frontier.get_config(",".join(filter(None, ["scale=smoke", arg])))
  c.study.name = {name!r}
  c.train.steps = {steps}
  c.train.eval_every_steps = {steps} // 2
  c.ckpt.every_steps = {steps}
  c.lowprec.groups = {groups!r}
  return c
'''


def _load(path):
  spec = importlib.util.spec_from_file_location("_advise_cli_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@functools.cache
def _leaves() -> dict[str, int]:
  """The smoke GPT's parameter paths and sizes."""
  with tempfile.TemporaryDirectory() as root:
    c = study.resolve(_load(_config_file(root, "leaves")), "fp32", 0)
  params = jax.eval_shape(tasks.build(c).init, jax.random.key(0))
  return groups_lib.leaf_sizes(params)


def _config_file(root, name, groups=(), steps=STEPS) -> str:
  path = os.path.join(str(root), f"{name}.py")
  with open(path, "w") as f:
    f.write(CONFIG.format(name=name, groups=tuple(groups), steps=steps))
  return path


def _records(steps=STEPS, near=0.5, move=0.3, rename=lambda x: x):
  """Step 0's evaluation, then a record per step with bf16's erased share
  `near`, its stochastic move probability `move`, and a bf16 moment
  store; at step 1 (learning rate 0 under warmup) no proposals and NaN
  shares, as the runner writes them."""
  recs = [{"step": 0, "val_loss": 5.5}]
  for t in range(1, steps + 1):
    r = {"step": t, "loss": 5.0, "lr": 0.0 if t == 1 else 1e-3}
    for leaf, n in _leaves().items():
      leaf, p = rename(leaf), 0 if t == 1 else n
      r[f"pred/bfloat16/proposals/{leaf}"] = p
      r[f"pred/bfloat16/erased_fraction/{leaf}"] = near if p else "nan"
      r[f"pred/bfloat16_sr/proposals/{leaf}"] = p
      r[f"pred/bfloat16_sr/move_prob/{leaf}"] = move if p else "nan"
      for m in ("mu", "nu"):
        r[f"pred_state/bf16/changed/0/{m}/{leaf}"] = p
        r[f"pred_state/bf16/erased/0/{m}/{leaf}"] = 0
    recs.append(r)
  return recs


def _lines(recs) -> list[str]:
  return [json.dumps(r, sort_keys=True) + "\n" for r in recs]


class Run:
  """A study config, its float32 run directory, and the files to write."""

  def __init__(self, root, name="adv", groups=(), recs=None):
    self.root = str(root)
    os.makedirs(self.root, exist_ok=True)
    self.config = _config_file(root, name, groups)
    self.results = os.path.join(self.root, "results")
    c = study.resolve(_load(self.config), "fp32", 0)
    self.dir = os.path.join(self.results, name, "fp32", "seed0")
    os.makedirs(self.dir)
    results.write_json(os.path.join(self.dir, "config.json"), c.to_dict())
    self.metrics = os.path.join(self.dir, "metrics.jsonl")
    self.write(_lines(_records() if recs is None else recs))
    self.out = os.path.join(self.root, "advice.py")
    self.code = os.path.join(self.root, "optax_advice.py")
    for path in (self.out, self.code):
      with open(path, "w") as f:
        f.write("# written before\n")

  def write(self, lines) -> None:
    with open(self.metrics, "w") as f:
      f.writelines(lines)

  def lines(self) -> list[str]:
    with open(self.metrics) as f:
      return f.readlines()

  def args(self, *extra, config=None):
    return [
      "--config", config or self.config, "--results", self.results,
      "--out", self.out, "--code", self.code, *extra,
    ]  # fmt: skip

  def untouched(self) -> bool:
    """The files to write still hold what they held, and no temp file is
    left beside them."""
    same = all(
      open(p).read() == "# written before\n" for p in (self.out, self.code)
    )
    return same and not [n for n in os.listdir(self.root) if n.endswith("tmp")]


def _advise(*args):
  return subprocess.run(
    [sys.executable, "-m", "scripts.advise", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )


def _refused(out, *words) -> str:
  """Exit status 2, one line on stderr (no traceback) holding `words`."""
  assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
  lines = out.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
  for w in words:
    assert w in lines[0], (w, lines[0])
  return lines[0]


# ------------------------------------------------------------- advice


def test_advice_from_a_whole_run(tmp_path):
  run = Run(tmp_path)
  out = _advise(*run.args())
  assert out.returncode == 0, out.stderr
  assert (
    "Predicted from steps 13-24 of the float32 run (12 steps; the advice "
    "needs at least 10)" in out.stdout
  )
  # erased 0.5 (nearest loses half), SR moves 0.3 >= 0.1: bf16 SR weights,
  # the bf16 store that never stalls.
  assert "- embeddings: bf16_sr+bf16" in out.stdout
  assert "- mlp: bf16_sr+bf16" in out.stdout
  assert "steps without proposals" not in out.stdout  # step 1: not in window
  scope = {}
  exec(open(run.out).read(), scope)  # noqa: S102
  assert "mlp=bf16_sr+bf16" in scope["LOWPREC"]["group_recipes"]
  compile(open(run.code).read(), run.code, "exec")


def test_a_tensor_without_proposals_in_the_window_is_left_out_and_said(
  tmp_path,
):
  # wpe had no proposals at step 20 (a frozen or masked tensor): its NaN
  # shares there, as the runner writes them, are left out of wpe's shares.
  recs = _records()
  for k in list(recs[20]):
    if k.endswith("/wpe"):
      if "/proposals/" in k or "/changed/" in k:
        recs[20][k] = 0
      elif "erased_fraction" in k or "move_prob" in k:
        recs[20][k] = "nan"
  run = Run(tmp_path, recs=recs)
  out = _advise(*run.args())
  assert out.returncode == 0, out.stderr
  assert (
    "- note: steps without proposals, left out of those tensors' shares "
    "(NaN, not zero risk): wpe at 1 of the window's 12 steps" in out.stdout
  )
  assert "- embeddings: bf16_sr+bf16" in out.stdout


def _set(run, line, key, value):
  lines = run.lines()
  r = json.loads(lines[line - 1])
  r[key] = value
  lines[line - 1] = json.dumps(r, sort_keys=True) + "\n"
  run.write(lines)


WTE = "wte/embedding"
NEAR = f"pred/bfloat16/erased_fraction/{WTE}"


def _cut_middle(run):
  lines = run.lines()
  lines[5] = lines[5][:40] + "\n"
  run.write(lines)


def _cut_last(run):
  lines = run.lines()
  lines[-1] = lines[-1][:100]
  run.write(lines)


def _repeat(run):
  lines = run.lines()
  run.write(lines[:10] + [lines[9]] + lines[10:])


def _extra(run):
  run.write(run.lines() + [json.dumps({"step": 25, "loss": 1.0}) + "\n"])


def _no_key(run):
  lines = run.lines()
  r = json.loads(lines[14])
  del r[f"pred/bfloat16_sr/move_prob/{WTE}"]
  lines[14] = json.dumps(r) + "\n"
  run.write(lines)


@pytest.mark.parametrize(
  "damage, words",
  [
    (_cut_middle, ["metrics.jsonl:6: unreadable metrics line"]),
    (_cut_last, ["metrics.jsonl:25: the last line is not a whole record"]),
    (_repeat, ["metrics.jsonl:11: step 9 where step 10 belongs"]),
    (_extra, ["metrics.jsonl:26 lacks", "prediction key(s)"]),
    (_no_key, ["metrics.jsonl:15 lacks 1 prediction key(s)", "move_prob"]),
    (
      lambda run: _set(run, 15, NEAR, "0.5"),
      [f"metrics.jsonl:15: {NEAR} = '0.5' is not a number"],
    ),
    (
      lambda run: _set(run, 15, NEAR, "nan"),
      [f"metrics.jsonl:15: {NEAR} = 'nan' with ", " proposals"],
    ),
    (
      lambda run: _set(run, 15, NEAR, "inf"),
      [f"metrics.jsonl:15: {NEAR} = 'inf' is not a share in [0, 1]"],
    ),
    (
      lambda run: _set(run, 3, f"pred/bfloat16/proposals/{WTE}", -4),
      ["metrics.jsonl:3: pred/bfloat16/proposals/wte/embedding = -4 is not"],
    ),
  ],
  ids=[
    "cut-middle",
    "cut-last",
    "repeated-step",
    "extra-record",
    "missing-key",
    "string",
    "nan-with-proposals",
    "inf",
    "negative-count",
  ],
)
def test_a_damaged_run_is_refused_with_its_file_and_line(
  tmp_path, damage, words
):
  run = Run(tmp_path)
  damage(run)
  line = _refused(_advise(*run.args()), *words)
  assert run.metrics in line
  assert run.untouched()


def test_a_run_too_short_to_advise_from_is_refused(tmp_path):
  # Stopped at step 18: the window holds 9 steps.
  run = Run(tmp_path, recs=_records()[:19])
  _refused(
    _advise(*run.args()),
    "holds 9 step(s); the advice needs at least 10",
    "Train the float32 run longer (at least 19 steps)",
  )
  assert run.untouched()


def test_names_that_match_nothing_are_refused_with_the_valid_ones(tmp_path):
  run = Run(tmp_path, groups=("emb=.*wte.*", "nothing=zzz", "rest=.*"))
  _refused(
    _advise(*run.args()),
    "group(s) that take no parameter: nothing ('zzz')",
    "The parameters: 'h_0/attn/out/bias'",
  )
  other = Run(
    tmp_path / "renamed",
    recs=_records(rename=lambda x: "model/" + x),
  )
  _refused(
    _advise(*other.args()),
    "parameter(s) match no traced tensor ('h_0/attn/out/bias'",
    "traced tensor(s) match no parameter ('model/h_0/attn/out/bias'",
  )
  assert run.untouched() and other.untouched()


# ------------------------------------------------- the run's config


def test_the_runs_config_must_be_the_config_given(tmp_path):
  run = Run(tmp_path)
  file = os.path.join(run.dir, "config.json")
  c = json.load(open(file))
  c["train"]["steps"] = 30
  results.write_json(file, c)
  _refused(
    _advise(*run.args()),
    "was run with another config than --config",
    "train.steps: 30 -> 24",
    "--restart",
  )
  open(file, "w").write('{"study": ')
  _refused(_advise(*run.args()), "config.json is not valid JSON")
  os.remove(file)
  _refused(
    _advise(*run.args()),
    "has metrics.jsonl but no config.json",
    f"python -m experiments.run --config {run.config}:arm=fp32,seed=0",
  )
  assert run.untouched()


# --------------------------------------------------------- arguments


def _missing(run):
  return os.path.join(run.root, "missing", "x.py")


ARGUMENTS = {
  # id: (arguments after the run's, words in the one line)
  "no-config": (lambda r: ["--budget", "3"], ["arguments are required"]),
  "unknown-flag": (lambda r: r.args("--bugdet", "3"), ["unrecognized"]),
  "budget-word": (lambda r: r.args("--budget", "six"), ["invalid float"]),
  "budget-nan": (lambda r: r.args("--budget", "nan"), ["--budget nan: give"]),
  "budget-negative": (lambda r: r.args("--budget", "-1"), ["positive"]),
  "budget-inf": (lambda r: r.args("--budget", "inf"), ["positive"]),
  "budget-unreachable": (
    lambda r: r.args("--budget", "0.5"),
    ["no predicted recipe fits 0.5 bytes/param", "raise --budget"],
  ),
  "optimizer": (
    lambda r: r.args("--optimizer", "optax.adamw("),
    ["--optimizer 'optax.adamw(' is not a Python expression", "e.g."],
  ),
  "out-folder-missing": (
    lambda r: [*r.args(), "--out", _missing(r)],
    ["--out", "missing/x.py: no folder", "mkdir -p"],
  ),
  "code-folder-missing": (
    lambda r: [*r.args(), "--code", _missing(r)],
    ["--code", "no folder", "mkdir -p"],
  ),
  "out-is-a-folder": (
    lambda r: [*r.args(), "--out", r.root],
    ["is a folder: name a file in it"],
  ),
  "out-is-code": (
    lambda r: [*r.args(), "--out", r.code],
    ["--out and --code name the same file"],
  ),
  "config-missing": (
    lambda r: r.args(config=r.config + "x"),
    ["no such file"],
  ),
  "config-not-a-study": (
    lambda r: r.args(config=os.path.join(ROOT, "configs", "__init__.py")),
    ["is not a study config"],
  ),
  "config-bad-scale": (
    lambda r: r.args(config=r.config + ":scale=huge"),
    ["unknown scale 'huge'; valid: full, cpu, smoke"],
  ),
  "config-bad-argument": (
    lambda r: r.args(config=r.config + ":armm=fp32"),
    ["bad config argument 'armm=fp32'"],
  ),
  "config-arm-unknown": (
    lambda r: r.args(config=r.config + ":arm=bogus"),
    ["'bogus' is not an arm of 'adv'", "Arms: bf16_sr_mom_q8, fp32"],
  ),
  "arm-unknown": (
    lambda r: r.args("--arm", "fp23"),
    ["--arm: 'fp23' is not an arm", "Did you mean 'fp32'?", "Arms: "],
  ),
  "arm-untraced": (
    lambda r: r.args("--arm", "bf16_sr_mom_q8"),
    ["arm 'bf16_sr_mom_q8' carries no traces", "arms that do: fp32"],
  ),
  "arms-differ": (
    lambda r: r.args("--arm", "fp32", config=r.config + ":arm=bf16_sr_mom_q8"),
    ["--arm fp32 and the config argument's arm=bf16_sr_mom_q8 differ"],
  ),
  "seed-word": (lambda r: r.args("--seed", "one"), ["invalid int value"]),
  "seed-unknown": (
    lambda r: r.args("--seed", "7"),
    ["seed 7 is not a seed of arm 'fp32' of 'adv': its seeds are 0"],
  ),
  "seeds-differ": (
    lambda r: r.args("--seed", "1", config=r.config + ":seed=0"),
    ["--seed 1 and the config argument's seed=0 differ"],
  ),
  "results-elsewhere": (
    lambda r: [*r.args(), "--results", r.root],
    ["run the float32 arm first", ":arm=fp32,seed=0"],
  ),
}


@pytest.mark.parametrize("case", list(ARGUMENTS))
def test_a_mistaken_argument_prints_one_line_and_writes_nothing(tmp_path, case):
  run = Run(tmp_path)
  args, words = ARGUMENTS[case]
  _refused(_advise(*args(run)), *words)
  assert run.untouched()
  assert not os.path.exists(os.path.join(run.root, "missing"))


def test_help_exits_zero():
  out = _advise("--help")
  assert out.returncode == 0 and "--optimizer" in out.stdout


# ------------------------------------------------ a real float32 run


@pytest.mark.slow
def test_a_real_float32_run_advised_and_its_advice_run(tmp_path):
  # The runner's float32 arm and a recipe (24 steps), the advice from the
  # float32 arm's metrics as written, the advice run as an arm, the table
  # and figure.
  config = _config_file(tmp_path, "adv")
  root = str(tmp_path / "results")
  c = _load(config)
  c.log.results_dir = root
  assert all(s["status"] == "finished" for s in study.run_study(c))
  frag, code = tmp_path / "advice.py", tmp_path / "optax_advice.py"
  out = _advise(
    "--config", config, "--results", root, "--out", str(frag),
    "--code", str(code),
  )  # fmt: skip
  assert out.returncode == 0, out.stderr
  assert "| group | params | weights | bytes |" in out.stdout
  assert "(12 steps; the advice needs at least 10)" in out.stdout
  assert "Recommended (" in out.stdout
  scope = {}
  exec(frag.read_text(), scope)  # noqa: S102
  c = _load(config)
  c.log.results_dir = root
  c.study.arms = {
    **c.study.arms.to_dict(),
    "advised": {"lowprec": scope["LOWPREC"]},
  }
  assert all(s["status"] == "finished" for s in study.run_study(c))
  md = tables.make("adv", root)
  assert "| advised |" in md
  assert "- float32 seed 0: val loss" in md
  assert "- Pareto front (by mean): " in md
  assert os.path.getsize(figures.plot("adv", root)) > 1000
  scope = {}
  exec(compile(code.read_text(), str(code), "exec"), scope)  # noqa: S102
  assert isinstance(scope["tx"], optax.GradientTransformation)


PREDICT = '''"""A float32 run; arms scripts.advise predicts or leaves out."""

from configs import frontier


def get_config(arg=None):
  c = frontier.get_config("scale=smoke")
  c.study.name = "pred"
  c.train.steps = {steps}
  c.train.eval_every_steps = {steps} // 2
  c.ckpt.every_steps = {steps}
  arms = frontier.arms()
  c.study.arms = {{
    "fp32": arms["fp32"],
    "bf16_rn": arms["bf16_rn"],
    "bf16_sr": arms["bf16_sr"],
    "bf16_kahan": arms["bf16_kahan"],
    "bf16_rn_2x": {{**arms["bf16_rn"], "train": {{"steps": 2 * {steps}}}}},
  }}
  return c
'''


@pytest.mark.slow
def test_predict_arms_writes_nats_for_the_plain_arms_of_its_horizon(tmp_path):
  # The float32 arm alone runs (24 steps, every trace); --predict_arms
  # gives nearest write-back its lost cost and SR its forward cost (mean
  # and standard error over draws), and leaves out a compensated arm and
  # an arm of twice the horizon, whose weights are not the run's.
  config = tmp_path / "pred.py"
  config.write_text(PREDICT.format(steps=STEPS))
  root = str(tmp_path / "results")
  c = _load(str(config))
  c.log.results_dir = root
  c.study.arm = "fp32"
  assert all(s["status"] == "finished" for s in study.run_study(c))
  preds = tmp_path / "preds.json"
  out = _advise(
    "--config", str(config), "--results", root, "--out",
    str(tmp_path / "advice.py"), "--code", str(tmp_path / "code.py"),
    "--predict_arms", str(preds), "--draws", "2",
  )  # fmt: skip
  assert out.returncode == 0, out.stderr
  got = json.loads(preds.read_text())
  assert set(got) == {"bf16_rn", "bf16_sr", "advised"}
  assert got["bf16_rn"]["how"] == "lost_cost" and got["bf16_rn"]["se"] == 0
  assert got["bf16_sr"]["how"] == "forward_cost"
  assert got["bf16_sr"]["draws"] == 2 and got["bf16_sr"]["se"] > 0
  assert all(math.isfinite(p["nats"]) for p in got.values())
