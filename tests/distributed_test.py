"""Multi-process runs through the real entry point, on one machine (gloo).

Every run is `configs/smoke.py`'s stochastic write-back arm with a reference
trace, compared with one uninterrupted process on one device: the final
params digest, every metrics line (telemetry included) and the trace must
be the same bits. Each process is a subprocess with a timeout; ports are
free ports on 127.0.0.1.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from experiments import distributed, faults, results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join("smoke", "sr_bf16", "seed0")
ARGS = (
  "--config=configs/smoke.py:arm=sr_bf16",
  "--config.lowprec.trace_targets=('bfloat16',)",
)
TIMEOUT_S = 400  # per process; a healthy run takes well under a minute
# A process silent this long counts as dead. Generous for the runs that must
# finish: on 2 loaded cores (three processes compiling beside another test)
# a live process may miss a 10 s heartbeat, and the runtime then aborts it.
HEARTBEAT_S = 60
# Short only where the test measures how fast a lost process is noticed.
KILL_HEARTBEAT_S = 10


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(
  tmp,
  processes: int,
  devices: int,
  *args,
  base=ARGS,
  fault=None,
  heartbeat=HEARTBEAT_S,
) -> list:
  env = dict(os.environ)
  env.pop(faults.ENV, None)
  if fault:
    env[faults.ENV] = fault
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [
    sys.executable,
    "-m",
    "experiments.run",
    *base,
    *args,
    f"--config.log.results_dir={tmp}",
  ]
  if processes > 1:
    cmd += [
      f"--coordinator_address=127.0.0.1:{_free_port()}",
      f"--num_processes={processes}",
      f"--heartbeat_timeout_seconds={heartbeat}",
    ]
  os.makedirs(tmp, exist_ok=True)
  procs = []
  for i in range(processes):
    extra = [f"--process_id={i}"] if processes > 1 else []
    # Files, not pipes: a full pipe would stall a process in a collective.
    logs = [
      open(os.path.join(tmp, f"p{i}.{n}.{time.time_ns()}"), "w+")
      for n in ("out", "err")
    ]
    p = subprocess.Popen(
      cmd + extra, cwd=ROOT, env=env, stdout=logs[0], stderr=logs[1]
    )
    p.logs = logs
    procs.append(p)
  return procs


def _finish(procs, timeout=TIMEOUT_S) -> list:
  """(returncode, stdout, stderr) of each process; kills any left over."""
  deadline = time.time() + timeout
  try:
    for p in procs:
      try:
        p.wait(timeout=max(1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        break
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  out = []
  for p in procs:
    text = []
    for f in p.logs:
      f.seek(0)
      text.append(f.read())
      f.close()
    out.append((p.returncode, *text))
  return out


def _run(tmp, processes=1, devices=1, *args) -> list:
  return _finish(_launch(tmp, processes, devices, *args))


def _ok(outs) -> None:
  """Every process exited 0; otherwise each failed one's cause, not only the
  first's (a process the runtime aborts often reports its peer's failure)."""
  failed = []
  for i, (rc, stdout, stderr) in enumerate(outs):
    if rc == 0:
      continue
    why = "timed out" if rc == -signal.SIGKILL else f"exited {rc}"
    # The cause comes before the stack dump: keep it, drop the frames.
    said = "\n".join(
      line for line in stderr.splitlines() if not line.startswith("  File ")
    )
    failed.append(f"process {i} {why}:\n{stdout[-2000:]}\n{said[-3000:]}")
  assert not failed, "\n\n".join(failed)


def _record(tmp, run=RUN) -> tuple:
  """What must be the same bits: params digest, metrics lines."""
  d = os.path.join(tmp, run)
  with open(os.path.join(d, "summary.json")) as f:
    digest = json.load(f)["param_digest"]
  recs = results.read_metrics(os.path.join(d, "metrics.jsonl"))
  timing = ("wall_s", "steps_per_s", "time")
  return digest, [{k: v for k, v in r.items() if k not in timing} for r in recs]


def _lines(tmp) -> int:
  path = os.path.join(tmp, RUN, "metrics.jsonl")
  return len(open(path).read().splitlines()) if os.path.exists(path) else 0


def _wait_until(ready, procs, what: str, timeout=TIMEOUT_S) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if ready():
      return
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.05)
  outs = _finish(procs, 1)
  pytest.fail(f"never {what}: {[o[2][-2000:] for o in outs]}")


_REFERENCE = {}  # the one-process record, computed once per session


@pytest.fixture()
def reference(tmp_path_factory):
  """One process, one device, uninterrupted."""
  if not _REFERENCE:
    tmp = tmp_path_factory.mktemp("one")
    _ok(_run(tmp))
    _REFERENCE["record"] = _record(tmp)
  return _REFERENCE["record"]


@pytest.mark.slow
def test_two_processes_give_the_bits_of_one_and_process_0_writes(
  tmp_path_factory, tmp_path
):
  one = tmp_path_factory.mktemp("one")
  # The reference runs alongside, to keep the test short.
  outs = _finish(_launch(tmp_path, 2, 1) + _launch(one, 1, 1))
  _ok(outs)
  _REFERENCE["record"] = _record(one)
  digest, recs = _record(tmp_path)
  assert digest == _REFERENCE["record"][0]
  assert recs == _REFERENCE["record"][1]
  assert any(k.startswith("pred/") for k in recs[-1]), "no reference trace"
  assert any(k.startswith("erased") for k in recs[-1]), "no telemetry"
  # Written once, by process 0: each step one line, progress on its stdout.
  assert [r["step"] for r in recs] == list(range(len(recs)))
  assert "steps/s" in outs[0][1] and "steps/s" not in outs[1][1]
  with open(os.path.join(tmp_path, RUN, "env.json")) as f:
    env = json.load(f)
  assert env["process_count"] == 2
  assert sorted(env["process_devices"]) == ["0", "1"]


@pytest.mark.slow
def test_two_processes_of_four_devices_give_the_bits_of_one(
  reference, tmp_path
):
  _ok(_run(tmp_path, 2, 4))
  assert _record(tmp_path) == reference


@pytest.mark.slow
def test_both_processes_killed_then_rerun_give_the_same_bits(
  reference, tmp_path
):
  procs = _launch(tmp_path, 2, 1)
  ckpt = os.path.join(tmp_path, RUN, "checkpoints", "4")
  _wait_until(lambda: os.path.isdir(ckpt), procs, "saved step 4")
  for p in procs:
    p.send_signal(signal.SIGKILL)
  _finish(procs, 30)
  assert not os.path.exists(os.path.join(tmp_path, RUN, "summary.json"))
  outs = _run(tmp_path, 2, 1)
  _ok(outs)
  assert "resumed from step" in outs[0][1]
  assert _record(tmp_path) == reference


@pytest.mark.slow
def test_a_broken_checkpoint_is_set_aside_once_and_both_fall_back(
  reference, tmp_path
):
  every = "--config.ckpt.every_steps=2"
  procs = _launch(tmp_path, 2, 1, every, fault="after_checkpoint:6")
  outs = _finish(procs, TIMEOUT_S)
  # Each process kills itself after the checkpoint; on a loaded machine
  # the distributed runtime may see its peer die first and abort it.
  codes = sorted(rc for rc, *_ in outs)
  assert codes in (
    [-signal.SIGKILL] * 2,
    sorted([-signal.SIGKILL, -signal.SIGABRT]),
  ), outs[0][2][-2000:]
  ckpts = os.path.join(tmp_path, RUN, "checkpoints")
  files = [
    os.path.join(d, f)
    for d, _, fs in os.walk(os.path.join(ckpts, "6"))
    for f in fs
  ]
  big = max(files, key=os.path.getsize)
  with open(big, "r+b") as f:
    f.truncate(os.path.getsize(big) // 3)
  outs = _run(tmp_path, 2, 1, every)
  _ok(outs)
  assert "checkpoint 6 is unreadable" in outs[0][1]
  assert "resumed from step 4" in outs[0][1]
  aside = os.listdir(os.path.join(tmp_path, RUN, "bad_checkpoints"))
  assert len(aside) == 1 and aside[0].startswith("6-"), aside
  assert _record(tmp_path) == reference


@pytest.mark.slow
def test_a_killed_process_makes_the_other_exit_in_bounded_time(tmp_path):
  procs = _launch(
    tmp_path, 2, 1, "--config.train.steps=400", heartbeat=KILL_HEARTBEAT_S
  )
  _wait_until(lambda: _lines(tmp_path) >= 3, procs, "reached step 2")
  procs[1].send_signal(signal.SIGKILL)
  killed = time.time()
  bound = KILL_HEARTBEAT_S + distributed.SLACK_S
  (rc, _, stderr), _ = _finish(procs, bound + 30)
  waited = time.time() - killed
  print(f"process 0 exited {rc} {waited:.1f} s after process 1 was killed")
  assert rc != 0
  assert waited < bound, waited
  assert "lost process(es) [1]" in stderr, stderr[-3000:]


@pytest.mark.slow
def test_fsdp_on_two_processes_gives_the_bits_of_one_device(tmp_path):
  # float32 parameters: no grid rounding hides a last-bit difference.
  base = ("--config=configs/smoke.py:arm=fp32_reference",)
  one, two = tmp_path / "one", tmp_path / "two"
  _ok(
    _finish(
      _launch(one, 1, 1, base=base)
      + _launch(two, 2, 4, "--config.train.fsdp=8", base=base)
    )
  )
  run = os.path.join("smoke", "fp32_reference", "seed0")
  assert _record(one, run) == _record(two, run)


@pytest.mark.slow
def test_stacked_layers_sharded_on_two_processes_give_the_bits_of_one(
  tmp_path,
):
  # The layers stored stacked, sharded over two processes: stepped,
  # checkpointed apart and summarized by every process together.
  stack = (
    "--config.model.n_layer=2",
    "--config.model.scan_layers=True",
    "--config.model.layer_storage=stacked",
  )
  one, two = tmp_path / "one", tmp_path / "two"
  _ok(
    _finish(
      _launch(one, 1, 1, *stack)
      + _launch(two, 2, 4, "--config.train.fsdp=8", *stack)
    )
  )
  assert _record(one) == _record(two)
