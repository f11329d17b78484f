"""The benchmark driver: interleaved rounds, paired ratios, JSON output.

Nothing here asserts a timing; it checks the bookkeeping with made-up
times and runs the smallest section once end to end.
"""

import json

import pytest

from scripts import bench, benchlib


def test_ratios_pair_cases_round_by_round():
  r = benchlib.Result(
    "t", {"base": [1.0, 2.0, 4.0], "x": [2.0, 2.0, 2.0]}, ("base",)
  )
  assert r.ratios("x", "base") == [2.0, 1.0, 0.5]
  d = r.as_dict()["cases"]["x"]
  assert d["ratio_to"]["base"] == {"median": 1.0, "min": 0.5, "max": 2.0}
  assert d["median_ms"] == 2000.0
  md = r.markdown()
  assert "| x | 2000.00 | 1.00x (0.50-2.00) |" in md
  assert "3 interleaved rounds" in md


def test_columns_show_beside_the_ratios_and_blank_where_a_case_has_none():
  r = benchlib.Result(
    "t",
    {"base": [1.0], "x": [2.0]},
    ("base",),
    columns={"MB": {"base": 3.25}, "n": {"x": 7.0}},
  )
  md = r.markdown()
  assert "| case | median ms | ratio to base (range) | MB | n |" in md
  assert "|---|---:|---:|---:|---:|" in md
  assert "| base | 1000.00 | 1.00x (1.00-1.00) | 3.2 |  |" in md
  assert "| x | 2000.00 | 2.00x (2.00-2.00) |  | 7.0 |" in md
  assert r.as_dict()["columns"] == {"MB": {"base": 3.25}, "n": {"x": 7.0}}
  assert "columns" not in benchlib.Result("t", {"a": [1.0]}, ("a",)).as_dict()


def test_interleave_times_every_case_every_round_in_alternating_order():
  order = []

  def fn(name):
    order.append(name)
    return 0

  calls = {"a": (fn, ("a",)), "b": (fn, ("b",))}
  times = benchlib.interleave(calls, rounds=3, repeats=1, warmup=1)
  assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
  assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]


def test_driver_writes_json_for_a_section(tmp_path, capsys):
  path = tmp_path / "bench.json"
  bench.main(["rounding", "--quick", "--json", str(path)])
  data = json.loads(path.read_text())
  cases = data["rounding"]["cases"]
  base = cases["native astype float8_e4m3fn"]
  assert base["ratio_to"]["native astype float8_e4m3fn"]["median"] == 1.0
  assert "round_stochastic to float8 (dtype=)" in cases
  assert all(c["median_ms"] > 0 for c in cases.values())
  assert "### rounding" in capsys.readouterr().out


def test_across_runs_takes_the_median_and_range_of_run_medians():
  runs = [
    benchlib.Result("t", {"b": [1.0, 1.0], "x": [f, f]}, ("b",))
    for f in (1.2, 1.5, 1.3)
  ]
  d = benchlib.across_runs(runs)["cases"]["x"]["b"]
  assert d == {"runs": [1.2, 1.5, 1.3], "median": 1.3, "min": 1.2, "max": 1.5}
  md = benchlib.across_runs_markdown(runs)
  assert "| x | 1.30x (1.20-1.50) |" in md and "3 runs" in md


def test_scaled_section_times_mx_quantize_against_the_cast(tmp_path):
  path = tmp_path / "bench.json"
  bench.main(["scaled", "--quick", "--json", str(path)])
  data = json.loads(path.read_text())["scaled"]
  cast = "native astype float8_e4m3fn"
  for case, most in data["targets"].items():
    ratio = data["cases"][case]["ratio_to"][cast]
    assert ratio["min"] <= ratio["median"] <= ratio["max"]
    assert most in (2.0, 3.0)
  assert any(
    n.startswith("- quantize mxfp8_e4m3 nearest") for n in data["notes"]
  )


@pytest.mark.slow
def test_frontier_section_times_whole_steps_of_each_arm(tmp_path):
  path = tmp_path / "bench.json"
  bench.main(["frontier", "--quick", "--json", str(path)])
  data = json.loads(path.read_text())["frontier"]
  assert set(data["cases"]) == {"fp32", "bf16_sr_mom_q8", "bf16_rn"}
  for case in data["cases"]:
    ratio = data["cases"][case]["ratio_to"]["bf16_rn"]
    assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]


def test_cases_selects_writeback_rows_beside_the_baselines(monkeypatch):
  # The rows are built, then only the selected ones (and both baselines)
  # are timed: `interleave` is replaced to record which.
  from scripts import bench_writeback

  timed = []

  def fake(calls, rounds, repeats):
    timed.extend(calls)
    return {name: [1.0] * rounds for name in calls}

  monkeypatch.setattr(bench_writeback, "interleave", fake)
  result = bench_writeback.run(quick=True, cases="telemetry")
  programs = bench_writeback.PROGRAMS
  # A row counting every k-th update brings the write-back without
  # telemetry, its third baseline.
  assert timed == [
    "adamw",
    "+ nearest",
    "+ stochastic",
    "+ stochastic + telemetry",
    programs,
    bench_writeback.APPLY_XLA,
    bench_writeback.APPLY_KERNEL,
  ]
  assert result.baselines == ("adamw", "+ nearest", "+ stochastic")
  # The two programs' row times ten updates a call: a tenth per update.
  assert result.times[programs] == [0.1] * 3
  assert result.times["+ stochastic + telemetry"] == [1.0] * 3
  timed.clear()
  bench_writeback.run(quick=True, cases="^. stochastic . telemetry$")
  assert timed == ["adamw", "+ nearest", "+ stochastic + telemetry"]


def test_writeback_steps_donate_and_carry_their_params_and_state(monkeypatch):
  # A training loop donates its params and state and runs the next step on
  # what the last returned; the section times its rows that way. Each call
  # is made twice here: the step count must advance by one a call, by k
  # for the two programs' row (k updates a call), and stay put for the row
  # timed on an update it does not count; the params must move.
  import jax
  import numpy as np

  from scripts import bench_writeback

  out = {}

  def calling(calls, rounds, repeats):
    for name, (fn, args) in calls.items():
      assert args == (), name  # a carried call reads its own buffers
      out[name] = [jax.device_get(fn()) for _ in range(2)]
    return {name: [1.0] * rounds for name in calls}

  monkeypatch.setattr(bench_writeback, "interleave", calling)
  programs, every = bench_writeback.PROGRAMS, bench_writeback.EVERY
  bench_writeback.run(quick=False, cases="every 10, (two|uncounted)")
  assert set(out) >= {"adamw", "+ nearest", programs, every}

  def count(name, i):
    return int(bench_writeback._count_of(out[name][i][1]))

  adamw_count = [int(out["adamw"][i][1][0].count) for i in (0, 1)]
  assert adamw_count[1] == adamw_count[0] + 1
  assert count(programs, 1) == count(programs, 0) + 10
  # Set back after each call: the next reads count 1 again, an update
  # that telemetry every 10 does not count.
  assert count(every, 0) == count(every, 1) == 1
  first, second = (out["adamw"][i][0]["layer0"]["kernel"] for i in (0, 1))
  assert not np.array_equal(first, second)


def test_writeback_rows_show_xla_bytes_and_the_rate_they_were_moved_at(
  monkeypatch,
):
  # Beside the ratios: the bytes XLA's cost analysis gives for the very
  # program timed, a parameter, and those bytes over the median time. The
  # oracle is XLA's analysis of the same step compiled here; the
  # two-program row's bytes are the mean of its k updates (one counted).
  import jax
  import optax

  import lowprec
  from scripts import bench_writeback as bw

  def fake(calls, rounds, repeats):
    return {name: [0.5, 1.0, 2.0] for name in calls}  # median 1 s

  monkeypatch.setattr(bw, "interleave", fake)
  result = bw.run(quick=True, cases="^adamw$|two programs")
  params = lowprec.to_grid(bw._params(2_000_000, 2), "bfloat16")
  grads = jax.tree.map(lambda p: p + 1e-4, params)
  n = sum(p.size for p in jax.tree.leaves(params))

  def accessed(tx):
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    state = tx.init(params)
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads)
    return lowered.compile().cost_analysis()["bytes accessed"]

  k = bw.EVERY_K[bw.PROGRAMS]
  pair = lowprec.counted_and_uncounted(bw._every_k(k))
  want = {
    "adamw": accessed(optax.adamw(1e-3)),
    bw.PROGRAMS: (accessed(pair.counted) + (k - 1) * accessed(pair.uncounted))
    / k,
  }
  got, rate = result.columns[bw.BYTES], result.columns[bw.RATE]
  assert (
    set(got) == set(rate) == {"adamw", "+ nearest", "+ stochastic", bw.PROGRAMS}
  )
  for name, b in want.items():
    assert got[name] == pytest.approx(b / n, rel=1e-6), name
  # The two-program row's time is a tenth a call (k updates a call).
  assert rate["adamw"] == pytest.approx(want["adamw"] / 1.0 / 1e9)
  assert rate[bw.PROGRAMS] == pytest.approx(want[bw.PROGRAMS] / 0.1 / 1e9)
  # AdamW reads and writes its 7 float32 arrays at least: 28 bytes.
  assert got["adamw"] >= 28
  md = result.markdown()
  assert f"| {bw.BYTES} | {bw.RATE} |" in md
  assert f"| {got['adamw']:.1f} | {rate['adamw']:.1f} |" in md
  assert result.as_dict()["columns"][bw.BYTES] == got


def test_accelerators_time_trees_large_enough_for_memory_to_set_the_time():
  # 40 bytes a parameter for AdamW: on an accelerator a quick step must
  # move gigabytes (over half a millisecond at 3.35 TB/s, far above a
  # launch's microseconds), not tens of megabytes, and no run may hold
  # more than half of an 80 GB card in its rows.
  from scripts import bench_writeback as bw

  assert bw.sizes(True, "cpu") == (2_000_000, 2, 3)
  assert bw.sizes(False, "cpu") == (20_000_000, 10, 9)
  for quick, rows in (
    (True, len(bw.QUICK)),
    (False, len(bw._rows(False, None))),
  ):
    n, layers, _ = bw.sizes(quick, "gpu")
    assert 40 * n / 3.35e12 > 0.5e-3
    # Params, gradients and AdamW's two moments, float32, per row.
    assert rows * 16 * n < 40e9
    assert bw.sizes(quick, "tpu")[0] == n


def test_fresh_outputs_reuses_the_same_inputs(monkeypatch):
  from scripts import bench_writeback

  seen = {}

  def fake(calls, rounds, repeats):
    seen.update(calls)
    return {name: [1.0] * rounds for name in calls}

  monkeypatch.setattr(bench_writeback, "interleave", fake)
  result = bench_writeback.run(quick=True, cases="^adamw$", donate=False)
  assert "new output buffers" in result.title
  step, args = seen["adamw"]
  assert len(args) == 3  # params, state, gradients, read again each call


def test_cost_reports_xla_bytes_and_flops_per_parameter(tmp_path, capsys):
  # AdamW must read the weight, the gradient and both moments and write
  # back the weight and both moments: 7 float32 arrays, 28 bytes a
  # parameter at least. Moments kept in bfloat16 halve four of those
  # arrays, so that row must access fewer bytes than AdamW does.
  path = tmp_path / "cost.json"
  bench.main(
    ["writeback", "--cost", "--cases", "bf16 stochastic", "--json", str(path)]
  )
  rows = json.loads(path.read_text())["writeback"]
  moments = "adamw, bf16 stochastic moments"
  from scripts.bench_writeback import REGION

  assert list(rows) == ["adamw", "+ nearest", moments, REGION]
  # Donated, XLA copies both bfloat16 moments before overwriting them;
  # with the copies placed by region analysis, neither.
  assert rows[moments]["copies"] == 2 and rows[REGION]["copies"] == 0
  adamw = rows["adamw"]["fresh_bytes_per_param"]
  assert 28 <= adamw <= 48, adamw
  assert rows[moments]["fresh_bytes_per_param"] < adamw
  # Donated, AdamW's step writes every output in place of its input: no
  # leaf-sized copy, the same bytes. A copy only adds bytes.
  assert rows["adamw"]["copies"] == 0
  assert rows["adamw"]["bytes_per_param"] == pytest.approx(adamw)
  for r in rows.values():
    assert r["bytes_per_param"] >= r["fresh_bytes_per_param"] - 1e-6
  # The one-pass floor: AdamW reads 4 float32 arrays and writes 3 (28
  # bytes); with bfloat16 moments 2 of the reads and 2 of the writes
  # halve (20). The step counter adds a few bytes in all.
  assert rows["adamw"]["floor_per_param"] == pytest.approx(28, abs=0.01)
  assert rows[moments]["floor_per_param"] == pytest.approx(20, abs=0.01)
  assert rows["+ nearest"]["flops_per_param"] > rows["adamw"]["flops_per_param"]
  assert all(r["fusions"] >= 1 for r in rows.values())
  assert f"| {moments} |" in capsys.readouterr().out


def _compile_options(monkeypatch) -> list:
  """The compile options of every program the write-back section compiles
  from here on, in order (nothing is timed)."""
  from scripts import bench_writeback as bw

  seen = []
  compiled = bw._compiled

  def recording(*args):
    seen.append(args[-1])
    return compiled(*args)

  monkeypatch.setattr(bw, "_compiled", recording)
  monkeypatch.setattr(
    bw, "interleave", lambda calls, rounds, repeats: {n: [1.0] for n in calls}
  )
  return seen


def test_vector_width_compiles_every_row_with_that_option(monkeypatch):
  from scripts import bench_writeback as bw

  seen = _compile_options(monkeypatch)
  result = bw.run(quick=True, cases="two programs", vector_width=512)
  assert "512-bit vectors" in result.title
  # adamw, + nearest, + stochastic, and the two programs of the k-row.
  assert seen == [{"xla_cpu_prefer_vector_width": 512}] * 5
  seen.clear()
  assert "vectors" not in bw.run(quick=True, cases="^adamw$").title
  assert seen == [None] * 2


def test_the_region_analysis_row_alone_compiles_with_its_option(monkeypatch):
  from scripts import bench_writeback as bw

  seen = _compile_options(monkeypatch)
  result = bw.run(
    quick=False, cases="bf16 stochastic moments", vector_width=512
  )
  names = list(result.times)
  assert names == [
    "adamw",
    "+ nearest",
    "adamw, bf16 stochastic moments",
    bw.REGION,
  ]
  wide = {"xla_cpu_prefer_vector_width": 512}
  region = {
    "xla_cpu_copy_insertion_use_region_analysis": True,
    "xla_gpu_copy_insertion_use_region_analysis": True,
  }
  assert seen == [wide, wide, wide, {**wide, **region}]


def test_region_analysis_copies_keep_the_bf16_moments_bits():
  # The option moves where XLA copies donated buffers, not what it
  # computes: two donated steps of the stored bfloat16 moments (stochastic
  # rounding) give the same params and state bit for bit with and without.
  import jax
  import jax.numpy as jnp
  import numpy as np

  import lowprec
  from scripts import bench_writeback as bw

  tx = bw._rows(False, "bf16 stochastic moments")[bw.REGION]
  params = lowprec.to_grid(bw._params(2 * 96 * 96, 2), "bfloat16")
  grads = jax.tree.map(lambda p: 1e-3 * jnp.sign(p) + 1e-4, params)
  state = tx.init(params)
  out = []
  for options in (None, bw.ROW_OPTIONS[bw.REGION]):
    step, _ = bw._compiled(tx, True, params, state, grads, options)
    p, s = jax.tree.map(jnp.copy, (params, state))
    for _ in range(2):
      p, s = step(p, s, grads)
    out.append(jax.tree.leaves(jax.device_get((p, s))))
  assert len(out[0]) == len(out[1]) > 4
  for a, b in zip(*out, strict=True):
    a, b = np.atleast_1d(a), np.atleast_1d(b)
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
  # The steps moved params and moments: there was something to compare.
  before = jax.tree.leaves(jax.device_get((params, state)))
  moved = [
    np.atleast_1d(x).tobytes() != np.atleast_1d(y).tobytes()
    for x, y in zip(before, out[0], strict=True)
  ]
  assert sum(moved) >= 4


@pytest.mark.parametrize(
  "argv, words",
  [
    (["rounding", "--cases", "x"], "writeback section alone"),
    (["writeback", "--cases", "("], "not a regular expression"),
    (["rounding", "--cost"], "writeback section alone"),
    (["rounding", "--fresh-outputs"], "writeback section alone"),
    (["writeback", "--cost", "--fresh-outputs"], "drop one of the two"),
    (["rounding", "--vector-width", "512"], "timed rows alone"),
    (["writeback", "--cost", "--vector-width", "512"], "do not depend"),
    (["writeback", "--vector-width", "384"], "invalid choice"),
  ],
)
def test_cases_mistakes_are_refused_naming_the_fix(argv, words, capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(argv)
  assert e.value.code == 2 and words in capsys.readouterr().err


def test_same_bits_compares_a_kernel_row_with_its_reference(monkeypatch):
  # The kernel's row (the XLA path on this CPU) and store_state around
  # adamw: equal params after two steps on a 3-leaf tree; a row that
  # rounds its params differently is counted as differing.
  import jax
  import jax.numpy as jnp

  import lowprec
  from scripts import bench_writeback as bw

  params = lowprec.to_grid(bw._params(3 * 64 * 64, 3), "bfloat16")
  grads = jax.tree.map(lambda p: 1e-3 * jnp.sign(p) + 1e-4, params)
  chosen = bw._rows(False, "companded8/sqrt8")
  same = bw.same_bits(chosen, params, grads)
  n = sum(p.size for p in jax.tree.leaves(params))
  assert same == {
    bw.KERNEL: {"reference": bw.SAME_BITS[bw.KERNEL], "differing": 0, "of": n}
  }
  monkeypatch.setattr(bw, "SAME_BITS", {"+ nearest": "adamw"})
  (other,) = bw.same_bits(bw._rows(False, None), params, grads).values()
  assert 0 < other["differing"] <= other["of"] == n


def test_a_kernel_row_that_does_not_compile_is_reported_not_fatal(
  monkeypatch,
):
  # A kernel row whose step fails to compile (as a Triton kernel might on
  # a GPU it was never run on): the section still times every other row,
  # and its notes and JSON say which row failed and why. Any other row's
  # failure still stops the run.
  from scripts import bench_writeback as bw

  compiled = bw._compiled

  def fails_for_kernels(opt, *args, **kwargs):
    if opt is chosen[bw.KERNEL]:
      raise RuntimeError("triton: no such instruction\nmore")
    return compiled(opt, *args, **kwargs)

  chosen = bw._rows(True, "companded")
  monkeypatch.setattr(bw, "_rows", lambda quick, cases: chosen)
  monkeypatch.setattr(bw, "_compiled", fails_for_kernels)
  monkeypatch.setattr(bw, "sizes", lambda quick, platform: (64 * 64, 1, 1))
  result = bw.run(True, "companded")
  assert bw.KERNEL not in result.times
  assert "adamw, companded8/sqrt8 block32 moments" in result.times
  assert result.extra["failed"] == {
    bw.KERNEL: "RuntimeError: triton: no such instruction"
  }
  assert result.notes == (
    f"{bw.KERNEL}: not timed, its step did not compile (RuntimeError: "
    "triton: no such instruction)",
  )
  monkeypatch.setattr(bw, "SAME_BITS", {})
  with pytest.raises(RuntimeError, match="no such instruction"):
    bw.run(True, "companded")
