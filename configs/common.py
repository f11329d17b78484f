"""Shared defaults for every study; a study file holds only its differences.

Sections: `study` (name, arms, seeds, and the selected arm / seed), `model`,
`data`, `opt`, `lowprec`, `train`, `log`, `ckpt`. Durations end in `_steps`;
formats and rounding modes are plain strings.

The config-file argument (`--config configs/x.py:ARG`) is a comma-separated
list of `key=value` with keys `scale` (`full`, `cpu` or `smoke`), `arm` and
`seed`, e.g. `configs/freeze_small_gpt.py:arm=rn_bf16,seed=1`.
"""

from __future__ import annotations

import ml_collections

SCALES = ("full", "cpu", "smoke")
ARG_KEYS = ("scale", "arm", "seed")


def parse_arg(arg: str | None, default_scale: str = "cpu") -> dict:
  """Parses `scale=cpu,arm=rn_bf16,seed=1` (any subset, any order)."""
  out = {"scale": default_scale, "arm": "", "seed": -1}
  for item in filter(None, (arg or "").split(",")):
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or key not in ARG_KEYS:
      raise ValueError(
        f"bad config argument {item!r}; expected key=value with key in "
        f"{', '.join(ARG_KEYS)}, e.g. 'scale=cpu,arm=rn_bf16,seed=0'"
      )
    out[key] = _seed(value) if key == "seed" else value.strip()
  if out["scale"] not in SCALES:
    raise ValueError(
      f"unknown scale {out['scale']!r}; valid: {', '.join(SCALES)}"
    )
  return out


def _seed(value: str) -> int:
  try:
    seed = int(value)
  except ValueError:
    seed = -1
  if seed < 0:
    raise ValueError(
      f"bad seed {value!r} in the config argument: seed must be one of the "
      "study's seeds (study.seeds, integers >= 0), e.g. 'seed=0'; leave it "
      "out to run every seed"
    )
  return seed


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The defaults: a tiny GPT on the built-in corpus, float32, no rounding."""
  parsed = parse_arg(arg)
  c = ml_collections.ConfigDict()

  c.study = ml_collections.ConfigDict()
  c.study.name = "default"
  c.study.kind = "train"  # train | operator_checks (no training)
  c.study.scale = parsed["scale"]
  c.study.arms = ml_collections.ConfigDict()  # arm name -> nested overrides
  c.study.seeds = (0,)
  c.study.reference_arm = ""  # arm whose trace predicts this arm's freeze
  c.study.cell = ""  # label grouping arms into one table row
  # What makes the study's table and figure from its results (names in
  # experiments.analysis.tables.ANALYSES and figures.FIGURES), and the arm
  # `scripts.plan_full_scale` costs at full scale ("" for none).
  c.study.analysis = "freeze"
  c.study.figure = "freeze_panels"
  c.study.plan_arm = ""
  c.study.arm = parsed["arm"]  # "" runs every arm
  c.study.seed = parsed["seed"]  # -1 runs every seed

  c.model = ml_collections.ConfigDict()
  c.model.kind = "gpt"  # gpt | mlp | cnn | regression
  c.model.vocab_size = 256
  c.model.seq_len = 64
  c.model.n_layer = 2
  c.model.n_head = 4
  c.model.d_model = 64
  c.model.mlp_ratio = 4
  c.model.positions = "learned"  # learned | rotary
  c.model.norm = "layernorm"  # layernorm | rmsnorm
  c.model.parallel_block = False  # NeoX-style parallel attention and MLP
  c.model.tie_embeddings = True
  c.model.init_std = 0.02
  c.model.hidden = (128,)  # mlp hidden widths
  c.model.channels = (8, 16)  # cnn channels
  c.model.activation = "gelu"
  c.model.remat = False  # recompute each block's forward in its backward
  # One compiled body for every block (lowprec.nn.rolled): compile time
  # flat in depth, the same parameter tree and random draws, values equal
  # to float32 rounding. On in the full-scale presets; off at CPU scale,
  # whose documented numbers were made with the unrolled loop.
  c.model.scan_layers = False
  # How the blocks' leaves are stored: "apart" (a leaf per layer),
  # "stacked" (one array per kind of leaf, lowprec.engine.stacked: the
  # optimizer's step compiles one program per kind of leaf, so compile
  # time stays flat in depth) or "auto" (stacked where every transform of
  # the arm takes it; the run header says which). The same bits,
  # telemetry, parameter paths and checkpoints either way. "auto" in the
  # full-scale presets.
  c.model.layer_storage = "apart"
  # Compute precision, a stated choice (config.json records it, the run
  # header prints it): the dtype the model computes in (its parameters are
  # cast for the forward; the stored weights, the optimizer and the loss
  # stay float32) and the precision of float32 matmuls: "default" is
  # XLA's (TF32 on NVIDIA GPUs from Ampere on, full float32 on CPUs),
  # "highest" full float32 everywhere, "tf32" (bfloat16 products:
  # compute_dtype).
  c.model.compute_dtype = "float32"  # float32 | bfloat16
  c.model.matmul_precision = "default"  # default | highest | tf32
  # Attention as jax.nn.dot_product_attention (cuDNN's fused kernel on a
  # GPU) where an arm rounds neither its probabilities, its output nor
  # its gradients; an arm that does keeps the per-use operator. On in the
  # full-scale presets.
  c.model.fused_attention = False

  c.data = ml_collections.ConfigDict()
  c.data.name = "builtin_text"  # see experiments/data registry
  c.data.path = ""  # token-file directory or MNIST directory
  c.data.batch_size = 16
  c.data.eval_batches = 4
  c.data.n_train = 1024  # regression / classification sizes
  c.data.n_test = 512
  c.data.d_in = 16
  c.data.n_features = 64
  c.data.noise = 0.0

  c.opt = ml_collections.ConfigDict()
  c.opt.name = "adamw"  # adamw | sgd
  c.opt.lr = 1e-3
  c.opt.schedule = "cosine"  # cosine | constant
  c.opt.warmup_steps = 10
  c.opt.min_lr_ratio = 0.1
  c.opt.b1 = 0.9
  c.opt.b2 = 0.95
  c.opt.eps = 1e-8
  c.opt.weight_decay = 0.1
  c.opt.momentum = 0.0  # sgd
  c.opt.clip_norm = 1.0  # 0 disables clipping

  c.lowprec = ml_collections.ConfigDict()
  c.lowprec.writeback = ""  # weight grid format; "" trains in float32
  c.lowprec.rounding = "nearest"  # nearest | stochastic | deadzone
  # Keep what the write-back drops: none | kahan | two_component |
  # remainder | split (bfloat16 weights and an int8/int16 correction) | eco
  # (the error folded into the optimizer's first moment; it wraps AdamW/SGD,
  # which then needs momentum, and a lowprec.state rule for mu must round
  # stochastically; nearest or stochastic rounding)
  c.lowprec.compensation = "none"
  c.lowprec.buffer = "bfloat16"  # the Kahan buffer's format
  c.lowprec.correction_bits = 8  # split's correction: 8 (int8) | 16 (int16)
  c.lowprec.overflow = "saturate"
  # Block scales of an MX write-back: "recompute" (from w + u) | "keep"
  # (those of w; values past a block's top saturate)
  c.lowprec.writeback_scales = "recompute"
  # An MX writeback's scale rule: "" (the format's, OCP floor), "ocp" or
  # "noclip" (the smallest power of two that clips nothing)
  c.lowprec.writeback_rule = ""
  c.lowprec.int_scale = 0.0  # intK grid step; 0: from the starting params
  # With int_scale 0: the smallest power-of-two step covering max |w| of
  # each tensor ("tensor") or of every tensor on the grid ("model")
  c.lowprec.int_scale_scope = "tensor"
  c.lowprec.keep_float32 = ""  # regex of param paths left in float32
  c.lowprec.trace_targets = ()  # formats predicted by a reference trace
  c.lowprec.trace_sample = 0  # coordinates whose (w, u) are logged
  c.lowprec.trace_at_init = False  # also predict coordinates left at init
  # Compensated write-backs predicted by the float32 run (compensated_trace),
  # "weights:kind[:buffer]", e.g. ("bfloat16:kahan:float8_e5m2",)
  c.lowprec.trace_remedies = ()
  c.lowprec.decay_erasure = False  # count erased proposals of decay alone
  # With trace_targets: also add up, per nearest target and coordinate,
  # the proposals its rounding would erase (lowprec.freeze.progress_trace:
  # an array like the params per target, in the checkpoints), for
  # scripts.advise's measured lost cost
  c.lowprec.trace_progress = False
  # Optimizer state stored in low precision (lowprec.store_state around the
  # optimizer): "regex=spec" rules over its state paths, in order, e.g.
  # ("mu=bfloat16:stochastic", "nu=float8_e5m2:stochastic:block128"); the
  # 8- and 4-bit states of docs/state.md too, e.g. ("mu=dynamic8:block256",
  # "nu=dynamic8u:block256") or "float8_e4m3fn:nearest:block256:amax"
  c.lowprec.state = ()
  # With lowprec.state one 'mu=<spec>' and one 'nu=<spec>' under AdamW:
  # "auto" (one kernel a leaf on one GPU, XLA elsewhere), "pallas" or
  # "xla" stores them by lowprec.scale_by_stored_adam in AdamW's chain
  # (its own random stream); "none" by store_state around the optimizer.
  c.lowprec.state_kernel = "none"
  # The plain write-back's leaves: "xla" (XLA's ops), "auto" (one Pallas
  # kernel a leaf on a plain float grid on one NVIDIA GPU, XLA elsewhere;
  # the same bits) or "pallas" (the kernel everywhere, interpreted off a
  # GPU): lowprec.writeback(kernel=).
  c.lowprec.writeback_kernel = "xla"
  # Predicted stored-state erasures in a float32-state run
  # (lowprec.freeze.state_trace): "name: regex=spec; regex=spec" entries.
  c.lowprec.state_targets = ()
  # Per-group recipes (lowprec.recipes, lowprec.groups), in place of the
  # keys above: "group=weights+state" entries, e.g. ("mlp=bf16_kahan+q8",
  # "norms=float32"), one per group of lowprec.groups ("name=regex",
  # first match; empty: lowprec.groups.DEFAULT_GROUPS). Written by
  # `python -m scripts.advise`.
  c.lowprec.groups = ()
  c.lowprec.group_recipes = ()
  c.lowprec.policy = ""  # backward-state policy string ("" = reference)
  # Dense products whose input and kernel both round to float8 run as
  # float8 dots with a float32 result (an FP8 GEMM on hardware that has
  # one): equal to the emulation up to float32 rounding (ops.Dense).
  c.lowprec.native_fp8 = False
  c.lowprec.fwd_format = "float32"  # rounding of saved forward tensors
  c.lowprec.fwd_rounding = "nearest"
  c.lowprec.weight_format = "float32"  # forward rounding of kernels
  c.lowprec.bwd_format = "float32"  # rounding of incoming gradients
  c.lowprec.bwd_rounding = "stochastic"
  # What attn.out@delta=fresh redraws: "redraw" (the probabilities' rounding
  # too: a copy from the reused output's distribution) | "output"
  c.lowprec.attn_fresh_out = "redraw"
  # A block-scaled recipe for every dense layer (lowprec.ops.ScaledDense):
  # "" | "nvfp4" | "mxfp8"; changes to it as "field=value,..." (e.g.
  # "kernel_blocks=1d,hadamard=0", "grad=nvfp4", "rule=ocp"); the last
  # compute_keep_last blocks keep the numerics above instead.
  c.lowprec.compute = ""
  c.lowprec.compute_changes = ""
  c.lowprec.compute_keep_last = 0

  c.train = ml_collections.ConfigDict()
  c.train.steps = 100
  c.train.eval_every_steps = 25
  c.train.virtual_shards = 16  # fixed-order gradient sum; 0 = plain mean
  c.train.fsdp = 1  # devices per parameter shard group
  c.train.seed = 0  # set from study.seed for each run
  # Start from the params another arm of the study (same seed) saved at a
  # step; optimizer state starts fresh, the data stream continues from there.
  c.train.init_from_arm = ""
  c.train.init_from_step = 0
  # Gradient probe (experiments/probes.py): the bias of the gradient against
  # the reference gradient on a fixed batch, logged with the step's metrics.
  c.train.probe_every_steps = 0  # 0: off
  c.train.probe_draws = 4  # keys per probe
  c.train.probe_batch_size = 0  # rows of the first eval batch; 0: all
  c.train.probe_chunk_rows = 0  # rows per probe gradient pass; 0: all at once
  c.train.probe_groups = "all=.*"  # name=regex over parameter paths, ...
  c.train.probe_grad_rounding = True  # False: the run's reads only
  # Probe memory (experiments/probes.py): lean = separate programs, one
  # backward pass compiled and live at a time (same bits); remat = each
  # block's forward recomputed in the probe's backward passes (one block's
  # activations; the recomputed forward may differ in its last bits)
  c.train.probe_lean = False
  c.train.probe_remat = False

  c.log = ml_collections.ConfigDict()
  c.log.results_dir = "results"
  c.log.progress_every_steps = 10
  c.log.tensorboard = False  # also write TensorBoard event files

  c.ckpt = ml_collections.ConfigDict()
  c.ckpt.every_steps = 50
  c.ckpt.keep = 2
  return c


def shrink_to_smoke(c, steps: int) -> None:
  """The few-step variant the tests run: a one-layer, width-32 GPT."""
  c.model.update(dict(n_layer=1, d_model=32, seq_len=32))
  c.opt.warmup_steps = 2
  c.train.steps = steps
  c.train.eval_every_steps = steps // 2
  c.ckpt.every_steps = steps
