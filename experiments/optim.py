"""The optax chain of a run, built from the config's `opt` and `lowprec`.

`build` (and `parts`, the same chain named by config key) is the entry the
runner calls: the clip (`clip_by_global_norm`, summed in a fixed order),
the optimizer (`OPTIMIZERS`, on a schedule of `SCHEDULES`), then the
write-back a `lowprec.compensation` picks (`WRITEBACKS`, `WRAPPERS`) and
the float32 run's traces. The `lowprec` keys are read into the library's
arguments by `lowprec_config`; `has_telemetry` and `nonfinite_step` say
what the chain's telemetry holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import lowprec
from experiments import lowprec_config
from lowprec.engine import leafwise, stacked
from lowprec.engine.rules import path_name
from lowprec.optim import writeback_kernel


def _constant(opt, warmup: int, steps: int) -> optax.Schedule:
  del steps
  if warmup == 0:
    return optax.constant_schedule(opt.lr)
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, opt.lr, warmup),
      optax.constant_schedule(opt.lr),
    ],
    [warmup],
  )


def _cosine(opt, warmup: int, steps: int) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0 if warmup else opt.lr,
    peak_value=opt.lr,
    warmup_steps=warmup,
    decay_steps=max(steps, warmup + 1),
    end_value=opt.lr * opt.min_lr_ratio,
  )


# opt.schedule -> (opt, warmup steps, run steps) -> schedule
SCHEDULES = {"cosine": _cosine, "constant": _constant}


def schedule(opt, steps: int) -> optax.Schedule:
  """Linear warmup, then cosine decay to `min_lr_ratio * lr` (or constant).

  `opt.schedule` must be a key of `SCHEDULES` (`study.validate` checks it).
  """
  warmup = min(opt.warmup_steps, max(steps - 1, 0))
  return SCHEDULES[opt.schedule](opt, warmup, steps)


def _adamw(opt, lr) -> optax.GradientTransformation:
  return optax.adamw(
    lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay
  )


def _sgd(opt, lr) -> optax.GradientTransformation:
  return optax.sgd(lr, momentum=opt.momentum or None)


# opt.name -> (opt, learning-rate schedule) -> the optimizer
OPTIMIZERS = {"adamw": _adamw, "sgd": _sgd}


def _pairwise_sum(v: jax.Array) -> jax.Array:
  """Sum of a 1-D array in a fixed tree: the array zero-padded to a power
  of two, halves added until one is left.

  The padding is never written: the first halving adds the zeros to the
  part of the second half that is missing, in the same fusion (a padded
  copy of the largest leaf was a quarter of a gigabyte at 124M).
  """
  if v.size == 0:
    return jnp.zeros([], v.dtype)
  while v.size > 1:
    half = 1 << ((v.size - 1).bit_length() - 1)  # largest power of 2 < size
    v = v[:half] + jnp.pad(v[half:], (0, 2 * half - v.size))
  return v[0]


def global_norm(tree) -> jax.Array:
  """`optax.tree.norm`, summed in a fixed order.

  XLA's reductions sum in an order that depends on the program around them
  (fusion, the number of devices), so the same gradient can have norms a
  rounding apart on 1 and 8 devices, and clipping by them gives different
  parameters. Adding halves of zero-padded vectors (each leaf, then the
  leaves' sums) fixes the order: the same bits on any device count.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not flat:
    return jnp.float32(0)
  names = [path_name(p) for p, _ in flat]
  where = tuple(range(len(flat)))
  if any(stacked.layer_names(n) for n in names):
    # A leaf of stacked layers (model.layer_storage) gives each layer's
    # sum, added in the order of the layers stored apart: the same norm,
    # bit for bit.
    apart = jax.eval_shape(stacked.unstack, tree)
    flat_apart = jax.tree_util.tree_flatten_with_path(apart)[0]
    where = stacked.apart_index(names, [path_name(p) for p, _ in flat_apart])

  def row(a, x):
    x = x.astype(jnp.float32)
    return (x.reshape(len(a), -1) if isinstance(a, tuple) else jnp.ravel(x),)

  rows = [row(a, x) for a, (_, x) in zip(where, flat, strict=True)]
  # Leaves of one shape are squared and summed stacked, and the sums come
  # back as one vector: one program per kind of leaf, none per leaf.
  sums = leafwise.grouped_apart(
    lambda _, v: _pairwise_sum(jnp.square(v)), rows, None, where
  )
  return jnp.sqrt(_pairwise_sum(sums))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` with the fixed-order `global_norm`."""

  def update(updates, state, params=None):
    del params
    g_norm = global_norm(updates)
    trigger = g_norm < max_norm

    # One scalar factor, then a product: XLA may turn a division by a
    # broadcast scalar into a multiplication by its reciprocal in one
    # program and not in another.
    scale = (max_norm / g_norm).astype(jnp.float32)

    def clip(t):
      return jax.lax.select(trigger, t, (t * scale).astype(t.dtype))

    return jax.tree.map(clip, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _plain(lp, target, key):
  # A config.json written before the key existed reads "recompute".
  scales = lp.get("writeback_scales", "recompute")
  return lowprec.writeback(
    target,
    lp.rounding,
    key=key,
    overflow=lp.overflow,
    scales=scales,
    kernel=lp.get("writeback_kernel", "xla"),
  )


def _kahan(lp, target, key):
  return lowprec.kahan_writeback(
    target,
    lp.rounding,
    buffer=lp.get("buffer", lowprec_config.DEFAULT_BUFFER),
    key=key,
    overflow=lp.overflow,
  )


def _two_component(lp, target, key):
  return lowprec.two_component_writeback(
    target, lp.rounding, key=key, overflow=lp.overflow
  )


def _remainder(lp, target, key):
  del key
  if lp.rounding != "nearest":
    raise ValueError(
      "lowprec.compensation='remainder' rebuilds an exact float32 master "
      f"and rounds nothing: set lowprec.rounding='nearest' (got "
      f"{lp.rounding!r})"
    )
  return lowprec.remainder_writeback(target)


def _split(lp, target, key):
  del key
  if lp.rounding != "nearest":
    raise ValueError(
      "lowprec.compensation='split' keeps the value a bfloat16 weight and "
      "its correction stand for, and rounds it to nearest: set "
      f"lowprec.rounding='nearest' (got {lp.rounding!r})"
    )
  bits = lp.get("correction_bits", lowprec_config.DEFAULT_CORRECTION_BITS)
  return lowprec.split_writeback(target, correction_bits=bits)


# lowprec.compensation -> (lowprec section, grid target, key) -> the
# write-back, placed after the optimizer. A config.json written before the
# key existed reads "none".
WRITEBACKS = {
  "none": _plain,
  "kahan": _kahan,
  "two_component": _two_component,
  "remainder": _remainder,
  "split": _split,
}


def _eco(lp, target, key, optimizer):
  return lowprec.eco(
    optimizer, target, lp.rounding, key=key, overflow=lp.overflow
  )


# lowprec.compensation -> (lowprec section, grid target, key, optimizer) ->
# the optimizer and its write-back in one transform: the compensations
# that fold the rounding error into the optimizer's own state.
WRAPPERS = {"eco": _eco}

# Every lowprec.compensation.
COMPENSATIONS = {**WRITEBACKS, **WRAPPERS}

# lowprec.state_kernel: "none" (store_state around the optimizer) or a
# `lowprec.scale_by_stored_adam` kernel choice (`stored_adamw`).
STATE_KERNELS = ("none", "auto", "pallas", "xla")
# lowprec.writeback_kernel: `lowprec.writeback(kernel=)` of the plain
# write-back (lowprec.compensation="none").
WRITEBACK_KERNELS = writeback_kernel.KERNELS


def build(config, key: jax.Array, params=None) -> optax.GradientTransformation:
  """clip -> AdamW/SGD -> write-back (low precision) or traces (float32).

  With `lowprec.state` the optimizer's state is stored in low precision
  (`lowprec.store_state` around AdamW/SGD; state paths such as `0/mu/...`).
  The write-back is `lowprec.writeback`, or a compensated one picked by
  `lowprec.compensation` ("kahan" with `lowprec.buffer`, "two_component",
  "remainder", "split" with `lowprec.correction_bits`; see `WRITEBACKS`).
  "eco" (`WRAPPERS`) takes the optimizer inside instead:

    clip -> [store_state] eco(AdamW/SGD, grid) -> traces

  `lowprec.eco` runs the optimizer (its schedule, bias correction and
  decoupled weight decay included) in float32, writes the update onto the
  grid and folds the rounding error into the first moment. Clipping acts
  on the gradients before the optimizer, so the update stays elementwise
  in the moment, as the fold assumes. A stored state wraps eco, so the
  moment is stored after the fold (state paths `inner/0/mu/...`): the
  store rounds the fold with the moment, which stochastic rounding keeps
  in expectation and nearest rounding drops where it is below half the
  moment's gap, so a rule that stores a first moment under eco must round
  stochastically (`lowprec.store_state` refuses it otherwise, at `init`).

  A float32 run predicts nearest write-back with `lowprec.trace_targets`
  (`reference_trace`) and the compensated ones with
  `lowprec.trace_remedies` (`compensated_trace`).

  `params` (the initial parameters) are needed only for per-tensor `intK`
  scales (`lowprec_config.needs_params`). The config's names (`opt.name`,
  `opt.schedule`, `lowprec.rounding`, ...) are checked by `study.validate`,
  and the chain is built on the model's abstract parameters
  (`config_checks.check_build`), before a run directory is touched.
  """
  return optax.chain(*(tx for _, tx in parts(config, key, params)))


def parts(config, key: jax.Array, params=None) -> list:
  """`build`'s chain as `[(config key, transform), ...]`, in order: the
  key each transform comes from, for the errors of a dry build."""
  opt, lp = config.opt, config.lowprec
  lr = schedule(opt, config.train.steps)
  out = []
  if opt.clip_norm > 0:
    out.append(("opt.clip_norm", clip_by_global_norm(opt.clip_norm)))
  if lp.get("group_recipes", ()):
    out.append(("lowprec.group_recipes", _per_group(config, lr, key)))
    return out + _traces(lp, jax.random.split(key)[1])
  target = lowprec_config.writeback_target(lp, params)
  kind = lowprec_config.compensation(lp)
  wb_key, trace_key = jax.random.split(key)
  write_key = wb_key if lp.rounding != "nearest" else None
  wrapped = target is not None and kind in WRAPPERS
  if _one_kernel(lp, target, kind):
    state_key = jax.random.fold_in(key, 3)  # `_optimizer`'s
    rules = lowprec_config.state_rules(lp)
    tx = stored_adamw(config, lr, rules, state_key, (target, write_key))
    return [*out, ("lowprec.state", tx), *_traces(lp, trace_key)]
  out.append(_optimizer(config, lr, target, write_key, key))
  if lp.get("decay_erasure", False) and not wrapped:
    out.append(("lowprec.decay_erasure", _decay_erasure(config, lr, target)))
  if target is not None and not wrapped:
    write = WRITEBACKS[kind]
    where = "lowprec.writeback"
    if kind != "none":
      where = "lowprec.compensation"
    out.append((where, write(lp, target, write_key)))
  return out + _traces(lp, trace_key)


def _per_group(config, lr, key) -> optax.GradientTransformation:
  """`optax.multi_transform` over `lowprec.groups`: each group's recipe
  (`lowprec.recipes.chain`) around its own AdamW/SGD, the write-back's key
  `fold_in(write-back key, group index)`, as `scripts.advise` writes it
  for users' code."""
  wb_key = jax.random.split(key)[0]
  chosen = lowprec_config.group_recipes(config.lowprec)
  txs = {}
  for i, (group, _, name) in enumerate(chosen):
    optimizer = OPTIMIZERS[config.opt.name](config.opt, lr)
    txs[group] = lowprec.recipes.chain(
      optimizer, name, jax.random.fold_in(wb_key, i)
    )
  groups = [(g, regex) for g, regex, _ in chosen]
  return optax.multi_transform(txs, lowprec.groups.labels(groups))


def _traces(lp, trace_key) -> list:
  """The reference and compensated traces a (float32) run carries."""
  out = []
  if lp.trace_targets:
    trace = lowprec.freeze.reference_trace(
      lowprec_config.trace_targets(lp),
      sample=lp.trace_sample,
      key=trace_key,
      at_init=lp.get("trace_at_init", False),
    )
    out.append(("lowprec.trace_targets", trace))
  if lp.get("trace_remedies", ()):
    remedies = lowprec.freeze.compensated_trace(
      lowprec_config.trace_remedies(lp)
    )
    out.append(("lowprec.trace_remedies", remedies))
  if lp.get("trace_progress", False):
    progress = lowprec.freeze.progress_trace(
      lowprec_config.progress_targets(lp)
    )
    out.append(("lowprec.trace_progress", progress))
  return out


def _optimizer(config, lr, target, write_key, key) -> tuple:
  """`(config key, transform)`: AdamW/SGD, inside an eco write-back where
  the config has one, inside its state store or state trace."""
  opt, lp = config.opt, config.lowprec
  where, optimizer = "opt.name", OPTIMIZERS[opt.name](opt, lr)
  kind = lowprec_config.compensation(lp)
  wrap = WRAPPERS.get(kind) if target is not None else None
  if wrap is not None:
    if lp.get("decay_erasure", False):
      # It would count inside eco, whose own telemetry hides it.
      raise ValueError(
        "lowprec.decay_erasure counts the proposals inside eco, where its "
        "telemetry is not read: set it in an arm with "
        "lowprec.compensation='none'"
      )
    optimizer = wrap(lp, target, write_key, optimizer)
    where = "lowprec.compensation"
  if lp.get("state", ()):
    # A key of its own, so that the write-back's and the trace's keys stay
    # those of runs without stored state.
    state_key = jax.random.fold_in(key, 3)
    rules = lowprec_config.state_rules(lp)
    if lp.get("state_kernel", "none") != "none":
      optimizer = stored_adamw(config, lr, rules, state_key)
    else:
      optimizer = lowprec.store_state(optimizer, rules, key=state_key)
    where = "lowprec.state"
  if lp.get("state_targets", ()):
    optimizer = lowprec.freeze.state_trace(
      optimizer, lowprec_config.state_targets(lp)
    )
    where = "lowprec.state_targets"
  return where, optimizer


def _one_kernel(lp, target, kind) -> bool:
  """Whether the run steps AdamW's stored moments and its write-back in
  one kernel a leaf (`lowprec.stored_adamw_writeback`): both kernels
  asked for alike ("auto" or "pallas"), a plain write-back, and nothing
  chained between the optimizer and the write-back."""
  state = lp.get("state_kernel", "none")
  return (
    target is not None
    and kind == "none"
    and state in ("auto", "pallas")
    and lp.get("writeback_kernel", "xla") == state
    and not lowprec.scaled.is_scaled(lp.writeback)
    and not lp.get("decay_erasure", False)
    and not lp.get("state_targets", ())
  )


def stored_adamw(
  config, lr, rules, key, writeback=None
) -> optax.GradientTransformation:
  """AdamW with its moments stored by `lowprec.scale_by_stored_adam`
  (`lowprec.state_kernel`: "auto" runs one kernel a leaf on one GPU),
  chained as `optax.adamw` chains `scale_by_adam`: the state's paths are
  `0/mu/...` as under `store_state`, the stored moments' random bits
  come from the same key folded by their paths within the store
  (`mu/...`, not `0/mu/...`), so a stochastic store draws other bits
  than `store_state` around `optax.adamw` does. The store counts its
  telemetry as `store_state` does (`state/changed/mu/...`).

  With `writeback` (`(target, key)`), the write-back as well, in the
  same kernel (`lowprec.stored_adamw_writeback`, when both
  `lowprec.state_kernel` and `lowprec.writeback_kernel` ask for it):
  the chain's state flattened into one tuple, the same keys and bits.

  Raises:
    ValueError: an optimizer other than AdamW, an ECO write-back (which
      wraps the optimizer), or rules other than one for `mu` and one for
      `nu`, each naming the fix.
  """
  opt, lp = config.opt, config.lowprec
  fix = "or set lowprec.state_kernel='none' (store_state around the optimizer)"
  if opt.name != "adamw":
    raise ValueError(
      f"lowprec.state_kernel runs AdamW's step; opt.name is {opt.name!r}: "
      f"set opt.name='adamw', {fix}"
    )
  if lowprec_config.compensation(lp) in WRAPPERS:
    raise ValueError(
      "lowprec.state_kernel stores AdamW's moments in its own step, and "
      f"lowprec.compensation={lp.compensation!r} wraps the optimizer: "
      f"pick another compensation, {fix}"
    )
  specs = dict(rules)
  if sorted(specs) != ["mu", "nu"] or len(rules) != 2:
    raise ValueError(
      "lowprec.state_kernel stores both of AdamW's moments: give "
      "lowprec.state as one 'mu=<spec>' and one 'nu=<spec>' entry (e.g. "
      f"'mu=dynamic8:stochastic:block256'), {fix}; got {lp.state!r}"
    )
  random = any(sf.rounding != "nearest" for sf in specs.values())
  if writeback is not None:
    target, write_key = writeback
    return lowprec.stored_adamw_writeback(
      lr,
      target,
      lp.rounding,
      b1=opt.b1,
      b2=opt.b2,
      eps=opt.eps,
      weight_decay=opt.weight_decay,
      mu=str(specs["mu"]),
      nu=str(specs["nu"]),
      key=key if random else None,
      writeback_key=write_key,
      telemetry=True,
      overflow=lp.overflow,
      kernel=lp.state_kernel,
    )
  return optax.chain(
    lowprec.scale_by_stored_adam(
      opt.b1,
      opt.b2,
      opt.eps,
      mu=str(specs["mu"]),
      nu=str(specs["nu"]),
      kernel=lp.state_kernel,
      key=key if random else None,
      telemetry=True,
    ),
    optax.add_decayed_weights(opt.weight_decay),
    optax.scale_by_learning_rate(lr),
  )


def _decay_erasure(config, lr, target):
  """`lowprec.freeze.decay_erasure` on the write-back grid, or on the first
  reference-trace target of a float32 run."""
  opt, lp = config.opt, config.lowprec
  if opt.name != "adamw":
    raise ValueError(
      "lowprec.decay_erasure splits AdamW's proposals; set opt.name='adamw' "
      "or lowprec.decay_erasure=False"
    )
  if target is None:
    if not lp.trace_targets:
      raise ValueError(
        "lowprec.decay_erasure needs a grid: set lowprec.writeback or "
        "lowprec.trace_targets"
      )
    target = lowprec_config.trace_target(
      lp.trace_targets[0], lp.keep_float32
    ).fmt
  return lowprec.freeze.decay_erasure(target, lr, opt.weight_decay)


def has_telemetry(lp) -> bool:
  """Whether `build`'s chain holds a state that `lowprec.telemetry` reads
  (a write-back, a reference or compensated trace, a decay counter or
  stored state)."""
  return bool(
    lp.writeback
    or lp.get("group_recipes", ())
    or lp.trace_targets
    or lp.get("trace_remedies", ())
    or lp.get("decay_erasure", False)
    or lp.get("state", ())
    or lp.get("state_targets", ())
    or lp.get("trace_progress", False)
  )


# Key prefixes of the float32 run's predictions and of a stored state,
# whose counts are not the write-back's proposals.
_NOT_WRITEBACK = ("pred", "pred_state", "state", "progress")


def nonfinite_step(record: dict) -> int:
  """The write-backs' non-finite proposals in a step's record (its
  telemetry) when every proposal of the step was non-finite, else 0.

  Totals are the keys `proposals` and `nonfinite` of each write-back
  (`<group>/nonfinite` under `lowprec.group_recipes`, `nonfinite#1` for a
  second one); per-tensor keys (`nonfinite/<path>`), predictions and a
  stored state's counts are left out.
  """
  totals = {"proposals": 0, "nonfinite": 0}
  for key, value in record.items():
    parts = key.split("#")[0].split("/")
    if parts[-1] in totals and parts[0] not in _NOT_WRITEBACK:
      totals[parts[-1]] += value
  if totals["proposals"] or not totals["nonfinite"]:
    return 0
  return totals["nonfinite"]
