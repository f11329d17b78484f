"""Which scaled formats a write-back refuses, and one reason for each.

`lowprec.grids.formats.writeback_refusal` is the one place that says it; the
write-back, the reference trace that predicts it and the study config all
give that reason, with the fix, in their errors.
"""

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

import lowprec
from configs import smoke
from experiments import study
from lowprec.grids.formats import (
  NAMED,
  SCALED,
  check_writeback_format,
  get_format,
  get_scaled_format,
  writeback_refusal,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Scaled formats a write-back refuses, and the fix their reason names.
REFUSED = {
  "nvfp4": "Use 'mxfp4_e2m1'",
  "float8_e4m3fn:tensor": "Use the element format itself",
  "float8_e5m2:tensor": "Use the element format itself",
}
TAKEN = [n for n in SCALED if n not in REFUSED]


def test_every_scaled_format_is_either_taken_or_refused():
  assert set(REFUSED) | set(TAKEN) == set(SCALED)
  assert all(SCALED[n].scale_type == "e8m0" for n in TAKEN), TAKEN
  assert len(TAKEN) == 5  # the MX formats


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_format_gets_one_reason_naming_the_fix(name):
  reason = writeback_refusal(name)
  assert reason.count(REFUSED[name]) == 1, reason
  assert reason.endswith("(docs/scaled.md)"), reason
  assert writeback_refusal(SCALED[name]) == reason
  assert writeback_refusal(f" {name} ") == reason
  # One reason per scale rule.
  same_rule = [n for n in REFUSED if SCALED[n].rule == SCALED[name].rule]
  assert {writeback_refusal(n) for n in same_rule} == {reason}


def test_the_two_refused_rules_have_different_reasons():
  assert writeback_refusal("nvfp4") != writeback_refusal("float8_e5m2:tensor")


@pytest.mark.parametrize(
  "fmt",
  [
    *TAKEN,
    get_scaled_format("mxfp8_e4m3", rule="noclip"),
    get_scaled_format("mxfp4_e2m1", block=16, axis=0),
    *NAMED,
    "e3m2",
    get_format("int3", scale=0.25),
    get_format("bfloat16"),
  ],
  ids=str,
)
def test_mx_and_unscaled_formats_are_taken(fmt):
  assert writeback_refusal(fmt) is None
  check_writeback_format(fmt, "anywhere")  # does not raise


@pytest.mark.parametrize("name", REFUSED)
def test_check_writeback_format_says_where_what_and_why(name):
  with pytest.raises(ValueError) as e:
    check_writeback_format(SCALED[name], "parameter 'w'")
  want = (
    f"parameter 'w': write-back onto {name} is not supported. "
    f"{writeback_refusal(name)}"
  )
  assert str(e.value) == want


# ---- every caller gives the same reason ------------------------------------


def _message(call) -> str:
  with pytest.raises(ValueError) as e:
    call()
  return str(e.value)


def _says_why(msg: str, name: str) -> None:
  assert f"write-back onto {name} is not supported. " in msg, msg
  assert msg.endswith(writeback_refusal(name)), msg
  assert REFUSED[name] in msg, msg


@pytest.mark.parametrize("name", REFUSED)
def test_writeback_refuses_at_init_and_update(name):
  params = {"w": jnp.ones((2, 16))}
  opt = lowprec.writeback(name)
  msg = _message(lambda: opt.init(params))
  assert msg.startswith("parameter 'w': "), msg
  _says_why(msg, name)
  _says_why(_message(lambda: opt.update(params, None, params)), name)


@pytest.mark.parametrize("name", REFUSED)
def test_reference_trace_refuses_a_target(name):
  msg = _message(lambda: lowprec.freeze.reference_trace(name))
  assert msg.startswith("reference_trace (which predicts the write-back): ")
  _says_why(msg, name)


@pytest.mark.parametrize("name", REFUSED)
def test_reference_trace_refuses_a_per_parameter_target(name):
  trace = lowprec.freeze.reference_trace({"t": [(".*", name)]})
  msg = _message(lambda: trace.init({"w": jnp.ones((2, 16))}))
  assert msg.startswith("reference_trace (which predicts the write-back), ")
  assert "parameter 'w'" in msg, msg
  _says_why(msg, name)


@pytest.mark.parametrize("name", REFUSED)
@pytest.mark.parametrize(
  "arm, field, value",
  [
    ("rn_bf16", "writeback", lambda n: n),
    ("fp32_reference", "trace_targets", lambda n: (n,)),
  ],
  ids=["writeback", "trace_targets"],
)
def test_the_study_config_refuses_it(name, arm, field, value):
  c = smoke.get_config()
  c.study.arms[arm].lowprec[field] = value(name)
  msg = _message(lambda: study.resolve(c, arm, 0))
  assert msg.startswith(f"lowprec.{field}: "), msg
  _says_why(msg, name)


def test_the_entry_point_refuses_it_in_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.run",
      "--config=configs/smoke.py:arm=rn_bf16",
      "--config.lowprec.writeback=nvfp4",
      f"--config.log.results_dir={tmp_path}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 2, (out.stdout, out.stderr)
  line = out.stderr.strip()
  assert line.startswith("error: lowprec.writeback: "), line
  _says_why(line, "nvfp4")
  assert not list(tmp_path.iterdir())
