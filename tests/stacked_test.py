"""Layers stored stacked (`lowprec.engine.stacked`, `model.layer_storage`).

Oracle: the same layers stored apart, one leaf per layer. A write-back
over stacked layers gives the apart run's bits (every stochastic draw
from each layer's own path), its telemetry key for key, and the
fixed-order norm its bits; through the entry point, a run with
`model.layer_storage="stacked"` gives the apart run's parameter digest,
losses and telemetry, after a kill and resume, and checkpoints the
layers apart.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowprec
from experiments import optim
from lowprec.engine import stacked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUPS = [("h", 0, 2), ("h", 2, 3)]  # a run of two layers, then one


def _params(seed=1):
  k = jax.random.key(seed)

  def layer(i):
    a, b = jax.random.split(jax.random.fold_in(k, i))
    return {
      "attn": {"kernel": jax.random.normal(a, (8, 64))},
      "ln": {"scale": 1 + 0.1 * jax.random.normal(b, (64,))},
    }

  return {f"h_{i}": layer(i) for i in range(3)} | {
    "wte": jax.random.normal(jax.random.fold_in(k, 9), (4, 64))
  }


def _equal_trees(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _same_report(a: dict, b: dict):
  """Equal key for key, in order; NaN (a fraction without proposals)
  equal to NaN."""
  assert list(a) == list(b)
  for k in a:
    x, y = a[k], b[k]
    if isinstance(x, float) and math.isnan(x):
      assert isinstance(y, float) and math.isnan(y), k
    else:
      assert x == y, (k, x, y)


def test_names_and_trees_convert_both_ways():
  assert stacked.layer_names("h_0:3/attn/kernel") == [
    "h_0/attn/kernel",
    "h_1/attn/kernel",
    "h_2/attn/kernel",
  ]
  assert stacked.layer_names("blocks_4:6") == ["blocks_4", "blocks_5"]
  assert stacked.layer_names("h_3/attn/kernel") is None
  assert stacked.count_shape("h_0:3/w") == (3,)
  params = _params()
  stored = stacked.stack(params, GROUPS)
  assert sorted(stored) == ["h_0:2", "h_2:3", "wte"]
  assert stored["h_0:2"]["attn"]["kernel"].shape == (2, 8, 64)
  np.testing.assert_array_equal(
    stored["h_0:2"]["attn"]["kernel"][1], params["h_1"]["attn"]["kernel"]
  )
  _equal_trees(stacked.unstack(stored), params)
  # A state whose dicts follow the params (optax's moments) or name them.
  state = optax.adam(1e-3).init(params)
  _equal_trees(stacked.stack(state, GROUPS), optax.adam(1e-3).init(stored))
  named = {"h_1/attn/kernel": 1, "h_0/attn/kernel": 0, "wte": 5}
  assert stacked.stack(named, GROUPS).keys() == {"h_0:2/attn/kernel", "wte"}


def test_stacking_refuses_a_partial_run_or_unequal_layers():
  params = _params()
  del params["h_1"]
  with pytest.raises(ValueError, match="holds 1 of its 2 layers"):
    stacked.stack(params, GROUPS)
  params = _params()
  params["h_1"]["extra"] = jnp.zeros(3)
  with pytest.raises(ValueError, match="layers' trees differ"):
    stacked.stack(params, GROUPS)
  with pytest.raises(ValueError, match="stop must be past"):
    stacked.layer_names("h_3:3/w")
  with pytest.raises(ValueError, match="stacks layers twice"):
    stacked.layer_names("h_0:2/g_0:2/w")


RULES = [(r".*/ln/.*", None), (r".*", "float8_e4m3fn")]


@pytest.mark.parametrize(
  "rounding, telemetry, fmt",
  [
    ("nearest", True, RULES),
    ("stochastic", True, RULES),
    ("stochastic", 2, RULES),  # counted every other update
    ("stochastic", True, "mxfp8_e4m3"),  # block scales per layer
  ],
)
def test_writeback_on_stacked_layers_gives_the_apart_bits(
  rounding, telemetry, fmt
):
  tx = optax.chain(
    optax.adam(1e-2),
    lowprec.writeback(
      fmt, rounding, key=jax.random.key(0), telemetry=telemetry
    ),
  )
  start = lowprec.to_grid(_params(), fmt)
  together = stacked.stack(start, GROUPS)
  _equal_trees(lowprec.to_grid(stacked.stack(_params(), GROUPS), fmt), together)
  grad = lambda w, step: 0.01 * jnp.cos(3.0 * w + step)  # noqa: E731
  for apart, s_apart, together, s_together in _steps(tx, start, 3, grad):
    _equal_trees(stacked.unstack(together), apart)
    report = lowprec.telemetry(s_apart)
    assert report["moved"] > 0 and "moved/h_1/attn/kernel" in report
    _same_report(lowprec.telemetry(s_together), report)


def _steps(tx, apart, steps, grad):
  """Steps `tx` on `apart` and on its layers stacked, from the same
  gradients (`grad(w, step)` of the apart params); yields `(params
  apart, state, params stacked, state)` after each step."""
  together = stacked.stack(apart, GROUPS)
  s_apart, s_together = tx.init(apart), tx.init(together)
  update = jax.jit(tx.update)
  for step in range(steps):
    grads = jax.tree.map(lambda w, s=step: grad(w, s), apart)
    u, s_apart = update(grads, s_apart, apart)
    apart = optax.apply_updates(apart, u)
    u, s_together = update(stacked.stack(grads, GROUPS), s_together, together)
    together = optax.apply_updates(together, u)
    yield apart, s_apart, together, s_together


def test_reference_trace_of_stacked_layers_reports_each_layer_as_apart():
  targets = [
    "float8_e4m3fn",
    lowprec.freeze.Target("float8_e5m2", "stochastic"),
    "mxfp8_e4m3",
  ]
  tx = optax.chain(
    optax.adam(1e-2),
    lowprec.freeze.reference_trace(targets, sample=40, key=jax.random.key(3)),
  )
  grad = lambda w, step: 0.01 * jnp.sin(5.0 * w + step)  # noqa: E731
  *_, (_, s_apart, _, s_together) = _steps(tx, _params(), 2, grad)
  report = lowprec.telemetry(s_apart)
  assert "pred/float8_e4m3fn/erased_fraction/h_2/attn/kernel" in report
  assert report["pred/float8_e4m3fn/erased"] > 0
  # Counts exact, the move probabilities' float32 sums and the sample's
  # values (the same coordinates, from every layer) bit for bit.
  _same_report(lowprec.telemetry(s_together), report)
  positions = s_apart[-1].sample_positions()
  assert {n.split("/")[0] for n, _ in positions} >= {"h_0", "h_1", "h_2"}
  assert s_together[-1].sample_positions() == positions


def test_reference_trace_at_init_refuses_stacked_layers():
  tx = lowprec.freeze.reference_trace("bfloat16", at_init=True)
  with pytest.raises(ValueError, match="store the layers apart"):
    tx.init(stacked.stack(_params(), GROUPS))


def test_layers_with_different_formats_are_refused_by_name():
  rules = [(r"h_0/.*", "bfloat16"), *RULES]
  params = stacked.stack(lowprec.to_grid(_params(), rules), GROUPS)
  tx = lowprec.writeback(rules)
  with pytest.raises(ValueError, match=r"'h_0:2/attn/kernel' stacks layers"):
    tx.init(params)


def test_a_transform_keeping_one_value_per_leaf_refuses_stacked_layers():
  params = stacked.stack(lowprec.to_grid(_params(), "bfloat16"), GROUPS)
  tx = lowprec.kahan_writeback("bfloat16")
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  with pytest.raises(ValueError, match="holds stacked layers.*apart"):
    tx.update(grads, state, params)


def test_stored_moments_refuse_stacked_layers():
  params = stacked.stack(_params(), GROUPS)
  tx = lowprec.store_state(
    optax.adam(1e-3), {"mu": "bfloat16:stochastic"}, key=jax.random.key(0)
  )
  with pytest.raises(ValueError, match="holds stacked layers.*apart"):
    tx.init(params)


def test_fixed_order_norm_of_stacked_layers_is_the_apart_norm():
  params = _params(seed=4)
  apart = jax.jit(optim.global_norm)(params)
  together = jax.jit(optim.global_norm)(stacked.stack(params, GROUPS))
  np.testing.assert_array_equal(together, apart)
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
  oracle = math.sqrt(sum(float(np.sum(x * x)) for x in leaves))
  np.testing.assert_allclose(float(together), oracle, rtol=1e-6)


# ---- through the entry point ------------------------------------------------


def _run(tmp, *args, wait=True):
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [
    sys.executable,
    "-m",
    "experiments.run",
    "--config=configs/smoke.py:arm=sr_bf16",
    "--config.model.n_layer=3",
    "--config.model.scan_layers=True",
    "--config.train.steps=16",
    "--config.ckpt.every_steps=4",
    # The write-back with a trace of its own sampled trajectory.
    "--config.lowprec.trace_targets=('bfloat16',)",
    "--config.lowprec.trace_sample=16",
    f"--config.log.results_dir={tmp}",
    *args,
  ]
  if not wait:
    return subprocess.Popen(
      cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
  out = subprocess.run(
    cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert out.returncode == 0, out.stdout + out.stderr
  return out


def _records(tmp):
  path = tmp / "smoke" / "sr_bf16" / "seed0" / "metrics.jsonl"
  drop = ("steps_per_s", "eta_s", "elapsed_s", "wall_s")
  recs = [json.loads(line) for line in path.read_text().splitlines()]
  return [{k: v for k, v in r.items() if k not in drop} for r in recs]


def _summary(tmp):
  path = tmp / "smoke" / "sr_bf16" / "seed0" / "summary.json"
  return json.loads(path.read_text())


@pytest.mark.slow
def test_entry_point_stacked_run_killed_and_resumed_gives_the_apart_bits(
  tmp_path,
):
  _run(tmp_path / "apart")
  stack = "--config.model.layer_storage=stacked"
  proc = _run(tmp_path / "stacked", stack, wait=False)
  run_dir = tmp_path / "stacked" / "smoke" / "sr_bf16" / "seed0"
  deadline = time.time() + 300
  while time.time() < deadline:  # until the checkpoint of step 4 is whole
    if (run_dir / "checkpoints" / "4").is_dir():
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (run_dir / "summary.json").exists(), "killed too late"
  rerun = _run(tmp_path / "stacked", stack)
  assert "resumed from step" in rerun.stdout
  a, b = _summary(tmp_path / "apart"), _summary(tmp_path / "stacked")
  assert b["resumed_from"] > 0
  assert a["param_digest"] == b["param_digest"]
  assert a["param_count"] == b["param_count"]
  ra, rb = _records(tmp_path / "apart"), _records(tmp_path / "stacked")
  assert len(ra) == len(rb) == 17
  assert any("moved/h_2/attn/qkv/kernel" in r for r in ra)
  assert any("pred/bfloat16/erased_fraction/h_1/mlp/fc/kernel" in r for r in ra)
  assert any(len(r.get("pred/sample/w", ())) == 16 for r in ra)
  for x, y in zip(ra, rb, strict=True):
    _same_report(x, y)
  # The checkpoints hold the layers apart, as an apart run's do.
  meta = "".join(
    p.read_text(errors="ignore")
    for p in (run_dir / "checkpoints").rglob("_METADATA")
  )
  assert "h_2" in meta and "h_0:3" not in meta


def test_entry_point_refuses_stacked_layers_for_at_init_naming_the_fix(
  tmp_path,
):
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.run",
      "--config=configs/smoke.py:arm=fp32_reference",
      "--config.model.layer_storage=stacked",
      "--config.lowprec.trace_at_init=True",
      f"--config.log.results_dir={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert out.returncode != 0
  assert "set model.layer_storage='apart'" in out.stderr + out.stdout
  assert "Traceback" not in out.stderr
  assert not (tmp_path / "smoke").exists()  # nothing written


def _step_fusions(n_layer: int, storage: str) -> int:
  from configs import smoke
  from experiments import costs, study, train

  c = smoke.get_config()
  c.model.update(dict(n_layer=n_layer, scan_layers=True))
  c.model.layer_storage = storage
  c.study.arms["sr_bf16"].lowprec.update(
    dict(trace_targets=("bfloat16",), trace_sample=16)
  )
  run = train.build_run(study.resolve(c, "sr_bf16", 0))
  batch = run.train_batch(0)
  hlo = run.step_fn.lower(run.state, batch).compile().as_text()
  return costs.fusions(hlo)[0]


@pytest.mark.slow
def test_the_stacked_step_holds_as_many_fusions_at_any_depth():
  # The write-back with its telemetry and trace, the norms, AdamW and the
  # microbatch sums: one program per kind of leaf, stacked; one per leaf
  # apart (which this test sees grow, so that it can fail).
  two, six = _step_fusions(2, "stacked"), _step_fusions(6, "stacked")
  # Only the fixed-order norms' halving trees over the layers' sums grow,
  # a fusion per halving: logarithmically (484 and 487 fusions here).
  assert two <= six <= two + 8, (two, six)
  assert _step_fusions(6, "apart") > six + 100
