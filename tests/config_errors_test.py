"""Config mistakes through the real entry point: one line, exit 2, no files.

Every value the runner would refuse, or silently ignore, is refused before
the results directory is touched: optimizer hyperparameters out of range, a
Kahan buffer format without Kahan, and the combinations that the optimizer
itself refuses when it is built (checked by building it on the model's
abstract parameters, without compiling).
"""

import importlib
import os
import subprocess
import sys

import pytest

from configs import smoke
from experiments import study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(results_dir, *args):
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [
    sys.executable,
    "-m",
    "experiments.run",
    *args,
    f"--config.log.results_dir={results_dir}",
  ]
  return subprocess.run(
    cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )


# (id, arm, overrides, what the one line must say: the fix among it)
REFUSED = [
  (
    "b1-above-one",
    "rn_bf16",
    ["--config.opt.b1=1.5"],
    ["opt.b1=1.5", "0 <= opt.b1 < 1", "--config.opt.b1=0.9"],
  ),
  (
    "b2-negative",
    "rn_bf16",
    ["--config.opt.b2=-0.5"],
    ["opt.b2=-0.5", "--config.opt.b2=0.95"],
  ),
  (
    "lr-nan",
    "rn_bf16",
    ["--config.opt.lr=nan"],
    ["opt.lr=nan", "positive, finite", "--config.opt.lr=3e-4"],
  ),
  (
    "lr-inf",
    "rn_bf16",
    ["--config.opt.lr=inf"],
    ["opt.lr=inf", "positive, finite", "--config.opt.lr=3e-4"],
  ),
  (
    "lr-negative",
    "rn_bf16",
    ["--config.opt.lr=-0.001"],
    ["opt.lr=-0.001", "ascends", "--config.opt.lr=3e-4"],
  ),
  (
    "buffer-without-kahan",
    "rn_bf16",
    ["--config.lowprec.buffer=float8_e5m2"],
    ["lowprec.buffer", "--config.lowprec.compensation=kahan"],
  ),
  (
    "unknown-state-moment",
    "rn_bf16",
    ["--config.lowprec.state=('mx=bfloat16:stochastic',)"],
    ["lowprec.state", "'mx'", "mu"],
  ),
  (
    "remainder-on-fp8",
    "rn_bf16",
    [
      "--config.lowprec.writeback=float8_e4m3fn",
      "--config.lowprec.compensation=remainder",
    ],
    ["remainder", "--config.lowprec.compensation=kahan"],
  ),
  (
    "kahan-with-deadzone",
    "rn_bf16",
    [
      "--config.lowprec.compensation=kahan",
      "--config.lowprec.rounding=deadzone",
    ],
    ["deadzone", "--config.lowprec.rounding=nearest"],
  ),
  (
    "kahan-on-mx-weights",
    "rn_bf16",
    [
      "--config.lowprec.writeback=mxfp8_e4m3",
      "--config.lowprec.compensation=kahan",
    ],
    ["mxfp8_e4m3", "--config.lowprec.compensation=none"],
  ),
  (
    "unknown-compensation",
    "rn_bf16",
    ["--config.lowprec.compensation=ecco"],
    ["lowprec.compensation", "split, eco", "Did you mean 'eco'"],
  ),
  (
    "split-on-fp8",
    "rn_bf16",
    [
      "--config.lowprec.writeback=float8_e4m3fn",
      "--config.lowprec.compensation=split",
    ],
    ["split", "--config.lowprec.writeback=bfloat16"],
  ),
  (
    "correction-bits-12",
    "rn_bf16",
    [
      "--config.lowprec.compensation=split",
      "--config.lowprec.correction_bits=12",
    ],
    ["lowprec.correction_bits=12", "--config.lowprec.correction_bits=8"],
  ),
  (
    "eco-with-deadzone",
    "rn_bf16",
    [
      "--config.lowprec.compensation=eco",
      "--config.lowprec.rounding=deadzone",
    ],
    ["'eco'", "--config.lowprec.rounding=nearest"],
  ),
  (
    "eco-nearest-stored-mu",
    "rn_bf16",
    [
      "--config.lowprec.compensation=eco",
      "--config.lowprec.state=('mu=dynamic8:block256',)",
    ],
    ["lowprec.state", "lowprec.eco", "'dynamic8:stochastic:block256'"],
  ),
]


@pytest.mark.parametrize(
  "arm, overrides, needles",
  [r[1:] for r in REFUSED],
  ids=[r[0] for r in REFUSED],
)
def test_a_config_error_exits_2_with_one_line_and_writes_nothing(
  arm, overrides, needles, tmp_path
):
  out = _run(tmp_path, f"--config=configs/smoke.py:arm={arm}", *overrides)
  assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
  assert "Traceback" not in out.stderr, out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
  for needle in needles:
    assert needle in lines[0], (needle, lines[0])
  assert not list(tmp_path.iterdir()), list(tmp_path.rglob("*"))


def _smoke(arm="rn_bf16", **lowprec):
  c = smoke.get_config()
  c.lowprec.update(lowprec)
  return study.resolve(c, arm, 0)


@pytest.mark.parametrize(
  "key, value",
  [("b1", 1.0), ("b1", -0.1), ("b2", 1.5), ("momentum", 1.0)],
  ids=["b1-one", "b1-negative", "b2-above-one", "momentum-one"],
)
def test_decay_rates_outside_zero_to_one_are_refused(key, value):
  c = smoke.get_config()
  c.opt[key] = value
  with pytest.raises(ValueError, match=rf"opt\.{key}=.* must be in 0 <="):
    study.resolve(c, "rn_bf16", 0)
  c.opt[key] = 0.0  # the edge that is allowed
  study.resolve(c, "rn_bf16", 0)


@pytest.mark.parametrize(
  "value", [float("nan"), float("inf"), -1e-3, 0.0], ids=str
)
def test_a_learning_rate_that_is_not_positive_and_finite_is_refused(value):
  c = smoke.get_config()
  c.opt.lr = value
  with pytest.raises(ValueError, match=r"opt\.lr=.* must be a positive, fin"):
    study.resolve(c, "rn_bf16", 0)
  c.opt.lr = 1e30  # huge but finite: a divergence, stopped when it comes
  study.resolve(c, "rn_bf16", 0)


def test_a_default_buffer_is_not_an_error_without_kahan():
  _smoke(buffer="bfloat16")
  _smoke(compensation="kahan", buffer="float8_e5m2")
  with pytest.raises(ValueError, match="only applies with"):
    _smoke(compensation="two_component", buffer="float8_e5m2")


def test_every_selected_run_is_built_before_any_starts():
  # The dry build finds what only the optimizer knows (its state's names),
  # for every arm, before the first one runs.
  c = smoke.get_config()
  c.lowprec.state = ("mx=bfloat16:stochastic",)
  with pytest.raises(study.ConfigError, match="lowprec.state") as info:
    study.resolve_all(c)
  assert "\n" not in str(info.value)
  c.lowprec.state = ("mu=bfloat16:stochastic",)
  assert len(study.resolve_all(c)) == 3


CONFIGS = sorted(
  f[:-3]
  for f in os.listdir(os.path.join(ROOT, "configs"))
  if f.endswith(".py") and f not in ("__init__.py", "common.py", "presets.py")
)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_arm_builds_its_optimizer(name):
  # The dry build refuses no arm that the studies run (at CPU scale, where
  # the data is at hand).
  c = importlib.import_module(f"configs.{name}").get_config("scale=cpu")
  runs = study.resolve_all(c)
  assert runs
