"""The advisor: per-group predictions added up from hand-made telemetry
whose answers are known, the choice and its thresholds, budgets, and the
recommendation run as users run it: the pasted optax code equals the
runner's per-group chain bit for bit, and trains in plain JAX, Flax linen,
Flax NNX and Equinox loops with per-group telemetry.
"""

import os
import subprocess
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

import lowprec
from configs import common
from experiments import lowprec_config, optim, study
from lowprec import recipes
from lowprec.freeze import Thresholds, advise
from tests.state_storage_test import _bits, one_and_eight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two leaves in two groups; 100 and 300 parameters.
SIZES = {"wte": 100, "h/mlp/kernel": 300}
GROUPS = (("embeddings", "wte"), ("mlp", ".*"))
# 20 steps: their second half, the window, holds the advisor's minimum.
STEPS = range(1, 21)


def _record(
  step,
  near=0.5,
  move=0.3,
  lost_e5m2=0.0,
  nu=0.2,
  props=None,
  sizes=SIZES,
  q8_stalled=None,
):
  """One step's float32-run telemetry: bf16 nearest erased share `near`,
  stochastic move probability `move`, a Kahan e5m2 buffer losing
  `lost_e5m2` of the proposals, the bf16 store stalling `nu` of nu's
  updates (mu never), for every leaf. With `q8_stalled`, a block-scaled
  q8 store erasing no moment value but leaving that share of its stored
  codes unchanged."""
  r = {"step": step, "loss": 1.0}
  for leaf, n in sizes.items():
    p = n if props is None else props[leaf]
    r[f"pred/bfloat16/proposals/{leaf}"] = p
    r[f"pred/bfloat16/erased_fraction/{leaf}"] = near
    r[f"pred/bfloat16_sr/proposals/{leaf}"] = p
    r[f"pred/bfloat16_sr/move_prob/{leaf}"] = move
    k = "pred/bfloat16_kahan_float8_e5m2"
    r[f"{k}/proposals/{leaf}"] = p
    r[f"{k}/lost/{leaf}"] = round(lost_e5m2 * p)
    r[f"pred_state/bf16/changed/0/mu/{leaf}"] = n
    r[f"pred_state/bf16/erased/0/mu/{leaf}"] = 0.0
    r[f"pred_state/bf16/changed/0/nu/{leaf}"] = n
    r[f"pred_state/bf16/erased/0/nu/{leaf}"] = nu * n
    if q8_stalled is not None:
      for m in ("mu", "nu"):
        r[f"pred_state/q8/changed/0/{m}/{leaf}"] = n
        r[f"pred_state/q8/erased/0/{m}/{leaf}"] = 0.0
        r[f"pred_state/q8/stalled/0/{m}/{leaf}"] = q8_stalled * n
  return r


def _rows(advice, group):
  return {r.recipe: r for r in advice.rows if r.group == group}


def test_predictions_are_proposal_weighted_over_the_second_half():
  # Steps 1-10 (first half) would make every bf16 recipe unsafe; steps
  # 11-20 alternate erased 0.2 / 0.6 with 1 and 3 proposals per parameter.
  recs = [_record(t, near=1.0, move=0.0, lost_e5m2=1.0) for t in STEPS[:10]]
  props1 = {k: v for k, v in SIZES.items()}
  props3 = {k: 3 * v for k, v in SIZES.items()}
  for t in STEPS[10:]:
    if t % 2:
      recs.append(_record(t, near=0.2, move=0.5, props=props1))
    else:
      recs.append(_record(t, near=0.6, move=0.1, props=props3))
  a = advise(recs, SIZES, groups=GROUPS)
  assert a.steps == (11, 20) and a.window_steps == 10
  row = _rows(a, "mlp")["bf16_rn"]
  assert row.erased == pytest.approx((0.2 * 1 + 0.6 * 3) / 4)
  assert row.lost == row.erased  # nearest loses what it erases
  assert _rows(a, "mlp")["bf16_sr"].move == pytest.approx((0.5 + 0.3) / 4)
  assert _rows(a, "mlp")["bf16_sr"].lost == 0.0
  assert a.sizes == {"embeddings": 100, "mlp": 300}


def test_choice_is_the_cheapest_safe_recipe_and_store():
  # bf16 moves with probability 0.3 >= 0.1: stochastic write-back (2 B)
  # is safe; fp8 has no trace, ECO and split no prediction: never chosen.
  a = advise([_record(t) for t in STEPS], SIZES, groups=GROUPS)
  assert a.choice == {"embeddings": "bf16_sr+bf16", "mlp": "bf16_sr+bf16"}
  rows = _rows(a, "mlp")
  assert not rows["fp8_sr"].safe
  assert "no stochastic trace of float8_e4m3fn" in rows["fp8_sr"].why
  assert rows["bf16_eco"].lost is None and not rows["bf16_eco"].safe
  assert rows["bf16_rn"].why == "lost 0.500 > 0.01"
  # No q8 trace: the bf16 store (nu stalled 0.2 of updates) is chosen.
  states = {r.state: r for r in a.state_rows if r.group == "mlp"}
  assert states["bf16"].nu == pytest.approx(0.2) and states["bf16"].mu == 0
  assert "no state trace named 'q8'" in states["q8"].why
  assert "bf16_eco" in a.notes[0] and "bf16_split8" in a.notes[0]
  want = recipes.bytes_per_param("bf16_sr+bf16")
  assert a.bytes_per_param == pytest.approx(want) == 6.0


def test_thresholds_move_the_choice():
  recs = [_record(t, move=0.05, lost_e5m2=0.005, nu=0.95) for t in STEPS]
  a = advise(recs, SIZES, groups=GROUPS)
  # SR moves too rarely (0.05 < 0.1); Kahan's e5m2 buffer loses 0.5%.
  assert a.choice["mlp"] == "bf16_kahan_e5m2+float32"
  assert _rows(a, "mlp")["bf16_sr"].why == "move 0.050 < 0.1"
  loose = advise(recs, SIZES, groups=GROUPS, thresholds=Thresholds(move=0.01))
  assert loose.choice["mlp"] == "bf16_sr+bf16"
  # At 4 bytes float32 itself is as cheap as any compensation: chosen.
  strict = advise(recs, SIZES, groups=GROUPS, thresholds=Thresholds(lost=1e-3))
  assert strict.choice["mlp"] == "float32+float32"


def test_a_grid_that_resolves_no_step_takes_no_deterministic_compensation():
  # Every late proposal below half a gap (erased 1.0): the Kahan buffers
  # lose nothing, but the weight lags by up to half a gap; stochastic
  # rounding that moves too rarely is refused too: float32 is left.
  recs = [_record(t, near=1.0, move=0.05, lost_e5m2=0.0) for t in STEPS]
  a = advise(recs, SIZES, groups=GROUPS)
  rows = _rows(a, "mlp")
  assert rows["bf16_kahan_e5m2"].lost == 0.0
  assert rows["bf16_kahan_e5m2"].why == (
    "erased 1.000 > 0.99: the grid resolves no step"
  )
  assert a.choice["mlp"] == "float32+bf16"
  loose = advise(recs, SIZES, groups=GROUPS, thresholds=Thresholds(erased=1))
  assert loose.choice["mlp"] == "bf16_kahan_e5m2+bf16"


def test_a_budget_trades_the_least_predicted_risk_per_byte():
  recs = [_record(t, move=0.05, lost_e5m2=0.005, nu=0.95) for t in STEPS]
  free = advise(recs, SIZES, groups=GROUPS)
  assert free.bytes_per_param == pytest.approx(11.0)  # 3 + 8
  a = advise(recs, SIZES, groups=GROUPS, budget=10.0)
  assert a.bytes_per_param <= 10.0
  assert "takes predicted risks" in a.notes[-1]
  with pytest.raises(ValueError, match="no predicted recipe fits 1.0"):
    advise(recs, SIZES, groups=GROUPS, budget=1.0)


def test_bad_input_is_refused_with_the_fix():
  with pytest.raises(ValueError, match="telemetry records"):
    advise([], SIZES)
  with pytest.raises(ValueError, match="window"):
    advise([_record(1)], SIZES, window=0)
  with pytest.raises(ValueError, match="in no group"):
    advise([_record(t) for t in STEPS], SIZES, groups=(("embeddings", "wte"),))


# ------------------------------------------- what the advisor reads


def _telemetry(**kw):
  return [_record(t, **kw) for t in STEPS]


NEAR = "pred/bfloat16/erased_fraction/wte"
PROPS = "pred/bfloat16/proposals/wte"


@pytest.mark.parametrize("nan", [float("nan"), "nan"], ids=["float", "str"])
def test_a_nan_share_with_proposals_is_refused_not_read_as_zero_risk(nan):
  # Every erased share NaN while the tensors had proposals: read as 0, it
  # made nearest write-back look lossless and recommended it.
  recs = _telemetry(near=0.5)
  for r in recs:
    for leaf in SIZES:
      r[f"pred/bfloat16/erased_fraction/{leaf}"] = nan
  with pytest.raises(ValueError) as e:
    advise(recs, SIZES, groups=GROUPS)
  msg = str(e.value)
  assert msg.startswith("record 0 (step 1): pred/bfloat16/erased_fraction/")
  assert "with 100 proposals" in msg or "with 300 proposals" in msg
  assert "a share is NaN only where its tensor had no proposals" in msg


@pytest.mark.parametrize("nan", [float("nan"), "nan"], ids=["float", "str"])
def test_a_step_without_proposals_is_left_out_of_that_tensor_and_said(nan):
  # wte had no proposals at steps 14 and 17 (a masked or frozen tensor),
  # where its shares are NaN: they weigh nothing, and a note says so. The
  # other steps of the window have erased 0.2 at 100 proposals each.
  recs = _telemetry(near=0.2, move=0.3)
  for t in (14, 17):
    r = recs[t - 1]
    for trace in ("bfloat16", "bfloat16_sr"):
      r[f"pred/{trace}/proposals/wte"] = 0
    r[NEAR] = nan
    r["pred/bfloat16_sr/move_prob/wte"] = nan
  a = advise(recs, SIZES, groups=GROUPS)
  row = _rows(a, "embeddings")["bf16_rn"]
  assert row.erased == pytest.approx(0.2) and row.lost == row.erased
  assert _rows(a, "embeddings")["bf16_sr"].move == pytest.approx(0.3)
  assert (
    "steps without proposals, left out of those tensors' shares (NaN, not "
    "zero risk): wte at 2 of the window's 10 steps" in a.notes
  )
  assert "wte at 2" in a.table()
  # Without proposals in the whole window: no prediction, never chosen.
  for r in recs[10:]:
    for k in r:
      if k.startswith("pred/") and k.endswith("/proposals/wte"):
        r[k] = 0
    r[NEAR] = r["pred/bfloat16_sr/move_prob/wte"] = nan
    r["pred/bfloat16_kahan_float8_e5m2/lost/wte"] = 0
  a = advise(recs, SIZES, groups=GROUPS)
  rows = _rows(a, "embeddings")
  assert rows["bf16_rn"].erased is None and not rows["bf16_rn"].safe
  assert rows["bf16_sr"].why == "no proposals in the window"
  assert rows["bf16_kahan_e5m2"].why == "no proposals in the window"
  assert a.choice["embeddings"].startswith("float32+")


def _refused(recs, match, **kw):
  with pytest.raises(ValueError, match=match):
    advise(recs, SIZES, groups=GROUPS, **kw)


@pytest.mark.parametrize(
  "value, ok",
  [
    ("nan", False),  # with proposals: refused (above)
    ("inf", False),
    ("-inf", False),
    ("NaN", False),  # not the runner's spelling
    ("0.5", False),
    (True, False),
    (None, False),
    ([0.5], False),
    (0, True),
    (1, True),
    (0.5, True),
    (np.float32(0.5), True),
    (jnp.float32(0.5), True),
    (-1e-9, False),
    (1 + 1e-9, False),
  ],
)
def test_a_share_is_a_number_in_0_1(value, ok):
  recs = _telemetry()
  recs[12][NEAR] = value
  if ok:
    advise(recs, SIZES, groups=GROUPS)
  else:
    _refused(recs, rf"^record 12 \(step 13\): {NEAR} = ")


@pytest.mark.parametrize(
  "key, value, ok",
  [
    (PROPS, 0, True),
    (PROPS, -1, False),
    (PROPS, "inf", False),
    (PROPS, "nan", False),
    ("pred/bfloat16_kahan_float8_e5m2/lost/wte", -1, False),
    ("pred/bfloat16_kahan_float8_e5m2/lost/wte", 0, True),
    ("pred_state/bf16/changed/0/mu/wte", -1, False),
    ("pred_state/bf16/erased/0/nu/wte", "-inf", False),
    ("pred_state/bf16/erased/0/nu/wte", 0, True),
  ],
)
def test_a_count_is_finite_and_not_negative(key, value, ok):
  recs = _telemetry()
  recs[12][key] = value
  if key == PROPS and value == 0:
    recs[12][NEAR] = "nan"
  if ok:
    advise(recs, SIZES, groups=GROUPS)
  else:
    _refused(recs, rf"^record 12 \(step 13\): {key} = ")


def test_every_record_carries_the_same_prediction_keys():
  recs = _telemetry()
  del recs[5]["pred/bfloat16_sr/move_prob/wte"]
  _refused(
    recs,
    r"^record 5 \(step 6\) lacks 1 prediction key\(s\) the other records "
    r"carry \('pred/bfloat16_sr/move_prob/wte'\)",
  )
  recs = _telemetry()
  recs[19]["pred/bfloat16/erased_fraction/wtee"] = 0.0
  _refused(recs, r"^record 19 \(step 20\) carries 1 prediction key")
  recs = _telemetry() + [{"step": 21, "loss": 1.0}]  # an extra, foreign record
  _refused(recs, r"^record 20 \(step 21\) lacks 20 prediction key")


@pytest.mark.parametrize(
  "steps, match",
  [
    ((1, 2, 2), r"record 2 \(step 2\): step 2 after step 2"),
    ((1, 3, 2), r"record 2 \(step 2\): step 2 after step 3"),
    ((1, True, 3), r"record 1 \(step True\): step True is not an integer"),
    ((1, 2.0, 3), r"step 2.0 is not an integer"),
    ((1, None, 3), r"record 1 has no 'step'"),
  ],
)
def test_steps_are_integers_in_order(steps, match):
  recs = _telemetry()[:3]
  for r, s in zip(recs, steps, strict=True):
    r["step"] = s
  if steps[1] is None:
    del recs[1]["step"]
  _refused(recs, match)


def test_errors_name_where_each_record_came_from():
  recs = _telemetry()
  recs[3][NEAR] = "bad"
  lines = [f"results/x/metrics.jsonl:{t + 1}" for t in STEPS]
  _refused(recs, rf"^results/x/metrics.jsonl:5: {NEAR} = 'bad'", sources=lines)


@pytest.mark.parametrize(
  "n, window, ok",
  [(10, 1.0, True), (9, 1.0, False), (20, 0.5, True), (18, 0.5, False)],
)
def test_the_window_holds_at_least_ten_steps(n, window, ok):
  recs = [_record(t) for t in range(1, n + 1)]
  if ok:
    a = advise(recs, SIZES, groups=GROUPS, window=window)
    assert a.window_steps == 10
    assert "(10 steps; the advice needs at least 10)" in a.table()
    assert not any("fewer than the 10" in n for n in a.notes)
    return
  with pytest.raises(ValueError) as e:
    advise(recs, SIZES, groups=GROUPS, window=window)
  assert f"holds {n // round(1 / window)} step(s); the advice needs at " in (
    str(e.value)
  )
  need = 10 if window == 1 else 19  # round(19 / 2) = 10 (to even)
  assert str(e.value).endswith(
    f"Train the float32 run longer (at least {need} steps)"
  )
  # Asked for, a shorter window is advised with a note saying so.
  a = advise(recs, SIZES, groups=GROUPS, window=window, min_steps=1)
  assert a.notes[-1] == (
    f"the window holds {a.window_steps} steps, fewer than the 10 the advice "
    "needs: a longer float32 run decides"
  )


@pytest.mark.parametrize(
  "move, safe", [(0.25, True), (np.nextafter(0.25, 0), False), (0.5, True)]
)
def test_stochastic_rounding_is_safe_from_the_move_threshold_on(move, safe):
  # The boundary itself is safe: move >= threshold (0.25: exact in binary,
  # so the proposal-weighted mean is exactly the threshold).
  th = Thresholds(move=0.25)
  a = advise(_telemetry(move=move), SIZES, groups=GROUPS, thresholds=th)
  row = _rows(a, "mlp")["bf16_sr"]
  assert row.move == move
  assert row.safe is safe
  assert row.why == ("" if safe else f"move {move:.3f} < 0.25")


def test_parameters_and_traced_tensors_must_match():
  recs = _telemetry()
  with pytest.raises(ValueError) as e:
    advise(recs, {**SIZES, "h/attn/kernel": 10}, groups=GROUPS)
  assert str(e.value).startswith(
    "1 parameter(s) match no traced tensor ('h/attn/kernel'). The traced "
    "tensors: 'h/mlp/kernel', 'wte'. Pass the parameters"
  )
  with pytest.raises(ValueError) as e:
    advise(recs, {"wte": 100}, groups=(("all", ".*"),))
  assert str(e.value).startswith(
    "1 traced tensor(s) match no parameter ('h/mlp/kernel'). The traced "
    "tensors: 'h/mlp/kernel', 'wte'."
  )
  renamed = {f"params/{k}": v for k, v in SIZES.items()}
  with pytest.raises(ValueError) as e:
    advise(recs, renamed, groups=(("all", ".*"),))
  assert str(e.value).startswith(
    "2 parameter(s) match no traced tensor ('params/wte', "
    "'params/h/mlp/kernel'); 2 traced tensor(s) match no parameter "
    "('h/mlp/kernel', 'wte')."
  )


@pytest.mark.parametrize(
  "groups, empty",
  [
    ((("embeddings", "wte"), ("norms", ".*norm.*"), ("rest", ".*")), "norms"),
    ((("all", ".*"), ("mlp", ".*mlp.*")), "mlp"),  # taken by the one before
  ],
  ids=["matches-none", "shadowed"],
)
def test_a_group_that_takes_no_parameter_is_refused(groups, empty):
  with pytest.raises(ValueError) as e:
    advise(_telemetry(), SIZES, groups=groups)
  regex = dict(groups)[empty]
  assert str(e.value).startswith(
    f"group(s) that take no parameter: {empty} ({regex!r})"
  )
  assert "The parameters: 'wte', 'h/mlp/kernel'." in str(e.value)


@pytest.mark.parametrize(
  "text, ok",
  [
    ("optax.adamw(", False),
    ("optax.adamw(1e-3); import os", False),
    ("", False),
    ("optax.adamw(1e-3)", True),
    ("optax.chain(optax.clip(1.0), optax.sgd(0.1))", True),
  ],
)
def test_optax_code_compiles_the_optimizer_expression(text, ok):
  a = advise(_telemetry(), SIZES, groups=GROUPS)
  if not ok:
    with pytest.raises(ValueError, match="is not a Python expression"):
      a.optax_code(text)
    return
  compile(a.optax_code(text), "<optax_advice>", "exec")
  assert text in a.optax_code(text)


# ----------------------------------------------------- groups, recipes


def test_default_groups_name_the_parts_of_common_decoders():
  want = {
    # this project's linen GPT
    "params/wte/embedding": "embeddings",
    "wpe": "embeddings",
    "h_0/attn/qkv/kernel": "attention",
    "h_0/attn/qkv/norm_scale": "norms",
    "h_0/attn/qkv/norm_bias": "biases",
    "h_1/mlp/fc/kernel": "mlp",
    "ln_f/norm_scale": "norms",
    # NNX / Equinox / plain-JAX spellings
    "blocks/0/attention/wq/kernel": "attention",
    "blocks/0/ln1/weight": "norms",
    "blocks/0/feed_forward/w1/weight": "mlp",
    "layers/3/mlp/c_proj/bias": "biases",
    "tok_embeddings/embedding": "embeddings",
    "lm_head/kernel": "other",
  }
  got = {n: lowprec.groups.group_of(n) for n in want}
  assert got == want
  tree = {"wte": jnp.zeros((4, 2)), "h": {"mlp": {"kernel": jnp.zeros(3)}}}
  assert lowprec.groups.labels()(tree) == {
    "h": {"mlp": {"kernel": "mlp"}},
    "wte": "embeddings",
  }
  assert lowprec.groups.sizes(tree) == {"embeddings": 8, "mlp": 3}
  with pytest.raises(ValueError, match="identifier"):
    lowprec.groups.as_groups(("a b=.*",))


def test_recipe_bytes_are_the_stored_bytes(monkeypatch):
  # lowprec.bytes_per_param counts the arrays a chain really holds: with
  # bf16-typed weights, bf16 / uint16 buffers and native stored moments,
  # each recipe's count is what its arrays take.
  params = {"w": jnp.zeros((64, 256), jnp.bfloat16)}
  for name in ("bf16_kahan+bf16", "bf16_split8+q8", "bf16_remainder+float32"):
    tx = recipes.chain(optax.adamw(1e-3), name, jax.random.key(0))
    got = lowprec.bytes_per_param(params, jax.eval_shape(tx.init, params))
    assert got.total == pytest.approx(recipes.bytes_per_param(name)), name


# --------------------------------------------- the recommendation, run


def _advice():
  sizes = {"wte": 96, "h/attn/kernel": 48, "h/mlp/kernel": 48, "h/bias": 6}
  recs = [_record(t, 0.5, 0.05, 0.005, 0.2, sizes=sizes) for t in STEPS]
  groups = (
    ("embeddings", "wte"),
    ("attention", ".*attn.*"),
    ("mlp", ".*mlp.*"),
    ("biases", ".*bias"),
  )
  a = advise(recs, sizes, groups=groups)
  # Hand-set, to run every kind of chain: SR with stored moments, Kahan,
  # ECO under a stored state, split, float32.
  a.choice.update(
    embeddings="bf16_sr+q8",
    attention="bf16_kahan+float32",
    mlp="bf16_eco+bf16",
    biases="float32+float32",
  )
  return a


def _params():
  k = jax.random.split(jax.random.key(3), 4)
  return {
    "wte": jax.random.normal(k[0], (16, 6)) * 0.3,
    "h": {
      "attn": {"kernel": jax.random.normal(k[1], (6, 8)) * 0.3},
      "mlp": {"kernel": jax.random.normal(k[2], (8, 6)) * 0.3},
      "bias": jnp.zeros(6),
    },
  }


def _loss(p, x, y):
  h = jnp.tanh(p["wte"][x] @ p["h"]["attn"]["kernel"])
  out = h @ p["h"]["mlp"]["kernel"] + p["h"]["bias"]
  return jnp.mean((out - y) ** 2)


X = jnp.arange(32) % 16
Y = jnp.sin(jnp.arange(32 * 6, dtype=jnp.float32).reshape(32, 6) / 7)


def _exec(code: str, **names):
  scope = dict(names)
  exec(compile(code, "<optax_advice>", "exec"), scope)  # noqa: S102
  return scope["tx"]


def _run(tx, params, steps):
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    value, grads = jax.value_and_grad(_loss)(params, X, Y)
    updates, state = tx.update(grads, state, params)
    return lowprec.apply_updates(params, updates), state, value

  losses = []
  for _ in range(steps):
    params, state, value = step(params, state)
    losses.append(float(value))
  return params, state, losses


def _grid(advice):
  return [
    (regex, recipes.get(advice.choice[g])[0].fmt)
    for g, regex in advice.groups
    if g in advice.sizes
  ]


def test_pasted_code_equals_the_runners_chain_bit_for_bit():
  a = _advice()
  c = common.get_config()
  c.opt.update(dict(clip_norm=0.0, schedule="constant", warmup_steps=0))
  c.lowprec.update(a.config())
  lowprec_config.group_recipes(c.lowprec)  # the fragment validates
  key = jax.random.key(11)
  runner = optim.build(c, key)
  wb_key = jax.random.split(key)[0]
  code = a.optax_code("optimizer", key="wb_key")
  lr = optim.schedule(c.opt, c.train.steps)
  pasted = _exec(code, optimizer=optim._adamw(c.opt, lr), wb_key=wb_key)
  params = lowprec.to_grid(
    _params(), lowprec_config.writeback_target(c.lowprec)
  )
  got, gs, losses = _run(pasted, params, 8)
  want, ws, _ = _run(runner, params, 8)
  ws = ws[0]  # the runner's chain holds the multi_transform alone
  for x, y in zip(
    jax.tree.leaves((got, gs)), jax.tree.leaves((want, ws)), strict=True
  ):
    np.testing.assert_array_equal(_bits(x), _bits(y))
  assert losses[-1] < losses[0]
  tel = lowprec.telemetry(gs)
  for g in ("embeddings", "attention", "mlp"):
    assert tel[f"{g}/proposals"] > 0, g  # telemetry per named group
  assert "biases/proposals" not in tel  # float32: no write-back


def test_group_recipes_refuse_bad_entries_in_the_config():
  c = common.get_config()
  c.lowprec.group_recipes = ("mlp=bf16_sr",)
  with pytest.raises(ValueError, match=r"no recipe for group\(s\)"):
    lowprec_config.group_recipes(c.lowprec)
  c.lowprec.group_recipes = ("mlpp=bf16_sr",)
  with pytest.raises(ValueError, match="not 'group=recipe'"):
    lowprec_config.group_recipes(c.lowprec)
  c.lowprec.groups = ("all=.*",)
  c.lowprec.group_recipes = ("all=bf16_kahn",)
  with pytest.raises(ValueError, match="unknown weight recipe 'bf16_kahn'"):
    lowprec_config.group_recipes(c.lowprec)
  c.lowprec.group_recipes = ("all=bf16_kahan",)
  c.lowprec.writeback = "bfloat16"
  with pytest.raises(ValueError, match="leave lowprec.writeback unset"):
    study.validate(c)


def _tx(advice):
  return _exec(advice.optax_code("optax.adamw(3e-2)"))


class _Linen(nn.Module):
  @nn.compact
  def __call__(self, x):
    e = nn.Embed(16, 6, name="wte")(x)
    h = jnp.tanh(nn.Dense(8, use_bias=False, name="attn")(e))
    return nn.Dense(6, name="mlp")(h)


LINEN_GROUPS = (
  ("embeddings", ".*wte.*"),
  ("attention", ".*attn.*"),
  ("biases", ".*bias"),
  ("mlp", ".*mlp.*"),
)


def _client_advice(groups):
  a = _advice()
  a.groups = groups
  a.sizes = {g: 1 for g, _ in groups}
  a.choice = {
    "embeddings": "bf16_sr+q8",
    "attention": "bf16_kahan+float32",
    "mlp": "bf16_eco+bf16",
    "biases": "float32+float32",
  }
  return a


def _check(tel, losses):
  assert losses[-1] < 0.8 * losses[0], losses
  for g in ("embeddings", "attention", "mlp"):
    assert tel[f"{g}/proposals"] > 0, g


def test_linen_loop_with_the_advised_chain():
  a = _client_advice(LINEN_GROUPS)
  model, tx = _Linen(), _tx(a)
  params = lowprec.to_grid(model.init(jax.random.key(0), X), _grid(a))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss = lambda p: jnp.mean((model.apply(p, X) - Y) ** 2)  # noqa: E731
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  losses = []
  for _ in range(30):
    params, state, value = step(params, state)
    losses.append(float(value))
  _check(lowprec.telemetry(state), losses)
  lowprec.check_on_grid(params, _grid(a))


class _Nnx(nnx.Module):
  def __init__(self, rngs):
    self.wte = nnx.Embed(16, 6, rngs=rngs)
    self.attn = nnx.Linear(6, 8, use_bias=False, rngs=rngs)
    self.mlp = nnx.Linear(8, 6, rngs=rngs)

  def __call__(self, x):
    return self.mlp(jnp.tanh(self.attn(self.wte(x))))


def test_nnx_optimizer_with_the_advised_chain():
  a = _client_advice(LINEN_GROUPS)
  model = _Nnx(nnx.Rngs(0))
  nnx.update(model, lowprec.to_grid(nnx.state(model, nnx.Param), _grid(a)))
  opt = nnx.Optimizer(model, _tx(a), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss = lambda m: jnp.mean((m(X) - Y) ** 2)  # noqa: E731
    value, grads = nnx.value_and_grad(loss)(model)
    opt.update(model, grads)
    return value

  losses = [float(step(model, opt)) for _ in range(30)]
  _check(lowprec.telemetry(opt.opt_state), losses)
  lowprec.check_on_grid(nnx.state(model, nnx.Param), _grid(a))


class _Eqx(eqx.Module):
  wte: jax.Array
  attn: eqx.nn.Linear
  mlp: eqx.nn.Linear

  def __init__(self, key):
    k = jax.random.split(key, 3)
    self.wte = jax.random.normal(k[0], (16, 6)) * 0.3
    self.attn = eqx.nn.Linear(6, 8, use_bias=False, key=k[1])
    self.mlp = eqx.nn.Linear(8, 6, key=k[2])

  def __call__(self, x):
    return self.mlp(jnp.tanh(self.attn(self.wte[x])))


def test_equinox_loop_with_the_advised_chain():
  a = _client_advice(LINEN_GROUPS)
  model = lowprec.to_grid(_Eqx(jax.random.key(0)), _grid(a))
  tx = _tx(a)
  state = tx.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def step(model, state):
    loss = lambda m: jnp.mean((jax.vmap(m)(X) - Y) ** 2)  # noqa: E731
    value, grads = eqx.filter_value_and_grad(loss)(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = tx.update(grads, state, params)
    return eqx.apply_updates(model, updates), state, value

  losses = []
  for _ in range(30):
    model, state, value = step(model, state)
    losses.append(float(value))
  _check(lowprec.telemetry(state), losses)
  lowprec.check_on_grid(eqx.filter(model, eqx.is_inexact_array), _grid(a))


def test_plain_jax_float32_run_to_advice_to_training():
  # The whole path in plain JAX: a float32 AdamW run carrying every trace,
  # its telemetry advised, the advice pasted and trained.
  params = _params()
  inner = lowprec.freeze.state_trace(
    optax.adamw(3e-2),
    {s.name: dict(s.rules) for s in recipes.STATES.values() if s.rules},
  )
  tx = optax.chain(
    inner,
    lowprec.freeze.reference_trace(
      [
        lowprec.freeze.Target("bfloat16"),
        lowprec.freeze.Target("bfloat16", "stochastic"),
        lowprec.freeze.Target("float8_e4m3fn", "stochastic"),
      ]
    ),
    lowprec.freeze.compensated_trace(
      [("bfloat16", "kahan", "bfloat16"), ("bfloat16", "kahan", "float8_e5m2")]
    ),
  )
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.grad(_loss)(params, X, Y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  records = []
  for t in range(20):
    params, state = step(params, state)
    records.append({"step": t + 1, **lowprec.telemetry(state)})
  a = advise(records, params)
  assert set(a.sizes) == {"embeddings", "attention", "mlp", "biases"}
  assert all(c.partition("+")[0] in recipes.WEIGHTS for c in a.choice.values())
  for r in a.rows:  # every traced recipe got a prediction in [0, 1]
    if r.recipe in ("bf16_rn", "bf16_sr", "bf16_kahan", "bf16_kahan_e5m2"):
      assert r.erased is not None and 0 <= r.erased <= 1, r
      assert r.lost is not None and 0 <= r.lost <= 1, r
    if r.recipe == "fp8_sr":  # a stochastic trace alone: move, no erased
      assert r.erased is None and 0 <= r.move <= 1, r
  states = [r for r in a.state_rows if r.state == "q8"]
  assert all(r.nu is not None and 0 <= r.nu <= 1 for r in states)
  start = lowprec.to_grid(_params(), _grid(a))
  _, state, losses = _run(_exec(a.optax_code("optax.adamw(3e-2)")), start, 20)
  assert losses[-1] < losses[0]


def test_fragment_is_python_a_config_takes():
  a = _advice()
  scope = {}
  exec(a.fragment(), scope)  # noqa: S102
  c = common.get_config()
  c.lowprec.update(scope["LOWPREC"])
  assert [g for g, _, _ in lowprec_config.group_recipes(c.lowprec)] == list(
    a.sizes
  )
  assert scope["__doc__"].startswith("The recipe lowprec.freeze.advise")
  assert isinstance(c.lowprec, ml_collections.ConfigDict)


# ------------------------------------------------- scripts.advise, study


def _advise_cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "scripts.advise", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_advise_without_the_float32_run_names_the_command(tmp_path):
  out = _advise_cli(
    "--config", "configs/frontier.py:scale=smoke", "--results", str(tmp_path)
  )
  assert out.returncode == 2, out.stderr
  assert "run the float32 arm first" in out.stderr
  assert "--config configs/frontier.py:scale=smoke,arm=fp32,seed=0" in (
    out.stderr
  )
  assert "Traceback" not in out.stderr


def test_per_group_chain_on_eight_devices_is_the_one_device_bits():
  # An advised chain (8-bit stored moments and SR, Kahan, ECO under a
  # stored state), its leaves split over 8 devices: params, buffers,
  # stored codes and counts are the single device's, bit for bit.
  ks = jax.random.split(jax.random.key(4), 3)
  params = {
    "w": jax.random.normal(ks[0], (16, 256)),
    "v": jax.random.normal(ks[1], (8, 128)),
    "b": jax.random.normal(ks[2], (256,)),
  }
  groups = (("w", "w"), ("v", "v"), ("b", "b"))
  choice = {"w": "bf16_sr+q8", "v": "bf16_kahan+float32", "b": "bf16_eco+bf16"}
  tx = optax.multi_transform(
    {
      g: recipes.chain(optax.adamw(1e-2), c, jax.random.fold_in(KEY8, i))
      for i, (g, c) in enumerate(choice.items())
    },
    lowprec.groups.labels(groups),
  )
  params = lowprec.to_grid(params, "bfloat16")
  one, eight = one_and_eight(tx, params)
  a, b = jax.tree.leaves(one), jax.tree.leaves(eight)
  assert len(a) == len(b) > 20
  moved = 0
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(_bits(x), _bits(y))
  for k in params:
    moved += int(np.sum(np.asarray(one[0][k]) != np.asarray(params[k])))
  assert moved > 0  # the steps moved the weights


KEY8 = jax.random.key(8)


@pytest.mark.parametrize("q8_stalled, safe", [(0.95, False), (0.5, True)])
def test_a_scaled_store_is_judged_on_its_stalled_codes(q8_stalled, safe):
  # Seed-free: 20 synthetic records; the q8 store erases no moment value
  # (erased 0) but leaves `q8_stalled` of its stored codes unchanged.
  recs = [_record(t, q8_stalled=q8_stalled) for t in STEPS]
  states = {r.state: r for r in advise(recs, SIZES, groups=GROUPS).state_rows}
  assert states["q8"].nu == pytest.approx(q8_stalled)
  assert states["q8"].safe is safe
  if not safe:
    assert states["q8"].why == f"stalled {q8_stalled:.3f} > 0.9"


def test_measured_costs_choose_the_fewest_bytes_under_the_margin():
  # Hand-made measurements whose answer is known: bf16 nearest costs
  # 0.002 nats on the embeddings and 0.2 on the mlp (lost_cost), bf16
  # stochastic 0.004 +- 0.001 and 0.001 +- 0.0005 (forward_cost); fp8
  # and the compensations are measured by neither, so never chosen.
  Cost = lowprec.freeze.Cost
  recs = [_record(t, q8_stalled=0.5) for t in STEPS]
  lost = {
    "embeddings": {"bfloat16": Cost(0.002, 0.0, 1)},
    "mlp": {"bfloat16": Cost(0.2, 0.0, 1)},
  }
  costs = {
    "embeddings": {"bfloat16_sr": Cost(0.004, 0.001, 4)},
    "mlp": {"bfloat16_sr": Cost(0.001, 0.0005, 4)},
  }
  a = advise(recs, SIZES, groups=GROUPS, costs=costs, lost=lost)
  rows = _rows(a, "mlp")
  assert rows["bf16_rn"].nats == 0.2 and rows["bf16_sr"].nats_se == 0.0005
  assert rows["float32"].nats == 0.0 and rows["bf16_kahan_e5m2"].nats is None
  assert rows["fp8_sr"].nats is None
  # Upper ends (nats + 2 se): embeddings rn 0.002 / sr 0.006, mlp sr
  # 0.002; together 0.004 <= 0.01, at 2 bytes each.
  weights = {g: c.partition("+")[0] for g, c in a.choice.items()}
  assert weights == {"embeddings": "bf16_rn", "mlp": "bf16_sr"}
  assert a.choice["mlp"].partition("+")[2] == "q8"  # stores: the shares
  mean, se = a.predicted_nats
  assert mean == pytest.approx(0.003) and se == pytest.approx(0.0005)
  assert "nats (+- se)" in a.table() and "margin of 0.01 nats" in a.table()
  # Under 0.003 one group stays float32: the mlp's 300 parameters on
  # bf16 save more bytes than the embeddings' 100.
  a = advise(recs, SIZES, groups=GROUPS, costs=costs, lost=lost, margin=0.003)
  weights = {g: c.partition("+")[0] for g, c in a.choice.items()}
  assert weights == {"embeddings": "float32", "mlp": "bf16_sr"}
  # Nothing fits a margin of 0 but float32 (or the remainder, as many
  # bytes: float32 goes first).
  a = advise(recs, SIZES, groups=GROUPS, costs=costs, lost=lost, margin=0.0)
  assert all(
    c.partition("+")[0] in ("float32", "bf16_remainder")
    for c in a.choice.values()
  )
  with pytest.raises(ValueError, match="margin must be"):
    advise(recs, SIZES, groups=GROUPS, costs=costs, margin=-1)
  # Without lost costs, nearest write-back has no nats and is not chosen.
  a = advise(recs, SIZES, groups=GROUPS, costs=costs)
  assert _rows(a, "embeddings")["bf16_rn"].nats is None
  assert any("no lost costs" in n for n in a.notes)
  # A budget the margin's choice (float32 embeddings, 4.53 B/param)
  # does not fit: 4.1 B/param takes 2-byte weights in both groups, those
  # of least predicted cost: nearest on the embeddings (0.002), SR on
  # the mlp (0.002), 0.004 together, over the margin of 0.003 (noted).
  a = advise(
    recs, SIZES, groups=GROUPS, costs=costs, lost=lost, margin=0.003,
    budget=4.1,
  )  # fmt: skip
  weights = {g: c.partition("+")[0] for g, c in a.choice.items()}
  assert weights == {"embeddings": "bf16_rn", "mlp": "bf16_sr"}
  assert a.bytes_per_param <= 4.1
  assert "least predicted cost that fit, 0.0040 nats" in a.notes[-1]
  # No measured weights fit 1 B/param: the shares' fit refuses it.
  with pytest.raises(ValueError, match="no predicted recipe fits 1.0"):
    advise(recs, SIZES, groups=GROUPS, costs=costs, lost=lost, budget=1.0)


def test_the_study_table_checks_predictions_made_before_the_runs(
  tmp_path, monkeypatch
):
  # Predictions against measured paired intervals: inside or outside,
  # the Spearman correlation of the means (3 arms, known ranks), and the
  # advised arm's non-inferiority at 0.01 nats.
  import json

  from experiments.analysis import frontier

  path = tmp_path / "study_predictions.json"
  preds = {
    "a": {"nats": 0.2, "se": 0.0, "how": "lost_cost"},
    "b": {"nats": 0.001, "se": 0.0005, "how": "forward_cost"},
    "advised": {"nats": 0.002, "se": 0.001, "how": "advise"},
  }
  path.write_text(json.dumps(preds))
  monkeypatch.setattr(frontier, "predictions_file", lambda study: str(path))
  rows = [
    {"arm": "a", "loss_vs_fp32": 0.1, "half_width_95": 0.01},
    {"arm": "b", "loss_vs_fp32": 0.0, "half_width_95": 0.005},
    {"arm": "advised", "loss_vs_fp32": 0.004, "half_width_95": 0.008},
  ]
  lines = "\n".join(frontier._checked(rows, "study"))
  assert "a: predicted +0.2000 +- 0.0000, measured +0.1000" in lines
  assert "[+0.0900, +0.1100]: outside" in lines
  assert "b: predicted +0.0010" in lines and "]: inside" in lines
  assert "advised non-inferior at 0.01 nats: no (upper end +0.0120)" in lines
  assert "over 3 arms: +1.00" in lines
  monkeypatch.setattr(frontier, "predictions_file", lambda s: "/nonexistent")
  assert frontier._checked(rows, "study") == []
