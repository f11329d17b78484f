"""Faults and bad inputs through the real entry point (`experiments.run`).

Kills (`kill -9`, injected with `LOWPREC_FAULT` at named moments), damaged,
cut and deleted files, two launches at once, a write that fails for lack of
space, and bad values: each run either ends equal to an uninterrupted run
(params digest and every metrics line) or stops with one clear message,
and nothing already written is lost. docs/reliability.md tabulates them.
"""

import ast
import fcntl
import glob
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments import faults, ledger, results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARM = "sr_bf16"
# 8 steps, a checkpoint every 2 (2 kept), val loss at 4 and 8.
BASE = [
  f"--config=configs/smoke.py:arm={ARM}",
  "--config.train.steps=8",
  "--config.ckpt.every_steps=2",
]
TIMING = {"wall_s", "steps_per_s", "resumed_from"}  # may differ by run


def _env(devices=1, fault=None):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env.pop(faults.ENV, None)
  if fault:
    env[faults.ENV] = fault
  return env


def _cmd(results_dir, args):
  tail = (
    [] if results_dir is None else [f"--config.log.results_dir={results_dir}"]
  )
  return [sys.executable, "-m", "experiments.run", *args, *tail]


def run(results_dir, *extra, args=BASE, fault=None, devices=1, **kw):
  return subprocess.run(
    _cmd(results_dir, [*args, *extra]),
    cwd=kw.pop("cwd", ROOT),
    env=kw.pop("env", None) or _env(devices, fault),
    capture_output=True,
    text=True,
    timeout=kw.pop("timeout", 300),
    **kw,
  )


def run_dir(results_dir, arm=ARM):
  return os.path.join(str(results_dir), "smoke", arm, "seed0")


def outcome(results_dir, arm=ARM):
  """(params digest, summary without timing, every metrics line)."""
  d = run_dir(results_dir, arm)
  summary = results.read_json(os.path.join(d, "summary.json"))
  digest = summary.pop("param_digest")
  for k in TIMING:
    summary.pop(k, None)
  with open(os.path.join(d, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  return digest, summary, lines


def assert_clean_error(out, *needles, code=2):
  """One message, no traceback, the right exit status, real key names."""
  assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
  assert "Traceback" not in out.stderr, out.stderr
  assert "error: " in out.stderr, out.stderr
  for n in needles:
    assert n in out.stderr, (n, out.stderr)
  assert_real_keys(out.stderr)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
  """The run dir of the uninterrupted run every fault is compared with."""
  d = tmp_path_factory.mktemp("reference")
  out = run(d)
  assert out.returncode == 0, out.stderr
  return run_dir(d)


@pytest.fixture(scope="module")
def reference(reference_dir):
  return outcome(
    os.path.dirname(os.path.dirname(os.path.dirname(reference_dir)))
  )


def kill_then_resume(tmp, fault, *extra_faults):
  """Runs until killed at `fault` (and each extra fault in turn), then
  reruns cleanly; returns the outcome."""
  for f in (fault, *extra_faults):
    out = run(tmp, fault=f)
    assert out.returncode == -signal.SIGKILL, (f, out.returncode, out.stderr)
  out = run(tmp)
  assert out.returncode == 0, out.stderr
  return outcome(tmp), out


# --- kills at precise moments

KILLS = {
  "after_config": ("after_config",),
  "before_first_checkpoint": ("after_step:1",),
  "metrics_line_before_its_checkpoint": ("after_metrics:2",),
  "during_checkpoint_write": ("checkpoint_started:4",),
  "right_after_checkpoint": ("after_checkpoint:4",),
  "during_eval": ("during_eval:4",),
  "at_last_step": ("after_metrics:8",),
  "after_last_checkpoint": ("before_summary:8",),
  "during_summary_write": ("during_write:summary.json",),
  "during_config_write": ("during_write:config.json",),
  "during_resume_restore": ("after_metrics:6", "after_restore"),
  "during_metrics_trim": ("after_metrics:6", "during_metrics_trim"),
  "during_env_rewrite": ("after_metrics:6", "during_write:env.json"),
}
FAST_KILLS = ("right_after_checkpoint",)
# The step a rerun resumes from: the newest checkpoint on disk (after a kill
# right after step 4's checkpoint, steps 2 and 4 are kept), not any other.
RESUMED_FROM = {"right_after_checkpoint": 4}


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=() if n in FAST_KILLS else pytest.mark.slow, id=n)
    for n in KILLS
  ],
)
def test_kill_then_rerun_equals_the_uninterrupted_run(
  name, tmp_path, reference
):
  got, out = kill_then_resume(tmp_path, *KILLS[name])
  assert got == reference
  if name in RESUMED_FROM:
    step = RESUMED_FROM[name]
    assert f"resumed from step {step}" in out.stdout, out.stdout
    summary = results.read_json(os.path.join(run_dir(tmp_path), "summary.json"))
    assert summary["resumed_from"] == step


@pytest.mark.slow
def test_kill_at_random_moments_then_rerun_equals_uninterrupted(
  tmp_path, reference
):
  # Real kills at wall-clock moments (not at hooks): after 0..3 metrics
  # lines have appeared, each followed by a rerun.
  metrics = os.path.join(run_dir(tmp_path), "metrics.jsonl")
  for lines in (1, 3, 6):
    proc = subprocess.Popen(
      _cmd(tmp_path, BASE),
      cwd=ROOT,
      env=_env(),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
      if os.path.exists(metrics):
        with open(metrics) as f:
          if len(f.read().splitlines()) >= lines:
            break
      time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  out = run(tmp_path)
  assert out.returncode == 0, out.stderr
  assert outcome(tmp_path) == reference


# --- one writer


def _hold_lock(path):
  """A child process holding the run dir's lock (as a run would)."""
  code = (
    "import sys, time\n"
    "from experiments import ledger\n"
    "ledger.RunLock(sys.argv[1]).acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
  )
  proc = subprocess.Popen(
    [sys.executable, "-c", code, path],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    text=True,
  )
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_lock_names_its_holder_and_dies_with_it(tmp_path):
  d = str(tmp_path)
  holder = _hold_lock(d)
  try:
    with pytest.raises(ledger.RunLocked, match=f"pid {holder.pid} on "):
      ledger.RunLock(d).acquire()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  with ledger.RunLock(d):  # released by the kernel with the process
    fd = os.open(os.path.join(d, ledger.LOCK_FILE), os.O_RDWR)
    with pytest.raises(BlockingIOError):
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


def test_second_launch_for_a_locked_run_stops_at_once(tmp_path):
  d = run_dir(tmp_path)
  os.makedirs(d)
  holder = _hold_lock(d)
  try:
    t0 = time.time()
    out = run(tmp_path)
    took = time.time() - t0
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert_clean_error(out, f"pid {holder.pid}", "one writer per run")
  assert took < 60
  assert sorted(os.listdir(d)) == [ledger.LOCK_FILE]  # nothing written


@pytest.mark.slow
def test_two_concurrent_launches_one_runs_one_stops(tmp_path, reference):
  procs = [
    subprocess.Popen(
      _cmd(tmp_path, BASE),
      cwd=ROOT,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for _ in range(2)
  ]
  outs = [p.communicate(timeout=300) for p in procs]
  codes = sorted(p.returncode for p in procs)
  assert codes == [0, 2], outs
  loser = next(o for p, o in zip(procs, outs, strict=True) if p.returncode == 2)
  assert "one writer per run" in loser[1] and "Traceback" not in loser[1]
  assert outcome(tmp_path) == reference
  # Different runs of a study still run side by side.
  other = [
    subprocess.Popen(
      _cmd(
        tmp_path / "pair", [f"--config=configs/smoke.py:arm={a}", *BASE[1:]]
      ),
      cwd=ROOT,
      env=_env(),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )
    for a in ("rn_bf16", "sr_bf16")
  ]
  assert [p.wait(timeout=300) for p in other] == [0, 0]
  assert outcome(tmp_path / "pair", "sr_bf16") == reference


# --- the config fingerprint


def test_changed_config_is_refused_before_anything_is_written(
  tmp_path, reference_dir
):
  shutil.copytree(reference_dir, run_dir(tmp_path))
  before = _snapshot(run_dir(tmp_path))
  out = run(tmp_path, "--config.opt.lr=3e-4", "--config.train.steps=20")
  assert_clean_error(
    out,
    "opt.lr: 0.001 -> 0.0003",
    "train.steps: 8 -> 20",
    "--config.log.results_dir",
    "--restart",
  )
  assert "--allow_opt_change" not in out.stderr  # finished: no amending
  assert _snapshot(run_dir(tmp_path)) == before
  # Keys that cannot change results may differ: the finished run is skipped.
  same = run(tmp_path, "--config.log.progress_every_steps=1")
  assert same.returncode == 0 and "skipped" in same.stdout, same.stderr
  assert _snapshot(run_dir(tmp_path)) == before


def test_fingerprint_counts_only_keys_that_change_results():
  from configs import smoke

  old = smoke.get_config("arm=sr_bf16").to_dict()
  new = smoke.get_config("arm=sr_bf16").to_dict()
  new["log"].update(results_dir="elsewhere", progress_every_steps=1)
  new["ckpt"].update(every_steps=1, keep=5)
  new["study"]["seeds"] = [0, 1]
  assert ledger.config_diff(old, new) == {}
  new["opt"]["lr"] = 3e-4
  new["model"]["d_model"] = 64
  new["lowprec"]["trace_targets"] = ["float16"]
  assert ledger.config_diff(old, new) == {
    "lowprec.trace_targets": ([], ["float16"]),
    "model.d_model": (32, 64),
    "opt.lr": (1e-3, 3e-4),
  }
  # A key that only one side has comes from another code version.
  new["train"]["new_knob"] = 0
  assert "train.new_knob" not in ledger.config_diff(old, new)
  assert ledger.version_keys(old, new) == ["train.new_knob"]


def _snapshot(d):
  """Every file's bytes under d (the lock file's holder line aside)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(d, "**"), recursive=True)):
    if os.path.isfile(path) and os.path.basename(path) != ledger.LOCK_FILE:
      with open(path, "rb") as f:
        out[os.path.relpath(path, d)] = f.read()
  return out


@pytest.mark.slow
def test_restart_starts_over_and_equals_a_fresh_run(tmp_path, reference_dir):
  shutil.copytree(reference_dir, run_dir(tmp_path))
  new = ["--config.opt.lr=3e-4"]
  out = run(tmp_path, *new, "--restart")
  assert out.returncode == 0, out.stderr
  fresh = run(tmp_path / "fresh", *new)
  assert fresh.returncode == 0, fresh.stderr
  assert outcome(tmp_path) == outcome(tmp_path / "fresh")


@pytest.mark.slow
def test_killed_run_rerun_with_other_steps_is_refused(tmp_path, reference):
  out = run(tmp_path, fault="after_checkpoint:4")
  assert out.returncode == -signal.SIGKILL
  before = _snapshot(run_dir(tmp_path))
  out = run(tmp_path, "--config.train.steps=80")
  assert_clean_error(out, "train.steps: 8 -> 80", "started run")
  assert _snapshot(run_dir(tmp_path)) == before
  got, _ = kill_then_resume(tmp_path, "after_checkpoint:6")
  assert got == reference


# --- damaged, cut and deleted files


@pytest.fixture(scope="module")
def killed_at_6(tmp_path_factory):
  """A run dir killed right after its step-6 checkpoint (4 and 6 kept)."""
  d = tmp_path_factory.mktemp("killed6")
  out = run(d, fault="after_checkpoint:6")
  assert out.returncode == -signal.SIGKILL, out.stderr
  return run_dir(d)


def _copy(src, tmp):
  shutil.copytree(src, run_dir(tmp))
  return run_dir(tmp)


def _empty_dir(d):
  shutil.rmtree(d)
  os.makedirs(d)


def _garbage_metadata(d):
  with open(os.path.join(d, "default", "_METADATA"), "w") as f:
    f.write("{not json")


def _garbage_step_metadata(d):
  # orbax reads this file only for timestamps: the checkpoint still loads.
  with open(os.path.join(d, "_CHECKPOINT_METADATA"), "w") as f:
    f.write("{not json")


def _truncate_largest(d):
  files = [p for p in glob.glob(f"{d}/**", recursive=True) if os.path.isfile(p)]
  big = max(files, key=os.path.getsize)
  with open(big, "r+b") as f:
    f.truncate(os.path.getsize(big) // 3)


@pytest.mark.slow
@pytest.mark.parametrize(
  "damage, falls_back",
  [
    (_empty_dir, True),
    (_garbage_metadata, True),
    (_truncate_largest, True),
    (_garbage_step_metadata, False),
  ],
  ids=["emptied", "garbage-_METADATA", "truncated-array-file", "garbage-step"],
)
def test_broken_latest_checkpoint_falls_back_to_the_previous(
  damage, falls_back, killed_at_6, tmp_path, reference
):
  d = _copy(killed_at_6, tmp_path)
  damage(os.path.join(d, "checkpoints", "6"))
  out = run(tmp_path)
  assert out.returncode == 0, out.stderr
  assert outcome(tmp_path) == reference
  if falls_back:
    assert "checkpoint 6 is unreadable" in out.stdout
    assert "resumed from step 4" in out.stdout
    assert glob.glob(os.path.join(d, "bad_checkpoints", "6-*"))  # kept
  else:
    assert "resumed from step 6" in out.stdout


@pytest.mark.slow
def test_no_readable_checkpoint_stops_and_moves_nothing(killed_at_6, tmp_path):
  d = _copy(killed_at_6, tmp_path)
  for step in ("4", "6"):
    _empty_dir(os.path.join(d, "checkpoints", step))
  before = _snapshot(d)
  out = run(tmp_path)
  assert_clean_error(out, "no checkpoint in", "step 6", "step 4", "--restart")
  assert _snapshot(d) == before


@pytest.mark.slow
def test_opt_change_the_checkpoint_cannot_take_is_refused_unchanged(
  killed_at_6, tmp_path
):
  # Dropping gradient clipping changes the optimizer state's structure.
  d = _copy(killed_at_6, tmp_path)
  before = _snapshot(d)
  out = run(tmp_path, "--config.opt.clip_norm=0", "--allow_opt_change")
  assert_clean_error(out, "no checkpoint in", "opt.clip_norm", "keep it")
  assert _snapshot(d) == before  # config.json and env.json put back


@pytest.mark.slow
def test_resume_under_another_state_recipe_is_refused_naming_both(tmp_path):
  """A run storing nu as dynamic8u (uint8 codes), its config.json then
  edited to store it as float8_e4m3fn with amax scales (the ledger
  refuses such a change made on the command line): the checkpoint
  restored the codes into the new dtype and the run went on with them.
  Now the resume is refused before anything is restored, naming both
  recipes, and every file is left as it was."""
  old, new = "nu=dynamic8u:block256", "nu=float8_e4m3fn:nearest:block256:amax"
  args = [BASE[0], "--config.ckpt.every_steps=2"]
  out = run(tmp_path, f"--config.lowprec.state=({old!r},)", args=args)
  assert out.returncode == 0, out.stderr
  d = run_dir(tmp_path)
  os.remove(os.path.join(d, "summary.json"))  # as if killed at the end
  config = results.read_json(os.path.join(d, "config.json"))
  config["lowprec"]["state"] = [new]
  config["train"]["steps"] = 10
  results.write_json(os.path.join(d, "config.json"), config)
  before = _snapshot(d)
  out = run(
    tmp_path,
    f"--config.lowprec.state=({new!r},)",
    "--config.train.steps=10",
    args=args,
  )
  assert_clean_error(
    out,
    "checkpoint 8",
    "recorded 'dynamic8u:nearest:block256', this run "
    "'float8_e4m3fn:nearest:block256:amax'",
    "lowprec.state",
    "--restart",
  )
  assert _snapshot(d) == before


def _cut_line(path, index):
  with open(path) as f:
    lines = f.readlines()
  lines[index] = lines[index][: len(lines[index]) // 2] + "\n"
  with open(path, "w") as f:
    f.writelines(lines)


def test_metrics_resume_keeps_exactly_the_restored_steps(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  lines = [json.dumps({"step": s, "loss": 1.0 / (s + 1)}) for s in range(7)]
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n" + '{"step": 7, "lo')  # cut by a kill
  w = results.MetricsWriter(path, resume_step=4)
  w.write({"step": 5, "loss": 0.5})
  w.close()
  steps = [r["step"] for r in results.read_metrics(path)]
  assert steps == [0, 1, 2, 3, 4, 5]
  assert results.read_metrics(path)[:5] == [json.loads(x) for x in lines[:5]]
  # From step 0 the file starts over: no second step-0 line.
  results.MetricsWriter(path, resume_step=0).close()
  assert os.path.getsize(path) == 0


def test_metrics_corrupt_middle_line_stops_and_drops_nothing(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  lines = [json.dumps({"step": s}) + "\n" for s in range(9)]
  with open(path, "w") as f:
    f.writelines(lines)
  _cut_line(path, 3)
  before = open(path).read()
  with pytest.raises(
    results.MetricsError, match=r"metrics.jsonl:4: .*--restart"
  ):
    results.MetricsWriter(path, resume_step=6)
  with pytest.raises(results.MetricsError, match=r"metrics.jsonl:4:"):
    results.read_metrics(path)
  assert open(path).read() == before
  # A missing step up to the restored one is refused the same way.
  with open(path, "w") as f:
    f.writelines(lines[:3] + lines[4:])
  with pytest.raises(results.MetricsError, match="line 4 has step 4"):
    results.MetricsWriter(path, resume_step=6)


@pytest.mark.slow
def test_metrics_line_damage_through_the_entry_point(
  killed_at_6, tmp_path, reference
):
  d = _copy(killed_at_6, tmp_path / "middle")
  metrics = os.path.join(d, "metrics.jsonl")
  _cut_line(metrics, 2)
  before = _snapshot(d)
  out = run(tmp_path / "middle")
  assert_clean_error(out, "metrics.jsonl:3:")
  assert _snapshot(d) == before
  # A torn last line (a kill mid-write) is dropped and written again.
  d = _copy(killed_at_6, tmp_path / "torn")
  with open(os.path.join(d, "metrics.jsonl"), "a") as f:
    f.write('{"step": 7, "loss": 5.')
  out = run(tmp_path / "torn")
  assert out.returncode == 0, out.stderr
  assert outcome(tmp_path / "torn") == reference
  # Deleted metrics with checkpoints there: refused, nothing written.
  d = _copy(killed_at_6, tmp_path / "deleted")
  os.remove(os.path.join(d, "metrics.jsonl"))
  before = _snapshot(d)
  out = run(tmp_path / "deleted")
  assert_clean_error(out, "metrics.jsonl is missing", "--restart")
  assert _snapshot(d) == before


@pytest.mark.slow
@pytest.mark.parametrize("how", ["deleted", "corrupt"])
def test_lost_summary_is_rebuilt_equal(how, tmp_path, reference_dir, reference):
  d = _copy(reference_dir, tmp_path)
  path = os.path.join(d, "summary.json")
  if how == "deleted":
    os.remove(path)
  else:
    with open(path, "w") as f:
      f.write('{"status": "fini')
  out = run(tmp_path)
  assert out.returncode == 0, out.stderr
  assert outcome(tmp_path) == reference
  if how == "corrupt":
    assert os.path.exists(path + ".unreadable")  # kept


@pytest.mark.slow
@pytest.mark.parametrize("how", ["deleted", "corrupt"])
def test_lost_config_json_is_refused(how, killed_at_6, tmp_path):
  d = _copy(killed_at_6, tmp_path)
  path = os.path.join(d, "config.json")
  if how == "deleted":
    os.remove(path)
  else:
    with open(path, "w") as f:
      f.write("{")
  before = _snapshot(d)
  out = run(tmp_path)
  needle = "no config.json" if how == "deleted" else "config.json is not valid"
  assert_clean_error(out, needle, "--restart")
  assert _snapshot(d) == before


def _token_dir(path, n=4096):
  os.makedirs(path)
  rng = np.random.default_rng(0)
  for split in ("train", "val"):
    rng.integers(0, 256, n, dtype=np.uint16).tofile(f"{path}/{split}.bin")
  with open(f"{path}/meta.json", "w") as f:
    json.dump({"vocab_size": 256, "tokenizer": "byte"}, f)


TOKENS = ["--config.data.name=tokens"]


@pytest.mark.slow
@pytest.mark.parametrize(
  "damage, needle",
  [
    ("meta", "meta.json is not valid JSON"),
    ("odd", "train.bin is 4097 bytes"),
    ("deleted", "val.bin not found"),
  ],
  ids=["corrupt-meta.json", "truncated-token-file", "deleted-token-file"],
)
def test_damaged_token_files_name_the_file(damage, needle, tmp_path):
  data = str(tmp_path / "tokens")
  _token_dir(data)
  if damage == "meta":
    with open(f"{data}/meta.json", "w") as f:
      f.write('{"vocab_size": 2')
  elif damage == "odd":
    with open(f"{data}/train.bin", "ab") as f:
      f.write(b"\0")
    needle = needle.replace("4097", str(os.path.getsize(f"{data}/train.bin")))
  else:
    os.remove(f"{data}/val.bin")
  out = run(tmp_path, *TOKENS, f"--config.data.path={data}")
  assert_clean_error(out, needle, code=1)
  assert data in out.stderr


# --- failed writes and non-finite losses


def _mount_tmpfs(path, options):
  os.makedirs(path, exist_ok=True)
  if os.geteuid() != 0 or not shutil.which("mount"):
    return False
  r = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
    capture_output=True,
  )
  return r.returncode == 0


def _small_files():
  # Without a mountable tmpfs: files past 64 KiB fail to grow (EFBIG), as
  # checkpoint arrays do; JSON records and metrics lines stay below.
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))


@pytest.mark.slow
@pytest.mark.parametrize(
  "options, reason",
  [("size=150k", "No space left"), ("size=1m,ro", "Read-only file system")],
  ids=["no-space", "read-only"],
)
def test_failed_checkpoint_write_exits_promptly_and_keeps_the_rest(
  options, reason, tmp_path, reference
):
  ckpts = os.path.join(run_dir(tmp_path), "checkpoints")
  mounted = _mount_tmpfs(ckpts, options)
  if not mounted and "ro" in options:
    pytest.skip("no tmpfs can be mounted here")
  try:
    t0 = time.time()
    out = run(
      tmp_path, timeout=120, preexec_fn=None if mounted else _small_files
    )
    took = time.time() - t0
  finally:
    if mounted:
      subprocess.run(["umount", ckpts], check=True)
  assert_clean_error(out, "writing a checkpoint", "failed", "rerun", code=1)
  assert took < 120  # it used to hang at exit on orbax's threads
  kept = results.read_metrics(os.path.join(run_dir(tmp_path), "metrics.jsonl"))
  assert kept and kept[0]["step"] == 0  # the lines written are kept
  if mounted:
    assert reason in out.stderr
  out = run(tmp_path)  # space again: the rerun equals the uninterrupted run
  assert out.returncode == 0, out.stderr
  assert outcome(tmp_path) == reference


NAN = [
  "--config=configs/smoke.py:arm=fp32_reference",
  "--config.train.steps=8",
  "--config.ckpt.every_steps=1",
  "--config.opt.clip_norm=0",
  "--config.opt.lr=1e30",
]


@pytest.mark.slow
def test_non_finite_loss_keeps_a_finite_checkpoint_and_lower_lr_resumes(
  tmp_path,
):
  out = run(tmp_path, args=NAN)
  assert_clean_error(out, "non-finite loss", "--allow_opt_change", code=1)
  d = run_dir(tmp_path, "fp32_reference")
  kept = max(
    int(p) for p in os.listdir(os.path.join(d, "checkpoints")) if p.isdigit()
  )
  assert f"step {kept}; its params had a finite loss" in out.stderr
  # The advised rerun: a lower lr is a changed config, refused without the
  # flag, then continued from the kept checkpoint with it.
  low = [*NAN[:-1], "--config.opt.lr=1e-3"]
  refused = run(tmp_path, args=low)
  assert_clean_error(refused, "opt.lr: 1e+30 -> 0.001", "--allow_opt_change")
  out = run(tmp_path, "--allow_opt_change", args=low)
  assert out.returncode == 0, out.stderr
  assert f"resumed from step {kept}" in out.stdout
  summary = results.read_json(os.path.join(d, "summary.json"))
  assert np.isfinite(summary["final_loss"]) and summary["resumed_from"] == kept
  recs = results.read_metrics(os.path.join(d, "metrics.jsonl"))
  assert [r["step"] for r in recs] == list(range(9))
  assert all(np.isfinite(r["loss"]) for r in recs[1:])
  env = results.read_json(os.path.join(d, "env.json"))
  assert env["changed_keys"] == {"opt.lr": [1e30, 1e-3]}
  assert results.read_json(os.path.join(d, "config.json"))["opt"]["lr"] == 1e-3


# --- bad inputs

# (id, extra args, devices, message fragments): each exits 2, one message.
BAD = [
  (
    "unknown-key",
    ["--config.opt.lrr=1"],
    1,
    ["Did you mean 'opt.lr'", "clip_norm"],
  ),
  ("unknown-section", ["--config.optim.lr=1"], 1, ["Did you mean 'opt'"]),
  ("bad-value", ["--config.opt.lr=abc"], 1, ["--config.opt.lr=abc"]),
  ("bad-arg", ["--config=configs/smoke.py:armm=x"], 1, ["bad config argument"]),
  ("missing-config-file", ["--config=configs/nope.py"], 1, ["no such file"]),
  ("unknown-flag", ["--restartt"], 1, ["restart"]),
  ("steps-negative", ["--config.train.steps=-5"], 1, ["train.steps=-5"]),
  (
    "eval-every-zero",
    ["--config.train.eval_every_steps=0"],
    1,
    ["train.eval_every_steps=0"],
  ),
  (
    "progress-zero",
    ["--config.log.progress_every_steps=0"],
    1,
    ["log.progress_every_steps=0"],
  ),
  (
    "ckpt-every-negative",
    ["--config.ckpt.every_steps=-1"],
    1,
    ["ckpt.every_steps=-1"],
  ),
  ("ckpt-keep-zero", ["--config.ckpt.keep=0"], 1, ["ckpt.keep=0"]),
  ("seed-negative", ["--config=configs/smoke.py:seed=-3"], 1, ["seed must be"]),
  (
    "seed-not-in-study",
    ["--config=configs/smoke.py:seed=7"],
    1,
    ["study.seeds"],
  ),
  (
    "empty-results-dir",
    ["--config.log.results_dir="],
    1,
    ["log.results_dir is empty"],
  ),
  (
    "batch-vs-devices",
    ["--config.data.batch_size=12", "--config.train.virtual_shards=0"],
    8,
    ["data.batch_size=12", "device count 8"],
  ),
  (
    "batch-vs-shards",
    ["--config.data.batch_size=12"],
    8,
    ["train.virtual_shards=16"],
  ),
  (
    "shards-vs-devices",
    ["--config.train.virtual_shards=4"],
    8,
    ["multiple of the device count 8"],
  ),
  (
    "fsdp-vs-devices",
    ["--config.train.fsdp=3", "--config.train.virtual_shards=0"],
    8,
    ["train.fsdp=3"],
  ),
  (
    "config-twice",
    ["--config=configs/smoke.py", "--config=configs/smoke.py:arm=rn_bf16"],
    1,
    ["--config is given 2 times"],
  ),
  (
    "unknown-arm",
    ["--config=configs/smoke.py:arm=rn_bf17"],
    1,
    ["Did you mean 'rn_bf16'"],
  ),
  (
    "state-two-roundings",
    ['--config.lowprec.state=("nu=bfloat16:stochastic:nearest",)'],
    1,
    ["gives the rounding twice", "'bfloat16:stochastic' or 'bfloat16:nearest'"],
  ),
  (
    "state-two-scales",
    ['--config.lowprec.state=("nu=float8_e4m3fn:tensor:block128",)'],
    1,
    ["gives the scale twice", "'float8_e4m3fn:tensor' or"],
  ),
  (
    "state-int-without-scale",
    ['--config.lowprec.state=("nu=int8:nearest",)'],
    1,
    ["'int8:nearest:block128' or 'int8:nearest:tensor'"],
  ),
]
FAST_BAD = {
  "unknown-key",
  "bad-arg",
  "steps-negative",
  "batch-vs-devices",
  "state-two-roundings",
}


def test_missing_config_flag_is_one_message():
  out = subprocess.run(
    [sys.executable, "-m", "experiments.run"],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert_clean_error(out, "missing --config", "configs/smoke.py")


@pytest.mark.parametrize(
  "extra, devices, needles",
  [
    pytest.param(
      e, dv, n, id=i, marks=() if i in FAST_BAD else pytest.mark.slow
    )
    for i, e, dv, n in BAD
  ],
)
def test_bad_input_is_one_message_exit_2(tmp_path, extra, devices, needles):
  given = any(a.startswith("--config=") for a in extra)
  args = extra if given else [BASE[0], *extra]
  if "--config.log.results_dir=" in extra:
    # Run from an empty directory: were the value accepted, files would
    # land there, not in the repository.
    args = [a.replace("configs/", f"{ROOT}/configs/") for a in BASE[:1]]
    env = _env(devices)
    env["PYTHONPATH"] = ROOT
    out = run(None, *extra, args=args, cwd=str(tmp_path), env=env)
    assert_clean_error(out, *needles)
    assert os.listdir(tmp_path) == []
    return
  out = run(tmp_path, args=args, devices=devices)
  assert_clean_error(out, *needles)
  assert not glob.glob(f"{tmp_path}/*/*/*/checkpoints")  # nothing trained


def test_traceback_flag_shows_the_traceback(tmp_path):
  out = run(tmp_path, "--config.opt.lrr=1", "--traceback")
  assert out.returncode != 0 and "Traceback" in out.stderr


# --- error messages name only real config keys

SECTIONS = ("study", "model", "data", "opt", "lowprec", "train", "log", "ckpt")
FILE_SUFFIXES = {"bin", "json", "jsonl", "py", "md", "txt", "npz"}
_DOTTED = re.compile(r"(?<![\w.])(" + "|".join(SECTIONS) + r")\.([a-z_]+)\b")


def _all_keys():
  from configs import common

  keys = set(ledger.flatten(common.get_config().to_dict()))
  for path in glob.glob(os.path.join(ROOT, "configs", "*.py")):
    name = os.path.basename(path)[:-3]
    if name in ("__init__", "common", "presets"):
      continue
    mod = __import__(f"configs.{name}", fromlist=["get_config"])
    keys |= set(ledger.flatten(mod.get_config().to_dict()))
  return {k for k in keys} | {".".join(k.split(".")[:2]) for k in keys}


KEYS = _all_keys()


def named_keys(text):
  return {
    f"{a}.{b}" for a, b in _DOTTED.findall(text) if b not in FILE_SUFFIXES
  }


def assert_real_keys(text):
  unknown = named_keys(text) - KEYS
  assert not unknown, (unknown, text)


def _raise_strings(path):
  """The literal text of every `raise` statement in a module."""
  tree = ast.parse(open(path).read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Raise):
      for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
          yield sub.lineno, sub.value


def test_error_messages_name_only_real_config_keys():
  files = glob.glob(
    os.path.join(ROOT, "experiments", "**", "*.py"), recursive=True
  )
  files += glob.glob(os.path.join(ROOT, "configs", "*.py"))
  named, bad = 0, []
  for path in files:
    for line, text in _raise_strings(path):
      for key in named_keys(text):
        named += 1
        if key not in KEYS:
          bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {key}")
  assert named > 20  # the scan does find the keys messages name
  assert not bad, bad
  assert named_keys("Lower data.seq_len; see train.bin") == {"data.seq_len"}
  assert "data.seq_len" not in KEYS and "model.seq_len" in KEYS
