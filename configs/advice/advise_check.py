"""The recipe lowprec.freeze.advise recommends, per tensor group.

Written by `python -m scripts.advise`; rerun it to update.

Predicted from steps 301-600 of the float32 run (300 steps; the advice needs at least 10); thresholds: lost <= 0.01, move >= 0.1, erased <= 0.99 under a deterministic compensation.

| group | params | weights | bytes | erased (nearest) | move (SR) | lost | safe | nats (+- se) | from |
|---|---:|---|---:|---:|---:|---:|---|---:|---|
| embeddings | 24576 | fp8_eco | 1 | 1.000 | 0.006 | - | no: eco is not predicted by a trace | - |  |
| embeddings | 24576 | **fp8_sr** | 1 | 1.000 | 0.006 | 0.000 | no: move 0.006 < 0.1 | +0.0002 +- 0.0004 | forward SR (4 draws) |
| embeddings | 24576 | fp8_rn | 1 | 1.000 | 0.006 | 1.000 | no: lost 1.000 > 0.01 | +2.9520 +- 0.0000 | lost (1 draw) |
| embeddings | 24576 | mx_eco | 1.03125 | 0.997 | 0.011 | - | no: eco is not predicted by a trace | - |  |
| embeddings | 24576 | mx_sr | 1.03125 | 0.997 | 0.011 | 0.000 | no: move 0.011 < 0.1 | +0.0010 +- 0.0005 | forward SR (4 draws) |
| embeddings | 24576 | bf16_eco | 2 | 0.954 | 0.115 | - | no: eco is not predicted by a trace | - |  |
| embeddings | 24576 | bf16_sr | 2 | 0.954 | 0.115 | 0.000 | yes | -0.0000 +- 0.0000 | forward SR (4 draws) |
| embeddings | 24576 | bf16_rn | 2 | 0.954 | 0.115 | 0.954 | no: lost 0.954 > 0.01 | +0.1222 +- 0.0000 | lost (1 draw) |
| embeddings | 24576 | fp8_kahan_e5m2 | 2 | 1.000 | 0.006 | 0.001 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| embeddings | 24576 | bf16_split8 | 3 | 0.954 | 0.115 | - | no: split is not predicted by a trace | - |  |
| embeddings | 24576 | bf16_kahan_e5m2 | 3 | 0.954 | 0.115 | 0.089 | no: lost 0.089 > 0.01 | - |  |
| embeddings | 24576 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| embeddings | 24576 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| embeddings | 24576 | bf16_kahan | 4 | 0.954 | 0.115 | 0.000 | yes | - |  |
| norms | 672 | fp8_eco | 1 | 1.000 | 0.000 | - | no: eco is not predicted by a trace | - |  |
| norms | 672 | **fp8_sr** | 1 | 1.000 | 0.000 | 0.000 | no: move 0.000 < 0.1 | +0.0007 +- 0.0003 | forward SR (4 draws) |
| norms | 672 | fp8_rn | 1 | 1.000 | 0.000 | 1.000 | no: lost 1.000 > 0.01 | +0.0352 +- 0.0000 | lost (1 draw) |
| norms | 672 | mx_eco | 1.03125 | 1.000 | 0.000 | - | no: eco is not predicted by a trace | - |  |
| norms | 672 | mx_sr | 1.03125 | 1.000 | 0.000 | 0.000 | no: move 0.000 < 0.1 | +0.0029 +- 0.0003 | forward SR (4 draws) |
| norms | 672 | bf16_eco | 2 | 1.000 | 0.006 | - | no: eco is not predicted by a trace | - |  |
| norms | 672 | bf16_sr | 2 | 1.000 | 0.006 | 0.000 | no: move 0.006 < 0.1 | -0.0000 +- 0.0000 | forward SR (4 draws) |
| norms | 672 | bf16_rn | 2 | 1.000 | 0.006 | 1.000 | no: lost 1.000 > 0.01 | +0.0352 +- 0.0000 | lost (1 draw) |
| norms | 672 | fp8_kahan_e5m2 | 2 | 1.000 | 0.000 | 0.000 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| norms | 672 | bf16_split8 | 3 | 1.000 | 0.006 | - | no: split is not predicted by a trace | - |  |
| norms | 672 | bf16_kahan_e5m2 | 3 | 1.000 | 0.006 | 0.001 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| norms | 672 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| norms | 672 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| norms | 672 | bf16_kahan | 4 | 1.000 | 0.006 | 0.000 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| biases | 2592 | fp8_eco | 1 | 1.000 | 0.009 | - | no: eco is not predicted by a trace | - |  |
| biases | 2592 | **fp8_sr** | 1 | 1.000 | 0.009 | 0.000 | no: move 0.009 < 0.1 | -0.0000 +- 0.0000 | forward SR (4 draws) |
| biases | 2592 | fp8_rn | 1 | 1.000 | 0.009 | 1.000 | no: lost 1.000 > 0.01 | +0.2171 +- 0.0000 | lost (1 draw) |
| biases | 2592 | mx_eco | 1.03125 | 0.966 | 0.072 | - | no: eco is not predicted by a trace | - |  |
| biases | 2592 | mx_sr | 1.03125 | 0.966 | 0.072 | 0.000 | no: move 0.072 < 0.1 | +0.0000 +- 0.0000 | forward SR (4 draws) |
| biases | 2592 | bf16_eco | 2 | 0.632 | 0.416 | - | no: eco is not predicted by a trace | - |  |
| biases | 2592 | bf16_sr | 2 | 0.632 | 0.416 | 0.000 | yes | +0.0000 +- 0.0000 | forward SR (4 draws) |
| biases | 2592 | bf16_rn | 2 | 0.632 | 0.416 | 0.632 | no: lost 0.632 > 0.01 | +0.0003 +- 0.0000 | lost (1 draw) |
| biases | 2592 | fp8_kahan_e5m2 | 2 | 1.000 | 0.009 | 0.009 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| biases | 2592 | bf16_split8 | 3 | 0.632 | 0.416 | - | no: split is not predicted by a trace | - |  |
| biases | 2592 | bf16_kahan_e5m2 | 3 | 0.632 | 0.416 | 0.512 | no: lost 0.512 > 0.01 | - |  |
| biases | 2592 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| biases | 2592 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| biases | 2592 | bf16_kahan | 4 | 0.632 | 0.416 | 0.000 | yes | - |  |
| attention | 110592 | fp8_eco | 1 | 1.000 | 0.011 | - | no: eco is not predicted by a trace | - |  |
| attention | 110592 | **fp8_sr** | 1 | 1.000 | 0.011 | 0.000 | no: move 0.011 < 0.1 | +0.0004 +- 0.0001 | forward SR (4 draws) |
| attention | 110592 | fp8_rn | 1 | 1.000 | 0.011 | 1.000 | no: lost 1.000 > 0.01 | +1.1874 +- 0.0000 | lost (1 draw) |
| attention | 110592 | mx_eco | 1.03125 | 0.979 | 0.047 | - | no: eco is not predicted by a trace | - |  |
| attention | 110592 | mx_sr | 1.03125 | 0.979 | 0.047 | 0.000 | no: move 0.047 < 0.1 | +0.0001 +- 0.0001 | forward SR (4 draws) |
| attention | 110592 | bf16_eco | 2 | 0.756 | 0.304 | - | no: eco is not predicted by a trace | - |  |
| attention | 110592 | bf16_sr | 2 | 0.756 | 0.304 | 0.000 | yes | -0.0000 +- 0.0000 | forward SR (4 draws) |
| attention | 110592 | bf16_rn | 2 | 0.756 | 0.304 | 0.756 | no: lost 0.756 > 0.01 | +0.0217 +- 0.0000 | lost (1 draw) |
| attention | 110592 | fp8_kahan_e5m2 | 2 | 1.000 | 0.011 | 0.005 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| attention | 110592 | bf16_split8 | 3 | 0.756 | 0.304 | - | no: split is not predicted by a trace | - |  |
| attention | 110592 | bf16_kahan_e5m2 | 3 | 0.756 | 0.304 | 0.293 | no: lost 0.293 > 0.01 | - |  |
| attention | 110592 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| attention | 110592 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| attention | 110592 | bf16_kahan | 4 | 0.756 | 0.304 | 0.000 | yes | - |  |
| mlp | 221184 | fp8_eco | 1 | 1.000 | 0.011 | - | no: eco is not predicted by a trace | - |  |
| mlp | 221184 | **fp8_sr** | 1 | 1.000 | 0.011 | 0.000 | no: move 0.011 < 0.1 | +0.0002 +- 0.0001 | forward SR (4 draws) |
| mlp | 221184 | fp8_rn | 1 | 1.000 | 0.011 | 1.000 | no: lost 1.000 > 0.01 | +1.0500 +- 0.0000 | lost (1 draw) |
| mlp | 221184 | mx_eco | 1.03125 | 0.970 | 0.063 | - | no: eco is not predicted by a trace | - |  |
| mlp | 221184 | mx_sr | 1.03125 | 0.970 | 0.063 | 0.000 | no: move 0.063 < 0.1 | +0.0003 +- 0.0001 | forward SR (4 draws) |
| mlp | 221184 | bf16_eco | 2 | 0.680 | 0.374 | - | no: eco is not predicted by a trace | - |  |
| mlp | 221184 | bf16_sr | 2 | 0.680 | 0.374 | 0.000 | yes | +0.0000 +- 0.0000 | forward SR (4 draws) |
| mlp | 221184 | bf16_rn | 2 | 0.680 | 0.374 | 0.680 | no: lost 0.680 > 0.01 | +0.0104 +- 0.0000 | lost (1 draw) |
| mlp | 221184 | fp8_kahan_e5m2 | 2 | 1.000 | 0.011 | 0.007 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| mlp | 221184 | bf16_split8 | 3 | 0.680 | 0.374 | - | no: split is not predicted by a trace | - |  |
| mlp | 221184 | bf16_kahan_e5m2 | 3 | 0.680 | 0.374 | 0.404 | no: lost 0.404 > 0.01 | - |  |
| mlp | 221184 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| mlp | 221184 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| mlp | 221184 | bf16_kahan | 4 | 0.680 | 0.374 | 0.000 | yes | - |  |

| group | moments | bytes | mu stalled | nu stalled | safe |
|---|---|---:|---:|---:|---|
| embeddings | **q8** | 2.03125 | 0.273 | 0.878 | yes |
| embeddings | bf16 | 4 | 0.052 | 0.040 | yes |
| embeddings | float32 | 8 | 0.000 | 0.000 | yes |
| norms | **q8** | 2.03125 | 0.058 | 0.631 | yes |
| norms | bf16 | 4 | 0.010 | 0.157 | yes |
| norms | float32 | 8 | 0.000 | 0.000 | yes |
| biases | **q8** | 2.03125 | 0.045 | 0.674 | yes |
| biases | bf16 | 4 | 0.004 | 0.145 | yes |
| biases | float32 | 8 | 0.000 | 0.000 | yes |
| attention | **q8** | 2.03125 | 0.042 | 0.665 | yes |
| attention | bf16 | 4 | 0.004 | 0.140 | yes |
| attention | float32 | 8 | 0.000 | 0.000 | yes |
| mlp | **q8** | 2.03125 | 0.034 | 0.570 | yes |
| mlp | bf16 | 4 | 0.004 | 0.141 | yes |
| mlp | float32 | 8 | 0.000 | 0.000 | yes |

Recommended (3.031 bytes/param):
- predicted cost +0.0013 +- 0.0006 nats (weights; the cheapest choice whose prediction plus two standard errors stays under the margin of 0.01 nats)
- embeddings: fp8_sr+q8
- norms: fp8_sr+q8
- biases: fp8_sr+q8
- attention: fp8_sr+q8
- mlp: fp8_sr+q8
- note: not predicted by this run, never recommended: bf16_eco, bf16_split8, fp8_eco, mx_eco
"""

LOWPREC = {
  "groups": (
    "embeddings=(.*/)?(wte|wpe|tok_embeddings|embed\\w*|pos_emb\\w*)(/.*)?",
    "norms=.*(norm_scale|(norm|ln)[^/]*/(scale|weight|gain))",
    "biases=.*bias",
    "attention=.*(attn|attention)[^/]*/.*",
    "mlp=.*(mlp|ffn|feed_forward)[^/]*/.*",
  ),
  "group_recipes": (
    "embeddings=fp8_sr+q8",
    "norms=fp8_sr+q8",
    "biases=fp8_sr+q8",
    "attention=fp8_sr+q8",
    "mlp=fp8_sr+q8",
  ),
}
