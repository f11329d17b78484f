"""Telemetry as arrays: inside jit, stacked by scan, batched by vmap.

The scan loop must give the Python loop's bits and per-step telemetry; a
vmap ensemble, reseeded, must give each member its own random stream and
equal, member by member, the unbatched run with that member's key. Every
view of an NNX optimizer's state (nnx.state, pure dicts, orbax restores
without a target) gives the typed state's telemetry, and a state without
telemetry is an error, never an empty dict.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import lowprec

FMT = "bfloat16"


def assert_telemetry_equal(got: dict, want: dict) -> None:
  """Same keys and values, where a NaN entry (a fraction at a step without
  proposals) equals only NaN; `==` on two dicts holding NaN is False."""
  assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())

  def same(a, b):
    if isinstance(a, float) and isinstance(b, float):
      return a == b or (np.isnan(a) and np.isnan(b))
    return type(a) is type(b) and a == b

  bad = {k: (got[k], want[k]) for k in want if not same(got[k], want[k])}
  assert not bad, f"telemetry differs (got, want): {bad}"


def _problem():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = lowprec.to_grid(
    {"w": 0.5 * jax.random.normal(k1, (16, 4)), "b": jnp.zeros(4)}, FMT
  )
  x = jax.random.normal(k2, (20, 32, 16))  # 20 steps of batch 32
  y = jax.random.normal(k3, (20, 32, 4))
  return params, x, y


def _loss(p, x, y):
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _opt(rounding="stochastic"):
  return optax.chain(
    optax.adamw(optax.cosine_decay_schedule(3e-3, 20)),
    lowprec.freeze.reference_trace([FMT]),
    lowprec.writeback(FMT, rounding, key=jax.random.key(1)),
  )


def _step(opt):
  def step(carry, batch):
    params, state = carry
    grads = jax.grad(_loss)(params, *batch)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), lowprec.telemetry_arrays(state)

  return step


def test_scan_equals_the_python_loop_bit_for_bit_with_stacked_telemetry():
  params, x, y = _problem()
  opt = _opt()
  step = _step(opt)
  (p_scan, s_scan), curves = jax.jit(lambda c, b: jax.lax.scan(step, c, b))(
    (params, opt.init(params)), (x, y)
  )

  carry = (params, opt.init(params))
  jitted = jax.jit(step)
  per_step = []
  for t in range(20):
    carry, _ = jitted(carry, (x[t], y[t]))
    per_step.append(lowprec.telemetry(carry[1]))
  for k in ("w", "b"):
    np.testing.assert_array_equal(
      np.asarray(p_scan[k]).view(np.uint32),
      np.asarray(carry[0][k]).view(np.uint32),
    )
  assert set(curves) == set(per_step[0])
  for name, curve in curves.items():
    assert curve.shape[0] == 20, name
    want = np.array([s[name] for s in per_step])
    if np.issubdtype(curve.dtype, np.integer):
      np.testing.assert_array_equal(np.asarray(curve), want)
    else:  # float32 on device, float64 on the host
      np.testing.assert_allclose(np.asarray(curve), want, rtol=1e-6)
  assert curves["moved"].dtype == jnp.int32
  assert curves["erased_fraction"].dtype == jnp.float32
  assert int(curves["steps"][-1]) == 20
  # The curve is real: something moved and something was erased.
  assert curves["moved"].sum() > 0 and curves["erased"].sum() > 0
  assert_telemetry_equal(lowprec.telemetry(s_scan), per_step[-1])


@pytest.mark.parametrize("fmt", [FMT, "mxfp8_e4m3"])
def test_counting_every_third_update_reports_the_counted_ones(fmt):
  """`telemetry=3`, alone, with the chain in two branches
  (`counted_in_branches`) or as two programs picked per update
  (`counted_and_uncounted`): the same weights bit for bit as
  `telemetry=True` over 8 stochastic steps; after update t (from 1) the
  counts are those that `telemetry=True` gave after the last counted
  update (1, 4, 7), which `counted_step` names; one compile serves both
  kinds of update (each program once, for the pair)."""
  params, x, y = _problem()
  if fmt != FMT:  # a 32 x 32 kernel on the MX grid, blocks of 32
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    params = {"w": jax.random.normal(k1, (32, 32)), "b": jnp.zeros(32)}
    x, y = (
      jax.random.normal(k2, (8, 32, 32)),
      jax.random.normal(k3, (8, 32, 32)),
    )
    fmt = [("w", fmt), ("b", FMT)]
  params = lowprec.to_grid(params, fmt)
  runs = {}
  for telemetry in (True, 3, "branches", "programs"):
    opt = optax.chain(
      optax.adamw(3e-3),
      lowprec.writeback(
        fmt,
        "stochastic",
        key=jax.random.key(1),
        telemetry=telemetry if telemetry in (True, 3) else 3,
      ),
    )
    if telemetry == "branches":  # the whole chain in two branches
      opt = lowprec.counted_in_branches(opt)
    if telemetry == "programs":  # two compiled steps, picked per update
      pair = lowprec.counted_and_uncounted(opt)
      steps = [jax.jit(_step(pair.uncounted)), jax.jit(_step(pair.counted))]
    else:
      steps = [jax.jit(_step(opt))] * 2
    carry, seen = (params, opt.init(params)), []
    for t in range(8):
      carry, _ = steps[t % 3 == 0](carry, (x[t], y[t]))
      seen.append(lowprec.telemetry(carry[1]))
    assert all(step._cache_size() == 1 for step in steps)
    runs[telemetry] = carry[0], seen
  p_all, every = runs[True]
  for p_some, some in (runs[3], runs["branches"], runs["programs"]):
    for k in p_all:
      np.testing.assert_array_equal(
        np.asarray(p_some[k]).view(np.uint32),
        np.asarray(p_all[k]).view(np.uint32),
      )
    for t, tel in enumerate(some, start=1):
      counted = (t - 1) // 3 * 3 + 1
      assert tel.pop("count_every") == 3
      assert tel.pop("counted_step") == counted
      want = dict(every[counted - 1], steps=t)
      assert_telemetry_equal(tel, want)
    assert some[-1]["moved"] > 0
  with pytest.raises(ValueError, match="telemetry=10"):
    lowprec.writeback(FMT, telemetry=-1)


@pytest.mark.parametrize("wrap", ["branches", "programs"])
@pytest.mark.parametrize("telemetries", [(True,), (False,), (3, 5)])
def test_branches_need_one_every_k_writeback(telemetries, wrap):
  # Counting every update, none, or two different k: refused at init,
  # naming the fix.
  chain = optax.chain(
    optax.sgd(0.1),
    *(
      lowprec.writeback(FMT, "stochastic", key=jax.random.key(i), telemetry=t)
      for i, t in enumerate(telemetries)
    ),
  )
  if wrap == "branches":
    opt = lowprec.counted_in_branches(chain)
  else:
    opt = lowprec.counted_and_uncounted(chain).uncounted
  with pytest.raises(ValueError, match=r"writeback\(\.\.\., telemetry=k\)"):
    opt.init({"w": jnp.zeros(4)})


def test_programs_off_their_schedule_never_report_stale_counts():
  """`counted_and_uncounted` run off the every-3rd schedule: the counted
  program on an update not due keeps the last counts (those of update 1,
  as `telemetry=True` gave them); the uncounted program on a due update
  makes `lowprec.telemetry` raise, naming the schedule, where its counts
  would otherwise be update 1's under update 4's name. Eagerly, and
  jitted."""
  params, x, y = _problem()
  params = lowprec.to_grid(params, FMT)

  def chain(telemetry):
    return optax.chain(
      optax.adamw(3e-3),
      lowprec.writeback(
        FMT, "stochastic", key=jax.random.key(1), telemetry=telemetry
      ),
    )

  pair = lowprec.counted_and_uncounted(chain(3))
  ref = chain(True)
  carry_ref = (params, ref.init(params))
  carry = (params, pair.counted.init(params))
  first = None
  for t in range(2):
    carry_ref, _ = _step(ref)(carry_ref, (x[t], y[t]))
    carry, _ = jax.jit(_step(pair.counted))(carry, (x[t], y[t]))
    if t == 0:
      first = lowprec.telemetry(carry_ref[1])
  tel = lowprec.telemetry(carry[1])
  assert tel.pop("counted_step") == 1 and tel.pop("count_every") == 3
  assert_telemetry_equal(tel, dict(first, steps=2))
  assert tel["proposals"] > 0
  for run in (_step(pair.uncounted), jax.jit(_step(pair.uncounted))):
    later = carry
    for t in (2, 3):  # update 4 (t = 3) is due
      later, _ = run(later, (x[t], y[t]))
    with pytest.raises(ValueError, match=r"update 4 was due .*step % 3 == 0"):
      lowprec.telemetry(later[1])


def test_an_uncounted_update_in_branches_accesses_the_bytes_of_no_telemetry():
  # XLA's cost analysis of the uncounted branch's program (traced alone,
  # as the branch is): the bytes AdamW plus the write-back without
  # telemetry access, where the write-back's own lax.cond reads the
  # proposals back from memory. Skips where the backend has no analysis.
  from lowprec.optim import writeback as wb

  params = lowprec.to_grid({"w": jnp.ones((256, 256))}, FMT)

  def accessed(telemetry, branch=None):
    opt = optax.chain(
      optax.adamw(1e-3),
      lowprec.writeback(
        FMT, "stochastic", key=jax.random.key(0), telemetry=telemetry
      ),
    )
    token = wb._BRANCH.set(branch)
    try:
      step = jax.jit(lambda g, s, p: opt.update(g, s, p), donate_argnums=1)
      compiled = step.lower(params, opt.init(params), params).compile()
    finally:
      wb._BRANCH.reset(token)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if not cost or "bytes accessed" not in cost:
      pytest.skip("no cost analysis on this backend")
    return cost["bytes accessed"]

  plain = accessed(False)
  assert accessed(10, branch=False) <= 1.01 * plain
  assert accessed(10) > 1.1 * plain  # what the branches avoid


def test_telemetry_arrays_inside_jit_count_and_are_nan_without_proposals():
  params = {"w": jnp.ones(3)}
  opt = lowprec.writeback(FMT)

  @jax.jit
  def tel_after(u, state):
    return lowprec.telemetry_arrays(opt.update(u, state, params)[1])

  tiny = {"w": jnp.full(3, 1e-4)}  # under half the bf16 gap at 1: erased
  tel = tel_after(tiny, opt.init(params))
  assert int(tel["proposals"]) == 3 and int(tel["erased"]) == 3
  assert float(tel["erased_fraction"]) == 1.0
  zero = {"w": jnp.zeros(3)}
  tel = tel_after(zero, opt.init(params))
  assert int(tel["proposals"]) == 0 and np.isnan(tel["erased_fraction"])
  host = lowprec.telemetry(opt.update(zero, opt.init(params), params)[1])
  assert np.isnan(host["erased_fraction"])


def test_telemetry_with_a_nan_entry_equals_only_telemetry_with_nan_there():
  params = {"w": jnp.ones(3), "z": jnp.ones(2)}
  opt = lowprec.writeback(FMT)
  u = {"w": jnp.full(3, 1e-4), "z": jnp.zeros(2)}  # z proposes nothing
  update = jax.jit(opt.update)
  tel = lowprec.telemetry(update(u, opt.init(params), params)[1])
  again = lowprec.telemetry(update(u, opt.init(params), params)[1])
  assert np.isnan(tel["erased_fraction/z"]) and tel["erased_fraction/w"] == 1
  assert_telemetry_equal(tel, again)
  for changed in ({**again, "erased_fraction/z": 0.0}, {**again, "moved": 1}):
    with pytest.raises(AssertionError, match="telemetry differs"):
      assert_telemetry_equal(tel, changed)
  fewer = {k: v for k, v in again.items() if k != "moved"}
  with pytest.raises(AssertionError):
    assert_telemetry_equal(tel, fewer)


@pytest.mark.parametrize("rounding", ["stochastic", "deadzone"])
def test_vmap_ensemble_reseeded_draws_distinct_streams(rounding):
  params, x, y = _problem()
  members = 4
  opt = _opt(rounding)
  keys = jax.random.split(jax.random.key(42), members)
  ens = jax.tree.map(lambda a: jnp.stack([a] * members), params)
  states = jax.vmap(lambda p, k: lowprec.reseed(opt.init(p), k))(ens, keys)
  step = jax.jit(jax.vmap(_step(opt), in_axes=(0, None)))
  carry = (ens, states)
  for t in range(5):
    carry, tel = step(carry, (x[t], y[t]))
  assert tel["moved"].shape == (members,)
  host = lowprec.telemetry(carry[1])
  assert len(host["moved"]) == members and len(host["erased_fraction"]) == 4
  w = np.asarray(carry[0]["w"])
  # Same init, same data: only the random streams differ between members.
  for i in range(members):
    for j in range(i):
      assert not np.array_equal(w[i], w[j]), (i, j)
  # Member i is exactly the unbatched run reseeded with keys[i].
  for i in (0, 3):
    c = (params, lowprec.reseed(opt.init(params), keys[i]))
    single = jax.jit(_step(opt))
    for t in range(5):
      c, one = single(c, (x[t], y[t]))
    np.testing.assert_array_equal(np.asarray(c[0]["w"]), w[i])
    assert int(one["moved"]) == int(tel["moved"][i])


def test_unreseeded_vmap_members_share_one_stream():
  # Documents why reseed exists: the key is fixed when the transform is
  # built, so plain vmap(init) gives every member the same draws.
  params, x, y = _problem()
  opt = _opt()
  ens = jax.tree.map(lambda a: jnp.stack([a] * 2), params)
  carry = (ens, jax.vmap(opt.init)(ens))
  carry, _ = jax.jit(jax.vmap(_step(opt), in_axes=(0, None)))(
    carry, (x[0], y[0])
  )
  w = np.asarray(carry[0]["w"])
  np.testing.assert_array_equal(w[0], w[1])


def test_reseed_leaves_nearest_states_and_structure_alone():
  params = {"w": jnp.ones(3)}
  state = optax.chain(optax.sgd(1.0), lowprec.writeback(FMT)).init(params)
  again = lowprec.reseed(state, jax.random.key(3))
  assert jax.tree.structure(again) == jax.tree.structure(state)
  sr = lowprec.writeback(FMT, "stochastic", key=jax.random.key(0))
  s1 = sr.init(params)
  s2 = lowprec.reseed(s1, jax.random.key(9))
  assert s2.key.dtype == s1.key.dtype and s2.key.shape == s1.key.shape
  assert not np.array_equal(s1.key, s2.key)
  with pytest.raises(TypeError, match=r"jax.random.key\(seed\)"):
    lowprec.reseed(s1, "seed")


# ------------------------------------ views that have lost the state's types


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.tanh(self.l1(x)))


def _nnx_run(*tail, steps=3):
  """An NNX model and optimizer after a few steps, write-back last."""
  model = _MLP(nnx.Rngs(0))
  rules = [(r".*bias", None), (r".*", FMT)]
  nnx.update(model, lowprec.to_grid(nnx.state(model, nnx.Param), rules))
  if not tail:
    tail = (lowprec.writeback(rules, "stochastic", key=jax.random.key(1)),)
  tx = optax.chain(optax.adam(1e-2), *tail)
  opt = lowprec.nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(2), (32, 4))

  @nnx.jit
  def step(model, opt):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
    opt.update(model, grads)

  for _ in range(steps):
    step(model, opt)
  return model, opt


def _restored(tmp_path, tree):
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", tree)
  ckpt.wait_until_finished()
  out = ckpt.restore(tmp_path / "state")  # no target: dicts and lists
  ckpt.close()
  return out


def test_nnx_state_pure_dicts_and_orbax_restores_give_the_same_telemetry(
  tmp_path,
):
  _, opt = _nnx_run()
  want = lowprec.telemetry(opt.opt_state)
  # Independent oracle: the counts held in the write-back state's arrays.
  wb = nnx.as_pure(opt.opt_state)[1]
  assert want["steps"] == 3 == int(wb.count)
  assert want["moved"] == sum(int(v) for v in wb.moved.values()) > 0
  assert want["moved/l1/kernel"] == int(wb.moved["l1/kernel"])
  state = nnx.state(opt)
  restored = _restored(tmp_path, state)
  assert isinstance(restored, dict)
  assert isinstance(restored["opt_state"]["1"]["count"], dict)  # {"value"}
  views = {
    "nnx.state(opt)": state,
    'nnx.state(opt)["opt_state"]': state["opt_state"],
    "nnx.to_pure_dict(nnx.state(opt))": nnx.to_pure_dict(state),
    'to_pure_dict of ["opt_state"]': nnx.to_pure_dict(state["opt_state"]),
    "orbax restore of nnx.state(opt)": restored,
    'orbax restore, ["opt_state"]': restored["opt_state"],
  }
  for name, view in views.items():
    assert list(lowprec.telemetry(view).items()) == list(want.items()), name
    arrays = lowprec.telemetry_arrays(view)
    assert int(arrays["moved"]) == want["moved"], name
  # Inside jit too, from the NNX state.
  jitted = jax.jit(lowprec.telemetry_arrays)(nnx.as_pure(state))
  assert int(jitted["erased"]) == want["erased"]


def test_plain_optax_state_restored_without_target_gives_its_telemetry(
  tmp_path,
):
  params, x, y = _problem()
  opt = optax.chain(
    optax.adam(1e-2),
    lowprec.writeback(FMT),  # nearest: its key is None in the state
    lowprec.writeback(FMT, "stochastic", key=jax.random.key(1)),
  )
  state = opt.init(params)
  for t in range(3):
    grads = jax.grad(_loss)(params, x[t], y[t])
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  want = lowprec.telemetry(state)
  assert "moved#1" in want  # the second write-back, after the first
  restored = _restored(tmp_path, state)
  assert isinstance(restored, list) and isinstance(restored[1], dict)
  _assert_same(lowprec.telemetry(restored), want)
  # Without telemetry, the restored state keeps its None counts by name.
  quiet = optax.chain(optax.sgd(0.1), lowprec.writeback(FMT, telemetry=False))
  q = quiet.init(params)
  assert lowprec.telemetry(_restored(tmp_path / "quiet", q)) == {"steps": 0}


def test_a_restored_chain_keeps_its_order_past_ten_transforms(tmp_path):
  params = {"w": jnp.ones(3)}
  wbs = [lowprec.writeback(FMT) for _ in range(12)]
  state = optax.chain(*wbs).init(params)
  # Position 10 erases, the others do not move at all: its counts must
  # land on key "#10" as in the typed state, not on "#2" ("10" < "2").
  updates = [jnp.zeros(3)] * 12
  states = list(state)
  for i, wb in enumerate(wbs):
    u = jnp.full(3, 1e-4) if i == 10 else updates[i]
    _, states[i] = wb.update({"w": u}, states[i], params)
  state = tuple(states)
  want = lowprec.telemetry(state)
  assert want["proposals#10"] == 3 and want["proposals#2"] == 0
  _assert_same(lowprec.telemetry(_restored(tmp_path, state)), want)


def _assert_same(got: dict, want: dict) -> None:
  """Equal keys in the same order, equal values (NaN equal to NaN)."""
  assert list(got) == list(want)
  np.testing.assert_equal(got, want)


def test_no_telemetry_is_an_error_naming_what_was_given(tmp_path):
  model, opt = _nnx_run(optax.identity(), steps=1)
  cases = [
    (nnx.state(opt), "flax.nnx.statelib.State"),
    (nnx.state(model, nnx.Param), "flax.nnx.statelib.State"),
    (optax.adam(1e-2).init({"w": jnp.ones(2)}), "builtins.tuple"),
    (_restored(tmp_path, nnx.state(opt)), "builtins.dict"),
    ({}, "builtins.dict"),
  ]
  for tree, kind in cases:
    for read in (lowprec.telemetry, lowprec.telemetry_arrays):
      with pytest.raises(ValueError, match="found no telemetry") as e:
        read(tree)
      assert kind in str(e.value)
      assert "opt.opt_state" in str(e.value)  # what to pass


def test_a_reference_trace_seen_as_plain_arrays_is_refused_with_the_fix(
  tmp_path,
):
  rules = [(r".*bias", None), (r".*", FMT)]
  trace = lowprec.freeze.reference_trace({"t": rules})
  _, opt = _nnx_run(trace, lowprec.writeback(rules), steps=2)
  # The typed state reports both transforms ...
  typed = lowprec.telemetry(opt.opt_state)
  assert "pred/t/erased_fraction" in typed and "moved" in typed
  # ... views without the trace's names are refused, never half-read.
  state = nnx.state(opt)
  for view in (state, nnx.to_pure_dict(state), _restored(tmp_path, state)):
    with pytest.raises(ValueError, match="reference_trace at 'opt_state/1'"):
      lowprec.telemetry(view)
  # The fix the message names: restore into the optimizer, read its state.
  _, fresh = _nnx_run(trace, lowprec.writeback(rules), steps=0)
  nnx.update(fresh, state)
  assert lowprec.telemetry(fresh.opt_state) == typed


# ---- groups of optax.multi_transform ---------------------------------------


def _groups(path, _):
  return "gains" if "scale" in jax.tree_util.keystr(path) else "matrices"


def _labelled(gains_key=None):
  """Two write-backs under multi_transform: bfloat16 on the matrices,
  float8_e4m3fn (stochastic) on the gains."""
  gains = lowprec.writeback("float8_e4m3fn", "stochastic", key=gains_key)
  return optax.multi_transform(
    {"matrices": lowprec.writeback(FMT), "gains": gains},
    lambda p: jax.tree_util.tree_map_with_path(_groups, p),
  )


def _own_reports(state, prefix="") -> dict:
  """Each group's write-back state read by its own report(), labelled."""
  want = {}
  for label in ("matrices", "gains"):
    node = state.inner_states[label].inner_state
    want |= {f"{prefix}{label}/{k}": v for k, v in node.report().items()}
  return want


class _Normed(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, use_bias=False, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.norm(jax.nn.tanh(self.l1(x))))


def test_write_backs_in_multi_transform_groups_report_under_their_labels(
  tmp_path,
):
  model = _Normed(nnx.Rngs(0))
  on_grid = [(r".*scale", "float8_e4m3fn"), (r".*", FMT)]
  nnx.update(model, lowprec.to_grid(nnx.state(model, nnx.Param), on_grid))
  tx = optax.chain(optax.adam(1e-2), _labelled(jax.random.key(1)))
  opt = lowprec.nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(2), (32, 4))

  @nnx.jit
  def step(model, opt):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
    opt.update(model, grads)

  for _ in range(3):
    step(model, opt)
  typed = nnx.as_pure(opt.opt_state)[1]
  want = _own_reports(typed)
  assert want["matrices/steps"] == 3 == want["gains/steps"]
  assert want["matrices/moved/l1/kernel"] > 0
  assert "gains/proposals/norm/scale" in want
  got = lowprec.telemetry(opt.opt_state)
  assert not [k for k in got if "#" in k], list(got)
  assert_telemetry_equal(got, want)
  state = nnx.state(opt)
  restored = _restored(tmp_path, state)
  views = {
    "nnx.state(opt)": state,
    "nnx.to_pure_dict(nnx.state(opt))": nnx.to_pure_dict(state),
    "orbax restore of nnx.state(opt)": restored,
    'orbax restore, ["opt_state"]': restored["opt_state"],
  }
  for name, view in views.items():
    assert list(lowprec.telemetry(view).items()) == list(got.items()), name
    arrays = lowprec.telemetry_arrays(view)
    assert list(arrays) == list(got), name
    assert int(arrays["gains/moved"]) == want["gains/moved"], name
  jitted = jax.jit(lowprec.telemetry_arrays)(nnx.as_pure(state))
  assert int(jitted["matrices/erased"]) == want["matrices/erased"]


def test_labels_nest_and_a_plain_state_restored_without_target_keeps_them(
  tmp_path,
):
  params, x, y = _problem()
  params = {"w": params["w"], "scale": lowprec.to_grid(params["b"] + 1, FMT)}
  inner = optax.chain(
    optax.adam(1e-2),
    optax.multi_transform(
      {"matrices": lowprec.writeback(FMT), "gains": lowprec.writeback(FMT)},
      lambda p: jax.tree_util.tree_map_with_path(_groups, p),
    ),
  )
  # An outer group around the inner ones: labels join, outer first.
  opt = optax.multi_transform({"all": inner}, lambda p: {k: "all" for k in p})
  state = opt.init(params)

  def loss(p, x, y):
    return jnp.mean((x @ p["w"] * p["scale"] - y) ** 2)

  for t in range(3):
    grads = jax.grad(loss)(params, x[t], y[t])
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  want = _own_reports(state.inner_states["all"].inner_state[1], "all/")
  assert want["all/matrices/moved"] > 0 and want["all/gains/moved"] > 0
  got = lowprec.telemetry(state)
  assert_telemetry_equal(got, want)
  restored = _restored(tmp_path, state)
  assert "all" in restored["inner_states"]  # the label survives as a key
  _assert_same(lowprec.telemetry(restored), got)
  # Outside multi_transform, a collision still takes the `#n` suffix.
  both = optax.chain(lowprec.writeback(FMT), lowprec.writeback(FMT))
  assert "moved#1" in lowprec.telemetry(both.init(params))
