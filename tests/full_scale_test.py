"""The full-scale configs build, compile and step on the CPU (slow).

GPT-2 124M (`freeze_gpt2_fp8`, with the gradient probe turned on, rows in
chunks of one) and the 390M GPT (`attention_reuse`, one row of 1024 tokens,
its lean probe of the QKV kernels with rematerialised blocks: two draws of
two rows, one row at a time) on synthetic token files, one process and one
device: the loss is finite, the probe gives finite numbers, and the process
stays within the memory of a 24 GB machine (390M: 16.8 GB measured).
75-88 s and 6-6.5 minutes on 2 CPU cores (AMD EPYC, blocks stored stacked);
run with `-m slow`, one at a time.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
  "freeze_gpt2_fp8": (
    "--batch_size=2",
    "--virtual_shards=2",
    "--probe_every_steps=1",
    "--probe_draws=2",
    "--probe_batch_size=2",
    "--probe_chunk_rows=1",
  ),
  "attention_reuse": (
    "--batch_size=1",
    "--virtual_shards=1",
    "--probe_every_steps=1",
    "--probe_draws=2",
    "--probe_batch_size=2",
    "--probe_chunk_rows=1",
    "--probe_remat",
    "--probe_groups=qkv=.*attn/qkv/kernel",
  ),
}
PARAMS = {"freeze_gpt2_fp8": 124_439_808, "attention_reuse": 392_659_968}
MEMORY_BYTES = 22e9  # 390M with its probe: 16.8 GB measured, of 24 GB


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_full_scale_config_steps_on_the_cpu(name, tmp_path):
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [
    sys.executable,
    "-m",
    "scripts.plan_full_scale",
    "--step",
    f"--config={name}",
    f"--data_dir={tmp_path}",
    *CASES[name],
  ]
  out = subprocess.run(
    cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000
  )
  assert out.returncode == 0, out.stderr[-4000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  print(json.dumps(result, indent=1))
  assert all(isinstance(x, float) and x == x for x in result["losses"])
  assert result["losses"][0] < 20  # about ln(vocab) = 10.8 at init
  assert result["params"] == PARAMS[name]
  assert result["probe"] and all(v == v for v in result["probe"].values())
  assert result["peak_rss_bytes"] < MEMORY_BYTES
