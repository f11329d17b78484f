"""End to end through the real entry point: layout, resume, devices, errors."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

import lowprec
from configs import smoke
from experiments import results, study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp, *args, devices=8, wait=True, timeout=600):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [
    sys.executable,
    "-m",
    "experiments.run",
    *args,
    f"--config.log.results_dir={tmp}",
  ]
  if not wait:
    return subprocess.Popen(
      cmd,
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
  return subprocess.run(
    cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
  )


def _summary(tmp, arm="rn_bf16", seed=0):
  with open(
    os.path.join(tmp, "smoke", arm, f"seed{seed}", "summary.json")
  ) as f:
    return json.load(f)


def _losses(tmp, arm="rn_bf16"):
  path = os.path.join(tmp, "smoke", arm, "seed0", "metrics.jsonl")
  return [
    (r["step"], r.get("loss"), r.get("val_loss"))
    for r in results.read_metrics(path)
  ]


def test_entry_point_runs_every_arm_and_writes_the_layout(tmp_path):
  out = _run(tmp_path, "--config=configs/smoke.py")
  assert out.returncode == 0, out.stdout + out.stderr
  for arm in smoke.get_config().study.arms:
    d = tmp_path / "smoke" / arm / "seed0"
    for name in ("config.json", "env.json", "metrics.jsonl", "summary.json"):
      assert (d / name).exists(), (arm, name)
    assert any((d / "checkpoints").iterdir())
    env = json.loads((d / "env.json").read_text())
    assert env["versions"]["jax"] and len(env["devices"]) == 8
    recs = results.read_metrics(str(d / "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(0, 9))
  assert "steps/s" in out.stdout and "ETA" in out.stdout
  # A second invocation skips the finished runs.
  again = _run(tmp_path, "--config=configs/smoke.py")
  assert again.returncode == 0 and again.stdout.count("skipped") == 3


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_bits(tmp_path):
  args = [
    "--config=configs/smoke.py:arm=sr_bf16",
    "--config.train.steps=30",
    "--config.ckpt.every_steps=5",
  ]
  ref = _run(tmp_path / "ref", *args)
  assert ref.returncode == 0, ref.stderr
  proc = _run(tmp_path / "cut", *args, wait=False)
  metrics = tmp_path / "cut" / "smoke" / "sr_bf16" / "seed0" / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 13:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (metrics.parent / "summary.json").exists(), "killed too late"
  rerun = _run(tmp_path / "cut", *args)
  assert rerun.returncode == 0, rerun.stderr
  assert "resumed from step" in rerun.stdout
  a = _summary(tmp_path / "ref", "sr_bf16")
  b = _summary(tmp_path / "cut", "sr_bf16")
  assert b["resumed_from"] > 0
  assert a["param_digest"] == b["param_digest"]
  assert _losses(tmp_path / "ref", "sr_bf16") == _losses(
    tmp_path / "cut", "sr_bf16"
  )


@pytest.mark.slow
def test_one_and_eight_devices_give_the_same_bits(tmp_path):
  args = ["--config=configs/smoke.py:arm=sr_bf16"]
  one = _run(tmp_path / "one", *args, devices=1)
  eight = _run(tmp_path / "eight", *args, devices=8)
  assert one.returncode == 0 and eight.returncode == 0, one.stderr
  assert (
    _summary(tmp_path / "one", "sr_bf16")["param_digest"]
    == _summary(tmp_path / "eight", "sr_bf16")["param_digest"]
  )
  assert _losses(tmp_path / "one", "sr_bf16") == _losses(
    tmp_path / "eight", "sr_bf16"
  )


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
  out = _run(
    tmp_path,
    "--config=configs/smoke.py:arm=fp32_reference",
    "--config.opt.lr=1e12",
    "--config.opt.clip_norm=0.0",
    "--config.train.steps=40",
    "--config.ckpt.every_steps=1",
  )
  # Warmup starts at lr 0: step 1 keeps finite params, step 2 diverges. A
  # checkpoint is saved only once its params' own loss is known finite, so
  # the last one kept is step 1, before the last metrics line's step 2.
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert "non-finite loss" in out.stderr
  d = tmp_path / "smoke" / "fp32_reference" / "seed0"
  recs = results.read_metrics(str(d / "metrics.jsonl"))
  bad = recs[-1]["step"]
  kept = sorted(
    int(p.name) for p in (d / "checkpoints").iterdir() if p.name.isdigit()
  )
  assert kept and max(kept) == bad - 1
  assert f"step {max(kept)}; its params had a finite loss" in out.stderr
  assert not (d / "summary.json").exists()


def test_mistyped_override_is_rejected_by_the_entry_point(tmp_path):
  out = _run(tmp_path, "--config=configs/smoke.py", "--config.opt.lrr=1")
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert "lrr" in out.stderr and "Did you mean 'opt.lr'" in out.stderr


@pytest.mark.parametrize(
  "section, key, value, match",
  [
    ("lowprec", "writeback", "fp8", "lowprec.writeback: unknown format"),
    ("lowprec", "trace_targets", ("bf16",), "Did you mean 'bfloat16'"),
    ("lowprec", "rounding", "stochastc", "Did you mean 'stochastic'"),
    ("lowprec", "policy", "attn.prob@dv=fresh", "attn.probs@dv"),
    ("model", "kind", "gtp", "Did you mean 'gpt'"),
    ("data", "name", "builtin", "builtin_text"),
  ],
  ids=["format", "trace-format", "rounding", "policy-use", "model", "data"],
)
def test_bad_config_values_are_rejected_before_training(
  section, key, value, match
):
  c = smoke.get_config()
  study.resolve(c, "", 0)  # valid as it is
  c[section][key] = value
  with pytest.raises(ValueError, match=match):
    study.resolve(c, "", 0)


def _typo(value: str) -> str:
  """A near miss: the last character dropped (or one added)."""
  return value[:-1] if len(value) > 3 else value + "x"


@pytest.mark.parametrize("key", sorted(study.choices()))
def test_every_named_choice_is_checked_with_a_suggestion(key):
  # The registries the runner builds from are the ones validation checks:
  # a near miss of a valid value is refused, naming the key and the value.
  c = smoke.get_config()
  section, name = key.split(".")
  valid = list(study.choices()[key])
  good = c[section][name]
  assert good in valid  # the default is a valid choice
  c[section][name] = _typo(valid[0])
  with pytest.raises(ValueError, match=f"unknown {key} .*Did you mean"):
    study.resolve(c, "", 0)


def test_a_typo_exits_2_before_the_run_directory_exists(tmp_path):
  # Checked with every other choice (the test above) before anything is
  # written; an optimizer name was once checked only when the optimizer
  # was built, after config.json and env.json, with exit status 1.
  override = "--config.opt.name=adamx"
  out = _run(tmp_path, "--config=configs/smoke.py:arm=rn_bf16", override)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert "Did you mean" in out.stderr
  assert not (tmp_path / "smoke").exists()


def test_unknown_arm_lists_the_arms():
  c = smoke.get_config("arm=rn_bf17")
  with pytest.raises(ValueError, match="Did you mean 'rn_bf16'"):
    study.arms_of(c)
  with pytest.raises(ValueError, match="bad config argument"):
    smoke.get_config("arms=rn_bf16")


def test_fsdp_shards_parameters_and_steps():
  from experiments import train

  c = smoke.get_config("arm=fp32_reference")
  c.train.fsdp = 2
  c.train.virtual_shards = 0
  c.lowprec.writeback = "bfloat16"
  run = train.build_run(study.resolve(c, "", 0))
  kernel = run.state.params["h_0"]["mlp"]["fc"]["kernel"]
  assert "fsdp" in str(kernel.sharding.spec)
  assert len(kernel.sharding.device_set) == 8
  state, m = run.step_fn(run.state, run.put(run.task.data.batch(0)))
  assert bool(jax.numpy.isfinite(m["loss"]))
  new = state.params["h_0"]["mlp"]["fc"]["kernel"]
  assert bool(lowprec.get_format("bfloat16").is_on_grid(new).all())
