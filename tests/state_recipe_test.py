"""A stored state's recipe: specs that say one thing, rules that decide a
leaf, stalls counted on the stored codes, and states that refuse another
recipe.

Oracles are independent of the counts under test: which codes stayed is
read from the stored arrays themselves (numpy), which values changed from
the float32 inputs the test chose.
"""

from types import SimpleNamespace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowprec
from lowprec.optim.stored_state import parse_state_format, unpacked
from tests.state_storage_test import holder

KEY = jax.random.key(3)

# --- a spec names each part once


@pytest.mark.parametrize(
  "spec, kind, fixes",
  [
    (
      "bfloat16:stochastic:nearest",
      "rounding",
      ["'bfloat16:stochastic' or 'bfloat16:nearest'"],
    ),
    (
      "float8_e4m3fn:tensor:block128",
      "scale",
      ["'float8_e4m3fn:tensor' or 'float8_e4m3fn:block128'"],
    ),
    (
      "float8_e4m3fn:nearest:block32:amax:pow2",
      "scale rule",
      ["'float8_e4m3fn:nearest:block32:amax' or"],
    ),
    ("dynamic8:block256:float16:float32", "scale dtype", ["float16"]),
    ("bfloat16:nearest:nearest", "rounding", ["'bfloat16:nearest'"]),
  ],
  ids=["two-roundings", "two-scales", "two-rules", "two-dtypes", "repeated"],
)
def test_a_spec_with_a_part_given_twice_is_an_error_naming_the_fix(
  spec, kind, fixes
):
  """Before, the last part won silently ('bfloat16:stochastic:nearest'
  stored with nearest rounding)."""
  for make in (
    parse_state_format,
    lambda s: lowprec.store_state(optax.adam(1e-3), {"mu": s}, key=KEY),
    lambda s: lowprec.freeze.state_trace(
      optax.adam(1e-3), {"t": {"mu": s}}
    ).init({"w": jnp.zeros(3)}),
  ):
    with pytest.raises(ValueError, match=f"gives the {kind} twice") as e:
      make(spec)
    for fix in fixes:
      assert fix in str(e.value)
  # The fixes the message names parse, each to what it says.
  assert str(parse_state_format("bfloat16:stochastic")) == "bfloat16:stochastic"
  got = parse_state_format("float8_e4m3fn:block128")
  assert (got.rounding, got.scale) == ("nearest", 128)


def test_each_kind_of_part_is_recognized_once_in_any_order():
  sf = parse_state_format("float8_e4m3fn:block32:float16:amax:stochastic")
  assert (sf.rounding, sf.scale, sf.scale_rule, sf.scale_dtype) == (
    "stochastic",
    32,
    "amax",
    "float16",
  )


@pytest.mark.parametrize("spec", ["int8:nearest", "int4:stochastic", "int8"])
def test_an_integer_grid_without_a_scale_names_the_spec_that_gives_one(spec):
  """Before: "int8 needs a positive finite scale, e.g. get_format('int8',
  scale=0.0625)", a call no state spec can make."""
  name, *rest = spec.split(":")
  rounding = rest[0] if rest else "nearest"
  fix = f"'{name}:{rounding}:block128' or '{name}:{rounding}:tensor'"
  for make in (
    parse_state_format,
    lambda s: lowprec.store_state(optax.adam(1e-3), {"nu": s}, key=KEY),
  ):
    with pytest.raises(ValueError) as e:
      make(spec)
    assert fix in str(e.value), str(e.value)
    assert "get_format" not in str(e.value)
  # The fix works: the unit grid under a power-of-two scale per block.
  tx = lowprec.store_state(optax.adam(1e-3), {"nu": f"{name}:nearest:block128"})
  assert tx.init({"w": jnp.zeros(8)}).inner[0].nu["w"].dtype == jnp.float32


# --- the first rule that matches a leaf decides it


def test_the_first_of_two_matching_rules_decides_the_leaf():
  """Both rules store '0/mu/w'; the first (bfloat16) wins, the second
  (float8_e5m2 per tensor) takes only what the first leaves: nu."""
  params = {"w": jnp.ones((4, 8))}
  rules = [("0/mu", "bfloat16"), ("mu|nu", "float8_e5m2:nearest:tensor")]
  tx = lowprec.store_state(optax.adam(1e-3), rules)
  state = tx.init(params)
  assert state.inner[0].mu["w"].dtype == jnp.bfloat16
  assert state.inner[0].nu["w"].dtype == jnp.float8_e5m2
  assert set(state.scales) == {"0/nu/w"}
  _, state = jax.jit(tx.update)(params, state, params)
  assert state.inner[0].mu["w"].dtype == jnp.bfloat16
  assert state.recipe.entries == (
    ("0/mu/w", "bfloat16:nearest"),
    ("0/nu/w", "float8_e5m2:nearest:tensor"),
  )


# --- stalls: counted on the stored codes

# Every kind of state store: unscaled grids, power-of-two and amax
# scales, per block and per tensor, integer grids, every code map.
SPECS = [
  "bfloat16",
  "float8_e4m3fn",
  "e8m3",
  "float8_e4m3fn:nearest:block32",
  "float8_e5m2:nearest:tensor",
  "float8_e4m3fn:nearest:block32:amax",
  "float8_e4m3fn:nearest:block32:amax:float16",
  "int8:nearest:block32",
  "int4:nearest:block32:amax",
  "dynamic8:block32",
  "dynamic8u:block32",
  "dynamic4:block32",
  "companded8:block32",
  "sqrt8:block32",
  "uint4nz:block32",
  "dynamic8:stochastic:block32",
  "float8_e4m3fn:deadzone:block32:amax",
]
UNSIGNED = ("dynamic8u", "sqrt8", "uint4nz")


def _start(spec, shape=(4, 64)):
  """Values over two decades, of both signs where the map has them
  (seed 0)."""
  rng = np.random.default_rng(0)
  s0 = 10.0 ** rng.uniform(-2, 0, shape)
  if not spec.startswith(UNSIGNED):
    s0 = s0 * rng.choice([-1.0, 1.0], shape)
  # Each block's largest positive: a signed map's top code stands for +1
  # times the scale (not -1), so what the store holds stores back as is.
  for b in range(0, shape[-1], 32):
    block = s0[..., b : b + 32]
    np.abs(
      block,
      out=block,
      where=np.abs(block) == np.abs(block).max(-1, keepdims=True),
    )
  return s0.astype(np.float32)


def _codes(state):
  return np.asarray(unpacked(state).inner.s["w"]).astype(np.float32)


def _held(spec, x):
  """The float32 value the store holds after storing `x` once."""
  _, _, state = _two_stores(spec, x, x)
  return np.asarray(
    lowprec.engine.codec.decode(
      parse_state_format(spec).codec(),
      unpacked(state).inner.s["w"],
      state.scales.get("s/w"),
    )
  )


def _two_stores(spec, s0, s1):
  """The stored codes after storing `s0`, then after `s1`, and the
  telemetry of the second store."""
  tx = lowprec.store_state(holder(), {"s": spec}, key=KEY)
  update = jax.jit(tx.update)
  params = {"w": jnp.zeros(s0.shape)}
  _, state = update({"w": jnp.asarray(s0)}, tx.init(params))
  before = _codes(state)
  # The holder's new state is its input; the store widens what it held.
  _, state = update({"w": jnp.asarray(s1)}, state)
  return before, _codes(state), state


@pytest.mark.parametrize("spec", SPECS)
def test_a_change_that_leaves_the_code_is_a_stall_and_one_that_moves_it_not(
  spec,
):
  """Half the coordinates change by 1e-6 of their value (their codes
  stay), the others halve (their codes move, but for the smallest codes
  of 4-bit maps); the largest value of every block of 32 stays, so no
  scale moves. stalled / changed equals the share of changed coordinates
  whose stored code (read from the state) stayed (seeds 0 and 1)."""
  # Values the store holds as they are, scales included: stored again,
  # they come back unchanged.
  s0 = _start(spec)
  for _ in range(3):
    s0 = _held(spec, s0)
  widened = _held(spec, s0)
  rng = np.random.default_rng(1)
  tiny = rng.random(s0.shape) < 0.5
  s1 = np.where(tiny, widened * np.float32(1 + 1e-6), widened * 0.5)
  rows = np.arange(s0.shape[0])
  for b in range(0, s0.shape[1], 32):  # each block's largest stays
    top = b + np.argmax(np.abs(widened[:, b : b + 32]), axis=1)
    s1[rows, top] = widened[rows, top]
  s1 = s1.astype(np.float32)
  before, after, state = _two_stores(spec, s0, s1)
  changed = np.isfinite(s1) & (s1 != widened)
  stayed = after == before
  want = int((changed & stayed).sum())
  tel = lowprec.telemetry(state)
  assert tel["state/changed"] == int(changed.sum())
  assert int(state.counts.stalled["s/w"]) == want
  assert tel["state/stalled_fraction"] == want / int(changed.sum())
  assert tel["state/stalled_fraction/s/w"] == tel["state/stalled_fraction"]
  # Both kinds of change happen: tiny ones stall, large ones move codes.
  assert (changed & tiny & stayed).sum() > 0.9 * (changed & tiny).sum() > 0
  assert (changed & ~tiny & ~stayed).sum() > 0.5 * (changed & ~tiny).sum()


@pytest.mark.parametrize(
  "spec", ["dynamic8:block32", "float8_e4m3fn:nearest:block32:amax"]
)
def test_an_8_bit_state_whose_codes_do_not_change_stalls_every_update(spec):
  """Every value shrinks by 1e-4 (a decaying second moment): the block's
  largest value moves, and with it the amax scale and every stored value,
  but no code moves. Before, such a step reported 0 erased; the stall
  share is 1."""
  s0 = _start(spec)
  tx = lowprec.store_state(holder(), {"s": spec})
  update = jax.jit(tx.update)
  params = {"w": jnp.zeros(s0.shape)}
  _, state = update({"w": jnp.asarray(s0)}, tx.init(params))
  before = _codes(state)
  widened = np.asarray(
    lowprec.engine.codec.decode(
      parse_state_format(spec).codec(),
      unpacked(state).inner.s["w"],
      state.scales["s/w"],
    )
  )
  s1 = (widened * np.float32(1 - 1e-4)).astype(np.float32)
  _, state = update({"w": jnp.asarray(s1)}, state)
  assert np.array_equal(_codes(state), before)  # the oracle: no code moved
  tel = lowprec.telemetry(state)
  assert tel["state/changed"] == s0.size
  assert tel["state/stalled_fraction"] == 1.0
  assert tel["state/erased"] < s0.size  # the values moved with the scale


def test_stalls_are_readable_inside_jit_and_scan():
  spec = "dynamic8:block32"
  s0 = jnp.asarray(_start(spec))
  tx = lowprec.store_state(holder(), {"s": spec})
  params = {"w": jnp.zeros(s0.shape)}

  def body(state, scale):
    _, state = tx.update({"w": s0 * scale}, state, params)
    return state, lowprec.telemetry_arrays(state)["state/stalled_fraction"]

  scales = jnp.asarray([1.0, 1.0 - 1e-4, 1.0 - 2e-4], jnp.float32)
  got = jax.jit(lambda: jax.lax.scan(body, tx.init(params), scales)[1])()
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got)[1:], [1.0, 1.0])


def test_the_float32_prediction_counts_stalls_on_the_codes():
  """The prediction of a step that only rescales an amax block: every
  changed coordinate keeps its code (stalled 1), while the values all
  move (erased 0); without a scale the two predictions agree."""
  s0 = _start("dynamic8")
  s1 = (s0 * np.float32(1 - 1e-4)).astype(np.float32)
  rules = {"s": "dynamic8:block32"}
  got = lowprec.freeze.state_erasure({"s": s0}, {"s": s1}, rules)["s"]
  assert int(got["changed"]) == s0.size
  assert float(got["stalled_fraction"]) == 1.0
  assert float(got["erased"]) < 0.1 * s0.size
  bf = lowprec.freeze.state_erasure({"s": s0}, {"s": s1}, {"s": "bfloat16"})
  assert float(bf["s"]["stalled"]) == float(bf["s"]["erased"]) > 0
  trace = lowprec.freeze.state_trace(holder(), {"q8": rules})
  params = {"w": jnp.zeros(s0.shape)}
  state = trace.update({"w": jnp.asarray(s0)}, trace.init(params))[1]
  state = trace.update({"w": jnp.asarray(s1)}, state)[1]
  tel = lowprec.telemetry(state)
  assert tel["pred_state/q8/stalled_fraction"] == 1.0
  assert tel["pred_state/q8/stalled_fraction/s/w"] == 1.0
  assert tel["pred_state/q8/stalled"] == s0.size


# --- a stored state refuses another recipe


def test_a_moment_state_refuses_a_store_built_with_another_recipe():
  """Saved as dynamic8 (uint8 codes), continued as fp8 with amax scales:
  the codes were read as e4m3 values and the update's mean |u| jumped
  about 100x in one step. Now the first update refuses, naming both."""
  params = {"w": jax.random.normal(jax.random.key(0), (4, 256)) * 0.1}
  grads = jax.tree.map(lambda p: jnp.sin(30 * p), params)
  old = lowprec.store_state(optax.adam(1e-3), {"nu": "dynamic8u:block256"})
  new = lowprec.store_state(
    optax.adam(1e-3), {"nu": "float8_e4m3fn:nearest:block256:amax"}
  )
  _, state = jax.jit(old.update)(grads, old.init(params), params)
  want = (
    "0/nu/w: recorded 'dynamic8u:nearest:block256', this transform "
    "'float8_e4m3fn:nearest:block256:amax'"
  )
  for update in (new.update, jax.jit(new.update)):
    with pytest.raises(ValueError, match="another recipe") as e:
      update(grads, state, params)
    assert want in str(e.value)
    assert "start a new state with init" in str(e.value)
  # Another rounding is another recipe too; the same recipe continues.
  sr = lowprec.store_state(
    optax.adam(1e-3), {"nu": "dynamic8u:stochastic:block256"}, key=KEY
  )
  with pytest.raises(ValueError, match="recorded 'dynamic8u:nearest"):
    sr.update(grads, state, params)
  again = lowprec.store_state(optax.adam(1e-3), {"nu": "dynamic8u:block256"})
  u, _ = jax.jit(again.update)(grads, state, params)
  assert float(jnp.mean(jnp.abs(u["w"]))) < 2e-3


def test_a_split_state_refuses_other_correction_bits():
  """8-bit codes read with K = 32767 shrank the correction 258x."""
  params = lowprec.to_grid(
    {"w": jax.random.normal(jax.random.key(1), (8, 32))}, "bfloat16"
  )
  grads = {"w": jnp.full((8, 32), 1e-5)}
  eight = lowprec.split_writeback(correction_bits=8)
  state = jax.jit(eight.update)(grads, eight.init(params), params)[1]
  assert any(int(jnp.abs(c).max()) > 0 for c in state.correction.values())
  sixteen = lowprec.split_writeback(correction_bits=16)
  for update in (sixteen.update, jax.jit(sixteen.update)):
    with pytest.raises(
      ValueError, match="correction_bits: recorded '8', this transform '16'"
    ):
      update(grads, state, params)
  jax.jit(eight.update)(grads, state, params)  # its own recipe continues


def test_records_are_static_and_follow_the_state_through_wrappers():
  """No array holds the record (the state's leaves are those of the
  stores), jit does not retrace for it, and optax's wrappers keep it."""
  params = {"w": jnp.ones((4, 8))}
  rules = {"mu": "bfloat16", "nu": "dynamic8u:block32"}
  tx = optax.MultiSteps(lowprec.store_state(optax.adam(1e-3), rules), 2)
  state = tx.init(params)
  (path, rec), *rest = lowprec.engine.record.recipes_of(state).items()
  assert not rest and path.endswith("inner_opt_state/recipe")
  assert str(rec) == (
    "store_state(0/mu/w=bfloat16:nearest, 0/nu/w=dynamic8u:nearest:block32)"
  )
  assert lowprec.engine.record.Recipe.from_json(rec.to_json()) == rec
  assert all(hasattr(x, "dtype") for x in jax.tree.leaves(state))
  traces = []

  @jax.jit
  def step(state):
    traces.append(1)
    return tx.update(params, state, params)[1]

  state = step(step(state))
  assert len(traces) == 1
  assert lowprec.engine.record.recipes_of(state) == {path: rec}


def test_views_without_the_record_still_count_and_report():
  """nnx.state(opt) and its pure dict hold the arrays, not the static
  record: bytes per parameter (scales served by their moment) and the
  telemetry read from them equal those of the typed state."""
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(256, 256, rngs=rngs)

  net = Net(nnx.Rngs(0))
  rules = {"nu": "float8_e4m3fn:nearest:block128", "mu": "dynamic8:block256"}
  tx = lowprec.store_state(optax.adam(1e-3), rules)
  opt = nnx.Optimizer(net, tx, wrt=nnx.Param)
  grads = jax.tree.map(jnp.ones_like, nnx.state(net, nnx.Param))
  opt.update(net, grads)
  params = nnx.state(net, nnx.Param)
  typed = lowprec.bytes_per_param(params, opt.opt_state)
  assert typed.state == 1 + 1 + 4 / 128 + 4 / 256
  for view in (nnx.state(opt), nnx.state(opt).to_pure_dict()):
    assert lowprec.bytes_per_param(params, view).state == typed.state
    assert lowprec.telemetry(view) == lowprec.telemetry(opt.opt_state)


# --- the runner's tables report stalls


def _records(steps, per_step):
  return [{"step": t, "loss": 3.0, **per_step} for t in range(1, steps + 1)]


def test_frontier_reports_measured_and_predicted_stalls_of_nu():
  """A dynamic8 arm (q8) whose nu erases nothing but stalls 0.9 of its
  changes (mu 0.1, left out), and the float32 run that predicted 0.85:
  the table's nu stalled reads 0.9 measured, 0.85 predicted. It read
  the erased share before: 0 and 0.01."""
  from configs import common
  from experiments.analysis import frontier
  from lowprec import recipes

  base = common.get_config().to_dict()
  lp = {**base["lowprec"], "state": list(recipes.STATES["q8"].config)}
  config = {**base, "lowprec": lp, "train": {**base["train"], "steps": 4}}
  measured = {
    "state/changed/0/nu/w": 100,
    "state/erased/0/nu/w": 0,
    "state/stalled_fraction/0/nu/w": 0.9,
    "state/changed/0/mu/w": 100,
    "state/erased/0/mu/w": 0,
    "state/stalled_fraction/0/mu/w": 0.1,
  }
  run = SimpleNamespace(config=config, metrics=_records(4, measured))
  assert frontier.measured(run)["nu_stalled"] == pytest.approx(0.9)
  pred = {
    "pred_state/q8/changed/0/nu/w": 100,
    "pred_state/q8/erased/0/nu/w": 1.0,
    "pred_state/q8/stalled/0/nu/w": 85.0,
    "pred_state/q8/changed/0/mu/w": 100,
    "pred_state/q8/stalled/0/mu/w": 5.0,
  }
  ref = SimpleNamespace(
    config=config, metrics=_records(4, pred), path="ref/seed0"
  )
  got = frontier.predicted(ref, config, {"w": 1}, {})
  assert got["nu_stalled"] == pytest.approx(0.85)


def test_state_table_reports_stalls_beside_erasures():
  """state_precision's table: per moment, the second half's stalled share
  measured (from state/stalled_fraction) and predicted (pred_state
  stalled counts), beside the erased ones."""
  from experiments.analysis import state_tables

  steps = 4
  ref_recs = _records(
    steps,
    {
      "pred_state/rn/changed/0/nu/w": 10,
      "pred_state/rn/erased/0/nu/w": 1.0,
      "pred_state/rn/stalled/0/nu/w": 7.0,
    },
  )
  recs = _records(
    steps,
    {
      "state/changed/0/nu/w": 10,
      "state/erased/0/nu/w": 0,
      "state/stalled_fraction/0/nu/w": 0.8,
      "state/flushed": 0,
    },
  )
  cfg = {"lowprec": {"state": ["nu=dynamic8u:block256"]}, "train": {}}

  def run(arm, metrics, study):
    return SimpleNamespace(
      arm=arm,
      seed=0,
      metrics=metrics,
      config={**cfg, "study": study},
      summary={},
      last=lambda k, m=metrics: m[-1].get(k),
    )

  runs = [
    run("fp32", ref_recs, {}),
    run("q8", recs, {"reference_arm": "fp32", "cell": "rn"}),
  ]
  with mock.patch.object(state_tables, "recipe_bytes", lambda c: 2.0):
    rows, _ = state_tables.state_table(runs)
  row = next(r for r in rows if r["arm"] == "q8")
  assert row["nu_erased_2nd_half"] == 0.0
  assert row["nu_stalled_2nd_half"] == pytest.approx(0.8)
  assert row["nu_predicted_2nd_half"] == pytest.approx(0.1)
  assert row["nu_stalled_predicted_2nd_half"] == pytest.approx(0.7)
