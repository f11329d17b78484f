"""Remedies for write-back freezing without float32 master weights.

Compares, on the small GPT of `freeze_small_gpt` with bfloat16 weights and
AdamW, the compensated write-backs against plain write-back (nearest
freezes past mid-run; stochastic and dead-zone rounding) and two baselines
that keep float32 weights:

  fp32            float32 weights (the reference loss)
  mixed           a float32 master whose forward rounds the kernels to
                  bfloat16 (nearest) every step (lowprec.weight_format)
  rn, sr, dz      nearest, stochastic, dead-zone write-back, no buffer
  kahan_bf16      Kahan write-back with a bfloat16 buffer (2 + 2 bytes)
  kahan_e5m2      Kahan write-back with a float8_e5m2 buffer (2 + 1 bytes)
  two_component   Collage-style value and error, both bfloat16 (2 + 2)
  remainder       a float32 master split into the bfloat16 weight and a
                  uint16 remainder (2 + 2): equal to a float32-master run
                  whose model computes with the truncated bfloat16 view

`configs/remedies_fp8.py` runs the same arms (without the remainder, which
needs bfloat16) with weights on float8_e4m3fn in the setting of
`freeze_gpt2_fp8`. AdamW's float32 moments add 8 bytes per parameter to
every arm. The table gives per arm the final validation loss, the share of
the nearest-rounding gap `(L_RN - L_x) / (L_RN - L_fp32)` it recovers,
bytes per parameter, step time relative to nearest write-back, the last
step's erased fraction and carried mass, and, for the nearest and the
Kahan and two-component arms, the erased fraction (from the weight) and
lost fraction (lost / proposals) that the float32 arm predicted
(`lowprec.trace_targets`, `lowprec.trace_remedies`) next to the measured
ones, as means over steps, with the RMSE between the curves.

  python -m experiments.run --config configs/remedies.py
  python -m scripts.make_tables remedies

CPU scale (default): 9 arms x 3 seeds of 400 steps of the 2-layer d=64
GPT on the built-in corpus; 11 minutes on 2 CPU cores (with a shared
compilation cache, JAX_COMPILATION_CACHE_DIR). Full scale (`:scale=full`):
its 6-layer d=384 decoder on token files in data.path.
Measured (CPU scale, 3 seeds; docs/freeze_studies.md has the table):
recovery of the 0.101-nat nearest gap: Kahan (bf16 buffer) and
two-component 0.996, Kahan (e5m2 buffer) 0.921, remainder 0.981, mixed
1.000, stochastic 0.990, dead-zone 1.194; erased fraction predicted by the
float32 arm within a curve RMSE of 0.008 (nearest) and 0.004 (Kahan), the
e5m2 buffer's lost fraction 0.341 predicted, 0.341 measured.
"""

from configs import common, freeze_small_gpt


def arms(fmt: str, remainder: bool) -> dict:
  """The study's arms for weights on `fmt`: baselines, plain write-backs
  and the compensated ones (the remainder only where `remainder`)."""
  wb = {"writeback": fmt}
  out = {
    # The float32 arm predicts nearest write-back (reference_trace) and
    # each compensated arm (compensated_trace) along its own trajectory.
    "fp32": {
      "lowprec": {
        "trace_targets": (fmt,),
        "trace_remedies": (
          f"{fmt}:kahan:bfloat16",
          f"{fmt}:kahan:float8_e5m2",
          f"{fmt}:two_component",
        ),
      }
    },
    "mixed": {"lowprec": {"weight_format": fmt}},
    "rn": {"lowprec": wb},
    "sr": {"lowprec": {**wb, "rounding": "stochastic"}},
    "dz": {"lowprec": {**wb, "rounding": "deadzone"}},
    "kahan_bf16": {"lowprec": {**wb, "compensation": "kahan"}},
    "kahan_e5m2": {
      "lowprec": {**wb, "compensation": "kahan", "buffer": "float8_e5m2"}
    },
    "two_component": {"lowprec": {**wb, "compensation": "two_component"}},
  }
  if remainder:
    out["remainder"] = {"lowprec": {**wb, "compensation": "remainder"}}
  return out


ARMS = arms("bfloat16", remainder=True)


def use_study(c, name: str, arms_: dict) -> None:
  """What both remedies studies share: analysis, figure, seeds, arms."""
  c.study.name = name
  c.study.analysis = "remedies"
  c.study.figure = "remedies_figure"
  c.study.seeds = (0, 1, 2)
  c.study.arms = arms_
  if c.study.scale == "smoke":
    common.shrink_to_smoke(c, 2)
    c.study.seeds = (0,)
    c.data.eval_batches = 1
    # Two arms, to keep the smoke short: Kahan with a float8 buffer
    # through the runner and its checkpoint, and the float32 arm that
    # predicts it. tests/optim_test.py builds every compensation from a
    # config; the nearest and weight_format arms are what the other
    # studies' smokes run.
    c.study.arms = {k: arms_[k] for k in ("fp32", "kahan_e5m2")}


def get_config(arg=None):
  c = common.get_config(arg)
  freeze_small_gpt.use_setting(c)
  use_study(c, "remedies", ARMS)
  return c
