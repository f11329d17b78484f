"""The roofline of a full-scale step (`experiments.costs.roofline`): the
split of XLA's byte count by what it grows with, the bytes of a step from
that split, and the command that prints it."""

import json
import os
import subprocess
import sys

import pytest

from experiments import costs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A made-up traffic: (optimizer, weights a pass, a token, a token^2).
LAYER = (7.0e6, 3.0e6, 5.0e3, 11.0)
REST = (2.0e6, 1.0e6, 9.0e3, 0.0)


def _pass_bytes(part, seq, rows):
  """A gradient pass of `rows` rows of `seq` tokens under `part`."""
  _, weights, tok, sq = part
  return weights + rows * (tok * seq + sq * seq * seq)


@pytest.mark.parametrize("part", [LAYER, REST])
def test_the_fit_recovers_the_parts_of_a_known_traffic(part):
  # Three passes, (s, 1), (s, 2) and (2s, 1), determine weights, the
  # per-token and the per-square bytes; the optimizer's are given.
  grad = {
    (s, rows): _pass_bytes(part, s, rows) for s, rows in ((128, 1), (128, 2))
  }
  grad[(256, 1)] = _pass_bytes(part, 256, 1)
  fitted = costs._fit_traffic(part[0], grad)
  assert fitted == pytest.approx(part, rel=1e-9, abs=1e-9)


def test_step_bytes_counts_the_optimizer_once_and_weights_per_pass():
  t = costs.Traffic(LAYER, REST)
  n_layer, rows, passes, seq = 12, 64, 8, 1024

  def by_hand(square):
    total = 0.0
    for (opt, weights, tok, sq), n in ((LAYER, n_layer), (REST, 1)):
      per_row = tok * seq + (sq * seq**2 if square else 0.0)
      total += n * (opt + passes * weights + rows * per_row)
    return total

  for square in (True, False):
    got = t.step_bytes(n_layer, rows, passes, seq, square=square)
    assert got == pytest.approx(by_hand(square), rel=1e-12)
  # Half the activations: the rows' bytes halve, nothing else moves.
  half = t.activations_scaled(0.5)
  assert half.layer == (7.0e6, 3.0e6, 2.5e3, 5.5)
  whole = t.step_bytes(n_layer, rows, passes, seq)
  fixed = n_layer * (7.0e6 + passes * 3.0e6) + 2.0e6 + passes * 1.0e6
  assert half.step_bytes(n_layer, rows, passes, seq) == pytest.approx(
    fixed + (whole - fixed) / 2, rel=1e-12
  )


@pytest.mark.slow
def test_roofline_through_the_command_on_a_narrow_gpt(tmp_path):
  """`plan_full_scale --roofline` on the 124M config narrowed to width
  32: one JSON line per device; the model's FLOPs are `model_flops` of
  its parameters; the bound without overlap is the sum of its parts and
  below the overlapped one; bytes grow with layers and rows."""
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "scripts.plan_full_scale",
      "--roofline",
      "--config",
      "freeze_gpt2_fp8",
      "--recipe",
      "float32",
      "--model",
      "d_model=32,n_head=2",
      "--device",
      "H100",
      "--device",
      "H200",
      "--data_dir",
      str(tmp_path),
    ],
    cwd=ROOT,
    env=dict(
      os.environ,
      XLA_FLAGS="--xla_force_host_platform_device_count=1",
      JAX_PLATFORMS="cpu",
    ),
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  rows = [json.loads(line) for line in out.stdout.splitlines()]
  assert [r["device"] for r in rows] == ["H100", "H200"]
  for r in rows:
    assert r["step_s"] == pytest.approx(r["matmul_s"] + r["memory_s"])
    assert 0 < r["mfu"] < r["mfu_overlapped"] <= 1
    assert r["matmul"] == "tf32" and r["attention_square"] is False
    layer, rest = r["traffic"]["layer"], r["traffic"]["rest"]
    assert min(layer[:3]) > 0 and min(rest[:3]) > 0
  # 12 layers of width 32 (7 d^2 + 13 d parameters a layer) and the
  # tied 50304 x 32 embedding, 524,288 tokens a step.
  d, n_layer, vocab, seq = 32, 12, 50304, 1024
  n = n_layer * (12 * d * d + 13 * d) + vocab * d + 2 * d
  want = costs.model_flops(n, n_layer, d, seq) * 524_288
  assert rows[0]["model_tflop"] * 1e12 == pytest.approx(want, rel=0.01)
  # The H200's bandwidth is 4.8 / 3.35 the H100's, for the same bytes.
  assert rows[0]["memory_s"] / rows[1]["memory_s"] == pytest.approx(4.8 / 3.35)
  assert "on H200" in out.stderr and "MFU" in out.stderr


def test_model_overrides_take_names(capsys):
  from scripts import plan_full_scale

  parser = plan_full_scale.argparse.ArgumentParser()
  got = plan_full_scale._model_overrides(
    parser, "n_layer=2,scan_layers=false,compute_dtype=bfloat16"
  )
  assert got == {
    "n_layer": 2,
    "scan_layers": False,
    "compute_dtype": "bfloat16",
  }
  with pytest.raises(SystemExit):
    plan_full_scale._model_overrides(parser, "d_model=3.5")
  assert "key=name" in capsys.readouterr().err


def test_traffic_refuses_a_process_of_several_devices(tmp_path):
  # The test process has 8 host devices: the byte count would be of a
  # sharded program, not one chip's. Refused, naming the fix.
  import jax

  assert jax.device_count() == 8
  c = costs.full_config("freeze_gpt2_fp8", str(tmp_path))
  with pytest.raises(ValueError, match="device_count=1"):
    costs.traffic(c)


def test_fusions_counts_the_copies_of_a_layers_fusions_once():
  # Two and eight layers of the same per-leaf step: XLA makes a fusion
  # per leaf (the total grows), all copies of the same few (the distinct
  # count does not); a leaf of another shape adds one of its own.
  import jax
  import jax.numpy as jnp

  def step(tree):
    return jax.tree.map(lambda x: jnp.sqrt(jnp.abs(x)) * 0.5 + x * x, tree)

  def counts(n_layer, extra=False):
    tree = {f"h_{i}": jnp.ones((64, 32)) for i in range(n_layer)}
    if extra:
      tree["wte"] = jnp.ones((40, 32))
    hlo = jax.jit(step).lower(tree).compile().as_text()
    assert costs.fusions(hlo)[0] == hlo.count(" fusion(")  # every one
    return costs.fusions(hlo)

  (t2, d2), (t8, d8) = counts(2), counts(8)
  assert t8 == 4 * t2 and t2 >= 2, (t2, t8)
  assert d8 == d2 >= 1, (d2, d8)
  assert counts(8, extra=True) == (t8 + t2 // 2, d8 + 1)
