"""Write-back step cost: `optax.adamw` alone vs adamw + `lowprec.writeback`.

One jitted optimizer step (update and `optax.apply_updates`) on a pytree of
20M float32 parameters: ten square matrices and their biases. With
--quick, 2M parameters in two matrices and the rows of `QUICK` only: each
row is a program to compile, longer with every leaf, and the full set on
ten matrices did not finish in 55 s on an H200. On an accelerator the
trees are larger (`sizes`: 72M, and 64M with --quick), so that a step
times memory rather than kernel launches. Write-back params are
float32 holding bfloat16 grid values. Rows: nearest, stochastic and
dead-zone write-back, each with telemetry on and off, and stochastic
with telemetry every 10th update (`telemetry=10`), alone, with the
chain run by `lowprec.counted_in_branches`, and as
`lowprec.counted_and_uncounted`'s two programs (the mean of k updates,
every 10th and every 20th counted; these rows are also compared with
stochastic write-back without telemetry); the compensated
write-backs (Kahan with a bfloat16 buffer, two-component, remainder, split
weights with an int8 correction) and ECO
(`lowprec.eco` around adamw, nearest) without telemetry; and AdamW with
its moments stored (`lowprec.store_state`, no telemetry) in bfloat16 by
stochastic rounding, and as PyTorch's 8- and 4-bit optimizers store them
(docs/state.md): bitsandbytes' dynamic maps and torchao's amax e4m3 with
a scale per 256 (and the same blocks with power-of-two scales,
lowprec's default), FlashOptim's companded and square-root maps per 32, and
torchao's 4-bit maps per 128, and the bfloat16 moments again compiled
with XLA:CPU's region-analysis copy placement (`ROW_OPTIONS`); and
the companded, dynamic, amax e4m3 and 4-bit moments again by
`lowprec.scale_by_stored_adam` (one kernel a leaf on one GPU, the XLA
path elsewhere), each checked bit for bit against its `store_state` row
after the timing (`SAME_BITS`); and the q8 state recipe (the frontier
study's: dynamic maps per 256, stochastic rounding) by that transform
with and without the kernel, the two checked against each other; and
nearest and stochastic write-back with telemetry by
`lowprec.writeback(kernel="auto")` (one kernel a leaf on one GPU),
each checked against its row on the XLA path; and the q8 moments with
bf16 SR write-back and telemetry (the frontier study's recipe whole) by
`lowprec.stored_adamw_writeback` with and without its one kernel a leaf,
the two checked against each other. Ratios are
to plain adamw and to nearest
write-back without telemetry (`+ nearest`), the row ECO and the
compensated write-backs replace. Targets: stochastic with telemetry at
most 1.3x the plain adamw step; Kahan and two-component at most 1.25x
nearest write-back without telemetry; bf16 stochastic moments at most
1.3x plain adamw.

Each step donates its params and state, and the next call runs on what
it returned, as a training loop does (`run(donate=False)`, `--fresh-
outputs`: every call reads the same inputs and writes new buffers, which
on a CPU also reads each written line first; plain AdamW is about 1.5x
slower that way, the arithmetic-bound recipes hardly, so ratios to it
shrink).

The cases run in interleaved rounds; ratios are medians of same-round
ratios, with their range, so load from other processes on a shared machine
biases all rows alike. Beside the ratios, each row's bytes a parameter as
XLA's cost analysis counts them for the very program timed (compiled
ahead of time, so nothing compiles twice), and the rate at which the
median step moved them: a row near the machine's memory speed is bound by
its bytes, a row well below it by its arithmetic or its launches.
"""

from __future__ import annotations

import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowprec
from scripts.benchlib import Result, interleave

E4M3_AMAX = "float8_e4m3fn:nearest:block256:amax"
E4M3_POW2 = "float8_e4m3fn:nearest:block256"
# row name -> (mu, nu) as lowprec.store_state stores them
MOMENTS = {
  "bf16 stochastic": ("bfloat16:stochastic", "bfloat16:stochastic"),
  "dynamic8/dynamic8u block256": ("dynamic8:block256", "dynamic8u:block256"),
  "amax e4m3 block256": (E4M3_AMAX, E4M3_AMAX),
  "e4m3 block256, power-of-two scales": (E4M3_POW2, E4M3_POW2),
  "companded8/sqrt8 block32": ("companded8:block32", "sqrt8:block32"),
  "4-bit": ("dynamic4:block128", "uint4nz:block128"),
}


# Counts every 10th update; timed on an update it does not count (the
# state's count is 1), so the mean over ten updates is this row plus a
# tenth of the counting one.
EVERY = "+ stochastic + telemetry every 10, uncounted update"
# The same chain run by lowprec.counted_in_branches (the whole chain in a
# counted and an uncounted program), timed on an uncounted update too.
BRANCHES = "+ stochastic + telemetry every 10 in branches, uncounted update"
# The same chain as lowprec.counted_and_uncounted's two programs, picked
# per update outside the compiled step: k updates a call (the counted
# program once, the uncounted one k - 1 times), the time divided by k.
PROGRAMS = "+ stochastic + telemetry every 10, two programs, mean of 10 updates"
PROGRAMS_20 = (
  "+ stochastic + telemetry every 20, two programs, mean of 20 updates"
)
# row -> k
EVERY_K = {PROGRAMS: 10, PROGRAMS_20: 20}
# Rows of telemetry every k updates, also compared with the write-back
# without telemetry (the target: at most 1.1x it).
WITHOUT = "+ stochastic"

# AdamW with the companded, dynamic, amax e4m3 and 4-bit moments as
# `lowprec.scale_by_stored_adam` chains it: one kernel a leaf on one GPU,
# the XLA path elsewhere (on a CPU the same arithmetic as the row of
# `store_state` around adamw).
KERNEL = "adamw, companded8/sqrt8 block32 moments, scale_by_stored_adam"
KERNEL_8BIT = "adamw, dynamic8/dynamic8u block256 moments, scale_by_stored_adam"
KERNEL_FP8 = "adamw, amax e4m3 block256 moments, scale_by_stored_adam"
KERNEL_4BIT = "adamw, 4-bit moments, scale_by_stored_adam"
# The q8 state recipe (the frontier study's 8-bit moments: dynamic8 and
# dynamic8u, blocks of 256, stochastic rounding) by the kernel, and by
# the same transform on the XLA path: a store inside AdamW's chain folds
# its key by other paths than `store_state` around adamw, so its bits are
# checked against its own XLA twin.
Q8 = ("dynamic8:stochastic:block256", "dynamic8u:stochastic:block256")
KERNEL_Q8 = "adamw, q8 moments (stochastic dynamic8), scale_by_stored_adam"
XLA_Q8 = "adamw, q8 moments (stochastic dynamic8), XLA path"
# The write-back with telemetry by `lowprec.writeback(kernel="auto")`: one
# kernel a leaf on one GPU (the weights and proposals read once, the
# counts taken as the deltas are written), the XLA path elsewhere.
KERNEL_WB = "+ stochastic + telemetry, one kernel a leaf"
KERNEL_WB_NEAREST = "+ nearest + telemetry, one kernel a leaf"
# The frontier study's recipe whole: q8 moments and bf16 SR weights with
# telemetry, as the chain on the XLA path and by
# `lowprec.stored_adamw_writeback` (AdamW, the moments and the write-back
# in one kernel a leaf on one GPU, the chain elsewhere).
APPLY_XLA = "adamw, q8 moments + SR write-back + telemetry, XLA path"
APPLY_KERNEL = (
  "adamw, q8 moments + SR write-back + telemetry, one kernel a leaf"
)
# row -> the row whose params it must equal bit for bit after `SAME_STEPS`
# steps from the same inputs (checked after the timing, reported in the
# notes and the JSON's `same_bits`).
SAME_BITS = {
  KERNEL: "adamw, companded8/sqrt8 block32 moments",
  KERNEL_8BIT: "adamw, dynamic8/dynamic8u block256 moments",
  KERNEL_FP8: "adamw, amax e4m3 block256 moments",
  KERNEL_4BIT: "adamw, 4-bit moments",
  KERNEL_Q8: XLA_Q8,
  KERNEL_WB: "+ stochastic + telemetry",
  KERNEL_WB_NEAREST: "+ nearest + telemetry",
  APPLY_KERNEL: APPLY_XLA,
}
SAME_STEPS = 2

# Rows compiled with XLA options of their own: the bfloat16 moments with
# the copies of donated buffers placed by the finer analysis, which on
# XLA:CPU removes the copies of both moments (and slows the compensated
# write-backs, so it is given to this program only). XLA:GPU has a switch
# of its own for the same pass; each compiler ignores the other's.
REGION = "adamw, bf16 stochastic moments, copies placed by region analysis"
ROW_OPTIONS = {
  REGION: {
    "xla_cpu_copy_insertion_use_region_analysis": True,
    "xla_gpu_copy_insertion_use_region_analysis": True,
  }
}


def _options(name: str, options: dict | None = None) -> dict | None:
  """The compile options of row `name`: `options` (the run's), and the
  row's own (`ROW_OPTIONS`) over them; None where there are none."""
  return {**(options or {}), **ROW_OPTIONS.get(name, {})} or None


# The columns `run` adds beside the ratios (from the compiled step's cost
# analysis; bytes over the median time).
BYTES = "XLA bytes / param"
RATE = "GB/s"

# The rows of --quick: both baselines, a rounding with and without
# telemetry and with it every 10th update as two programs, a compensated
# write-back of each kind of state, ECO, and the moments stored in 16
# bits (also with the copies placed by region analysis) and in each kind
# of 8- and 4-bit map (each a target of its own on an accelerator; the
# dynamic maps as the q8 recipe rounds them, stochastically), each by
# the XLA path and by the kernel; and the q8 moments with bf16 SR
# weights and telemetry, by the chain and by one kernel a leaf.
QUICK = (
  "adamw",
  "+ nearest",
  "+ stochastic",
  "+ stochastic + telemetry",
  PROGRAMS,
  "+ kahan (bf16 buffer)",
  "+ split (8-bit correction)",
  "+ eco (nearest)",
  "adamw, bf16 stochastic moments",
  XLA_Q8,
  KERNEL_Q8,
  APPLY_XLA,
  APPLY_KERNEL,
  "adamw, amax e4m3 block256 moments",
  KERNEL_FP8,
  "adamw, companded8/sqrt8 block32 moments",
  KERNEL,
  "adamw, 4-bit moments",
  KERNEL_4BIT,
)


def _stored_adamw(mu, nu, kernel="auto", key=None):
  """adamw (its defaults) with `scale_by_stored_adam` in place of
  `scale_by_adam`."""
  return optax.chain(
    lowprec.scale_by_stored_adam(mu=mu, nu=nu, kernel=kernel, key=key),
    optax.add_decayed_weights(1e-4),  # adamw's default decay
    optax.scale_by_learning_rate(1e-3),
  )


def sizes(quick: bool, platform: str) -> tuple[int, int, int]:
  """`(parameters, square matrices, rounds)` of a run on `platform`.

  On a CPU, 20M parameters in ten matrices (2M in two with `quick`). On
  an accelerator, 72M in ten (64M in two): a step of 20M parameters
  there moves 800 MB, a quarter of a millisecond at 3.35 TB/s, and would
  time kernel launches rather than memory, while the time to compile a
  step does not grow with its leaves' size. Every row holds its own
  params and state, so 72M (about 1.2 GB a row, 33 rows) is what an
  80 GB card holds with room for the steps' temporaries.
  """
  if platform == "cpu":
    return (2_000_000, 2, 3) if quick else (20_000_000, 10, 9)
  return (64_000_000, 2, 3) if quick else (72_000_000, 10, 9)


def _params(n_params: int, layers: int) -> dict:
  # A whole number of blocks of 32 a row, as the kernel of
  # `scale_by_stored_adam` takes them (and a model's widths are).
  side = int((n_params / layers) ** 0.5) // 32 * 32
  keys = jax.random.split(jax.random.key(0), layers)
  return {
    f"layer{i}": {
      "kernel": 0.02 * jax.random.normal(k, (side, side)),
      "bias": jnp.zeros((side,)),
    }
    for i, k in enumerate(keys)
  }


def _step(opt, donate: bool = False):
  """The jitted step; with `donate`, its params and state are donated, as
  a training loop's step donates them (`experiments/train.py`)."""

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def _compiled(opt, donate, params, state, grads, options=None):
  """The row's step compiled ahead of time for these inputs (with XLA
  compile `options`, if any), and the bytes XLA's cost analysis says one
  call accesses (the program timed is the program analysed: no second
  compile)."""
  lowered = _step(opt, donate).lower(params, state, grads)
  compiled = lowered.compile(compiler_options=options or None)
  return compiled, float(_analysis(compiled)["bytes accessed"])


def _carried(step, params, state, grads, count=None):
  """`(fn, ())`: each call of `fn` runs `step` (donating; one update or
  several) on the params and state the call before returned, as a
  training loop does (its own copies, so that no other row's buffers are
  donated). With `count`, each returned state's count is set back to it:
  every call is then the same update (one that a row counting every k-th
  update does not count)."""
  held = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state)]

  def call():
    p, s = step(*held, grads)
    if count is not None:
      s = _with_count(s, jnp.asarray(count))
    held[:] = p, s
    return p, s

  return call, ()


def _every_k(k: int):
  """adamw + stochastic write-back counting every k-th update."""
  return optax.chain(
    optax.adamw(1e-3),
    lowprec.writeback(
      "bfloat16", "stochastic", key=jax.random.key(1), telemetry=k
    ),
  )


def _count_of(state):
  """The update count of a state counting every k-th update: the
  chain's `(inner, writeback)` pair's write-back, or the state of
  `lowprec.counted_in_branches` (which carries the count itself)."""
  return state.count if hasattr(state, "_replace") else state[1].count


def _with_count(state, count):
  """`state` (as `_count_of` reads it) with its count replaced."""
  if hasattr(state, "_replace"):
    return state._replace(count=count)
  inner, wb = state
  return inner, wb._replace(count=count)


def _uncounted(state):
  """A state counting every k-th update at an update it does not count
  (its count 1)."""
  return _with_count(state, _count_of(state) + 1)


def _k_updates(k: int, params, grads, donate: bool = False, options=None):
  """`(fn, args, bytes)` timing k updates of `_every_k(k)` as
  `lowprec.counted_and_uncounted` runs them: the counted program on a
  due update (count 0), the uncounted one on k - 1 that are not (count
  1), each from the same inputs; with `donate`, k consecutive updates of
  a training loop, each on the last one's donated params and state (the
  counted program on the first, whose count is a multiple of k).
  `bytes`: XLA's bytes accessed, the mean of the k updates."""
  pair = lowprec.counted_and_uncounted(_every_k(k))
  due = pair.counted.init(params)
  counted, counted_bytes = _compiled(
    pair.counted, donate, params, due, grads, options
  )
  uncounted, uncounted_bytes = _compiled(
    pair.uncounted, donate, params, due, grads, options
  )
  mean_bytes = (counted_bytes + (k - 1) * uncounted_bytes) / k
  if donate:

    def k_steps(params, state, grads):
      params, state = counted(params, state, grads)
      for _ in range(k - 1):
        params, state = uncounted(params, state, grads)
      return params, state

    return (*_carried(k_steps, params, due, grads), mean_bytes)

  def updates(params, due, later, grads):
    out = counted(params, due, grads)
    for _ in range(k - 1):
      out = uncounted(params, later, grads)
    return out

  return updates, (params, due, _uncounted(due), grads), mean_bytes


def _rows(quick: bool, cases: str | None) -> dict:
  """The rows' optimizers by name, in order: those of --quick where
  `quick`, then those matching the regular expression `cases` (and the
  baselines) where given."""
  adamw = optax.adamw(1e-3)
  chosen = {"adamw": adamw}
  for rounding in ("nearest", "stochastic", "deadzone"):
    for on in (True, False):
      wb = lowprec.writeback(
        "bfloat16", rounding, key=jax.random.key(1), telemetry=on
      )
      name = f"+ {rounding}" + (" + telemetry" if on else "")
      chosen[name] = optax.chain(adamw, wb)
  for name, rounding in (
    (KERNEL_WB, "stochastic"),
    (KERNEL_WB_NEAREST, "nearest"),
  ):
    wb = lowprec.writeback(
      "bfloat16", rounding, key=jax.random.key(1), kernel="auto"
    )
    chosen[name] = optax.chain(adamw, wb)
  chosen[EVERY] = _every_k(10)
  chosen[BRANCHES] = lowprec.counted_in_branches(chosen[EVERY])
  for name, k in EVERY_K.items():
    chosen[name] = _every_k(k)  # timed by _k_updates
  key = jax.random.key(2)
  chosen["+ kahan (bf16 buffer)"] = optax.chain(
    adamw, lowprec.kahan_writeback("bfloat16", telemetry=False)
  )
  chosen["+ two-component"] = optax.chain(
    adamw, lowprec.two_component_writeback("bfloat16", telemetry=False)
  )
  chosen["+ remainder"] = optax.chain(
    adamw, lowprec.remainder_writeback("bfloat16", telemetry=False)
  )
  chosen["+ split (8-bit correction)"] = optax.chain(
    adamw, lowprec.split_writeback("bfloat16", 8, telemetry=False)
  )
  # In place of the chain: adamw inside, as `+ nearest` has it before.
  chosen["+ eco (nearest)"] = lowprec.eco(
    adamw, "bfloat16", "nearest", telemetry=False
  )
  for name, (mu, nu) in MOMENTS.items():
    chosen[f"adamw, {name} moments"] = lowprec.store_state(
      adamw, {"mu": mu, "nu": nu}, key=key, telemetry=False
    )
  chosen[REGION] = chosen["adamw, bf16 stochastic moments"]
  for name, (mu, nu) in (
    (KERNEL, MOMENTS["companded8/sqrt8 block32"]),
    (KERNEL_8BIT, MOMENTS["dynamic8/dynamic8u block256"]),
    (KERNEL_FP8, MOMENTS["amax e4m3 block256"]),
    (KERNEL_4BIT, MOMENTS["4-bit"]),
  ):
    chosen[name] = _stored_adamw(mu, nu)
  for name, kernel in ((KERNEL_Q8, "auto"), (XLA_Q8, "xla")):
    chosen[name] = _stored_adamw(*Q8, kernel=kernel, key=key)
  for name, kernel in ((APPLY_KERNEL, "auto"), (APPLY_XLA, "xla")):
    chosen[name] = lowprec.stored_adamw_writeback(
      1e-3,
      "bfloat16",
      "stochastic",
      mu=Q8[0],
      nu=Q8[1],
      weight_decay=1e-4,
      key=key,
      kernel=kernel,
    )
  if quick:
    chosen = {name: chosen[name] for name in QUICK}
  if cases is not None:
    kept = ("adamw", "+ nearest")
    if any(re.search(cases, name) and "every" in name for name in chosen):
      kept += (WITHOUT,)
    chosen = {
      name: opt
      for name, opt in chosen.items()
      if name in kept or re.search(cases, name)
    }
  return chosen


def run(
  quick: bool,
  cases: str | None = None,
  donate: bool = True,
  vector_width: int | None = None,
) -> Result:
  """Times the rows (those matching the regular expression `cases`, and
  both baselines, where given). With `donate` (the default), each step
  donates its params and state and the next runs on what it returned,
  as a training loop runs; without, every call reads the same inputs
  and writes new buffers. `vector_width`: XLA:CPU's preferred vector
  width in bits for every row's compile (its default where None). The
  result's columns: XLA's bytes accessed a parameter per update
  (`BYTES`) and GB/s at the median time (`RATE`)."""
  options = (
    None
    if vector_width is None
    else {"xla_cpu_prefer_vector_width": vector_width}
  )
  n_params, layers, rounds = sizes(quick, jax.devices()[0].platform)
  params = lowprec.to_grid(_params(n_params, layers), "bfloat16")
  grads = jax.tree.map(lambda p: 1e-3 * jnp.sign(p) + 1e-4, params)
  count = sum(p.size for p in jax.tree.leaves(params))
  chosen = _rows(quick, cases)
  calls, accessed, failed = {}, {}, {}
  for name, opt in chosen.items():
    if name in EVERY_K:
      *calls[name], accessed[name] = _k_updates(
        EVERY_K[name], params, grads, donate, _options(name, options)
      )
      continue
    state = opt.init(params)
    stays = name in (EVERY, BRANCHES)  # timed on an update it does not count
    if stays:
      state = _uncounted(state)
    try:
      step, accessed[name] = _compiled(
        opt, donate, params, state, grads, _options(name, options)
      )
    except Exception as e:  # noqa: BLE001 (reported; the others timed)
      if name not in SAME_BITS:
        raise
      # A kernel row whose kernel does not compile here: said in the
      # notes, and every other row still timed.
      failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
      continue
    if not donate:
      calls[name] = step, (params, state, grads)
      continue
    again = np.asarray(_count_of(state)) if stays else None
    calls[name] = _carried(step, params, state, grads, again)
  times = interleave(calls, rounds=rounds, repeats=3)
  for name, k in EVERY_K.items():
    if name in times:
      times[name] = [t / k for t in times[name]]
  # What XLA says each step reads and writes, and at what rate the timed
  # step then moved it: at the machine's memory speed, a step is bound by
  # its bytes.
  columns = {
    BYTES: {name: b / count for name, b in accessed.items()},
    RATE: {
      name: accessed[name] / statistics.median(times[name]) / 1e9
      for name in times
    },
  }
  title = (
    f"write-back step, {count / 1e6:.1f}M params, "
    f"{jax.devices()[0].platform} x{jax.device_count()}, "
    + ("params and state donated" if donate else "new output buffers")
    + ("" if vector_width is None else f", {vector_width}-bit vectors")
  )
  baselines = ("adamw", "+ nearest")
  if WITHOUT in times and any("every" in name for name in times):
    baselines += (WITHOUT,)
  timed = {n: o for n, o in chosen.items() if n not in failed}
  same = same_bits(timed, params, grads)
  notes = tuple(
    f"{name}: not timed, its step did not compile ({error[:300]})"
    for name, error in failed.items()
  ) + tuple(
    f"{name}: params after {SAME_STEPS} steps "
    + (
      "equal to"
      if s["differing"] == 0
      else f"differ in {s['differing']} of {s['of']} from"
    )
    + f" `{s['reference']}`'s bit for bit"
    for name, s in same.items()
  )
  return Result(
    title,
    times,
    baselines,
    notes=notes,
    extra={
      **({"same_bits": same} if same else {}),
      **({"failed": failed} if failed else {}),
    },
    columns=columns,
  )


def same_bits(chosen: dict, params, grads) -> dict:
  """`{row: {"reference", "differing", "of"}}` for each row of
  `SAME_BITS` in `chosen` with its reference: the params after
  `SAME_STEPS` steps of each from the same inputs, compared bit for bit
  (`differing` of `of` elements)."""
  out = {}
  for name, reference in SAME_BITS.items():
    if name not in chosen or reference not in chosen:
      continue
    ends = []
    for row in (name, reference):
      step = _step(chosen[row])
      p, state = params, chosen[row].init(params)
      for _ in range(SAME_STEPS):
        p, state = step(p, state, grads)
      ends.append(jax.tree.leaves(p))
    pairs = list(zip(*ends, strict=True))
    differing = sum(int(np.sum(_words(a) != _words(b))) for a, b in pairs)
    of = sum(int(np.size(a)) for a, _ in pairs)
    out[name] = {"reference": reference, "differing": differing, "of": of}
  return out


def _words(x) -> np.ndarray:
  """An array's elements as unsigned integers of their width (NaN
  payloads and signed zeros compared as bits)."""
  a = np.asarray(x)
  return a.view(f"u{a.dtype.itemsize}")


# The leaf `cost` compiles each row's step on.
COST_SHAPE = (1024, 1024)


def cost(cases: str | None = None) -> tuple[str, dict]:
  """XLA's own account of each row's compiled step on one `COST_SHAPE`
  leaf, without running it: its fusions, and the bytes accessed and
  flops of its cost analysis per parameter, for the step as `run` times
  it (params and state donated) and, beside it, the bytes of the same
  step writing new buffers; where XLA copies a donated leaf-sized
  state array before overwriting it in place, the copies. On a GPU,
  where the step is bound by memory, the bytes set its time; on this CPU
  the flops weigh too. Beside them, the floor a one-pass kernel would
  touch: the params, gradients and state read once, the params and
  state written once (the bytes of the arrays themselves). Rows
  counting every k-th update are compiled as they are timed: their step
  on an update they do not count. Returns a Markdown table and `{row:
  {"fusions", "bytes_per_param", "fresh_bytes_per_param", "copies",
  "floor_per_param", "flops_per_param"}}`."""
  key = jax.random.key(0)
  params = lowprec.to_grid(
    {"kernel": 0.02 * jax.random.normal(key, COST_SHAPE)}, "bfloat16"
  )
  grads = jax.tree.map(lambda p: 1e-3 * jnp.sign(p) + 1e-4, params)
  n = params["kernel"].size
  leaf = re.compile(rf"= \w+\[{COST_SHAPE[0]},{COST_SHAPE[1]}\]\S* copy\(")
  out = {}
  for name, opt in _rows(False, cases).items():
    tx = (
      lowprec.counted_and_uncounted(opt).uncounted if name in EVERY_K else opt
    )
    state = tx.init(params)
    if name in (EVERY, BRANCHES, *EVERY_K):
      state = _uncounted(state)
    donated, fresh = (
      _step(tx, donate)
      .lower(params, state, grads)
      .compile(compiler_options=_options(name))
      for donate in (True, False)
    )
    analysis, fresh_analysis = (_analysis(c) for c in (donated, fresh))
    # Params and state read and written, gradients read.
    held = lowprec.bytes_per_param(params, state)
    grad = lowprec.bytes_per_param(grads).params
    text = donated.as_text()
    out[name] = {
      "fusions": len(re.findall(r" fusion\(", text)),
      "bytes_per_param": float(analysis["bytes accessed"]) / n,
      "fresh_bytes_per_param": float(fresh_analysis["bytes accessed"]) / n,
      "copies": len(leaf.findall(text)),
      "floor_per_param": 2 * (held.total + held.fixed / n) + grad,
      "flops_per_param": float(analysis["flops"]) / n,
    }
  base = out["adamw"]["bytes_per_param"]
  lines = [
    f"### write-back step, XLA's cost analysis, one {COST_SHAPE[0]} x "
    f"{COST_SHAPE[1]} leaf, {jax.devices()[0].platform}, params and state "
    "donated",
    "",
    "| case | fusions | bytes / param | to adamw | with new buffers | "
    "leaf copies | one-pass floor | to the floor | flops / param |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name, c in out.items():
    b, floor = c["bytes_per_param"], c["floor_per_param"]
    lines.append(
      f"| {name} | {c['fusions']} | {b:.1f} | {b / base:.2f}x | "
      f"{c['fresh_bytes_per_param']:.1f} | {c['copies']} | "
      f"{floor:.1f} | {b / floor:.2f}x | {c['flops_per_param']:.0f} |"
    )
  return "\n".join(lines), out


def _analysis(compiled) -> dict:
  analysis = compiled.cost_analysis()
  if isinstance(analysis, list | tuple):  # older jaxlibs: one per program
    analysis = analysis[0]
  return analysis
