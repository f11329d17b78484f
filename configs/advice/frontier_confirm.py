"""The recipe lowprec.freeze.advise recommends, per tensor group.

Written by `python -m scripts.advise`; rerun it to update.

Predicted from steps 401-800 of the float32 run (400 steps; the advice needs at least 10); thresholds: lost <= 0.01, move >= 0.1, erased <= 0.99 under a deterministic compensation.

| group | params | weights | bytes | erased (nearest) | move (SR) | lost | safe | nats (+- se) | from |
|---|---:|---|---:|---:|---:|---:|---|---:|---|
| embeddings | 20480 | fp8_eco | 1 | 1.000 | 0.006 | - | no: eco is not predicted by a trace | - |  |
| embeddings | 20480 | **fp8_sr** | 1 | 1.000 | 0.006 | 0.000 | no: move 0.006 < 0.1 | +0.0008 +- 0.0006 | forward SR (4 draws) |
| embeddings | 20480 | fp8_rn | 1 | 1.000 | 0.006 | 1.000 | no: lost 1.000 > 0.01 | +3.0235 +- 0.0000 | lost (1 draw) |
| embeddings | 20480 | mx_eco | 1.03125 | 0.992 | 0.021 | - | no: eco is not predicted by a trace | - |  |
| embeddings | 20480 | mx_sr | 1.03125 | 0.992 | 0.021 | 0.000 | no: move 0.021 < 0.1 | +0.0010 +- 0.0009 | forward SR (4 draws) |
| embeddings | 20480 | bf16_eco | 2 | 0.904 | 0.154 | - | no: eco is not predicted by a trace | - |  |
| embeddings | 20480 | bf16_sr | 2 | 0.904 | 0.154 | 0.000 | yes | +0.0000 +- 0.0000 | forward SR (4 draws) |
| embeddings | 20480 | bf16_rn | 2 | 0.904 | 0.154 | 0.904 | no: lost 0.904 > 0.01 | +0.2021 +- 0.0000 | lost (1 draw) |
| embeddings | 20480 | fp8_kahan_e5m2 | 2 | 1.000 | 0.006 | 0.002 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| embeddings | 20480 | bf16_split8 | 3 | 0.904 | 0.154 | - | no: split is not predicted by a trace | - |  |
| embeddings | 20480 | bf16_kahan_e5m2 | 3 | 0.904 | 0.154 | 0.140 | no: lost 0.140 > 0.01 | - |  |
| embeddings | 20480 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| embeddings | 20480 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| embeddings | 20480 | bf16_kahan | 4 | 0.904 | 0.154 | 0.000 | yes | - |  |
| norms | 320 | fp8_eco | 1 | 1.000 | 0.000 | - | no: eco is not predicted by a trace | - |  |
| norms | 320 | **fp8_sr** | 1 | 1.000 | 0.000 | 0.000 | no: move 0.000 < 0.1 | +0.0005 +- 0.0003 | forward SR (4 draws) |
| norms | 320 | fp8_rn | 1 | 1.000 | 0.000 | 1.000 | no: lost 1.000 > 0.01 | +0.0596 +- 0.0000 | lost (1 draw) |
| norms | 320 | mx_eco | 1.03125 | 1.000 | 0.000 | - | no: eco is not predicted by a trace | - |  |
| norms | 320 | mx_sr | 1.03125 | 1.000 | 0.000 | 0.000 | no: move 0.000 < 0.1 | +0.0020 +- 0.0009 | forward SR (4 draws) |
| norms | 320 | bf16_eco | 2 | 1.000 | 0.006 | - | no: eco is not predicted by a trace | - |  |
| norms | 320 | bf16_sr | 2 | 1.000 | 0.006 | 0.000 | no: move 0.006 < 0.1 | +0.0000 +- 0.0000 | forward SR (4 draws) |
| norms | 320 | bf16_rn | 2 | 1.000 | 0.006 | 1.000 | no: lost 1.000 > 0.01 | +0.0596 +- 0.0000 | lost (1 draw) |
| norms | 320 | fp8_kahan_e5m2 | 2 | 1.000 | 0.000 | 0.000 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| norms | 320 | bf16_split8 | 3 | 1.000 | 0.006 | - | no: split is not predicted by a trace | - |  |
| norms | 320 | bf16_kahan_e5m2 | 3 | 1.000 | 0.006 | 0.001 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| norms | 320 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| norms | 320 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| norms | 320 | bf16_kahan | 4 | 1.000 | 0.006 | 0.000 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| biases | 1472 | fp8_eco | 1 | 1.000 | 0.010 | - | no: eco is not predicted by a trace | - |  |
| biases | 1472 | **fp8_sr** | 1 | 1.000 | 0.010 | 0.000 | no: move 0.010 < 0.1 | +0.0002 +- 0.0002 | forward SR (4 draws) |
| biases | 1472 | fp8_rn | 1 | 1.000 | 0.010 | 1.000 | no: lost 1.000 > 0.01 | +0.4650 +- 0.0000 | lost (1 draw) |
| biases | 1472 | mx_eco | 1.03125 | 0.959 | 0.081 | - | no: eco is not predicted by a trace | - |  |
| biases | 1472 | mx_sr | 1.03125 | 0.959 | 0.081 | 0.000 | no: move 0.081 < 0.1 | +0.0002 +- 0.0000 | forward SR (4 draws) |
| biases | 1472 | bf16_eco | 2 | 0.611 | 0.435 | - | no: eco is not predicted by a trace | - |  |
| biases | 1472 | bf16_sr | 2 | 0.611 | 0.435 | 0.000 | yes | -0.0000 +- 0.0000 | forward SR (4 draws) |
| biases | 1472 | bf16_rn | 2 | 0.611 | 0.435 | 0.611 | no: lost 0.611 > 0.01 | +0.0091 +- 0.0000 | lost (1 draw) |
| biases | 1472 | fp8_kahan_e5m2 | 2 | 1.000 | 0.010 | 0.088 | no: lost 0.088 > 0.01 | - |  |
| biases | 1472 | bf16_split8 | 3 | 0.611 | 0.435 | - | no: split is not predicted by a trace | - |  |
| biases | 1472 | bf16_kahan_e5m2 | 3 | 0.611 | 0.435 | 0.531 | no: lost 0.531 > 0.01 | - |  |
| biases | 1472 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| biases | 1472 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| biases | 1472 | bf16_kahan | 4 | 0.611 | 0.435 | 0.000 | yes | - |  |
| attention | 32768 | fp8_eco | 1 | 1.000 | 0.011 | - | no: eco is not predicted by a trace | - |  |
| attention | 32768 | **fp8_sr** | 1 | 1.000 | 0.011 | 0.000 | no: move 0.011 < 0.1 | +0.0001 +- 0.0001 | forward SR (4 draws) |
| attention | 32768 | fp8_rn | 1 | 1.000 | 0.011 | 1.000 | no: lost 1.000 > 0.01 | +0.3086 +- 0.0000 | lost (1 draw) |
| attention | 32768 | mx_eco | 1.03125 | 0.979 | 0.047 | - | no: eco is not predicted by a trace | - |  |
| attention | 32768 | mx_sr | 1.03125 | 0.979 | 0.047 | 0.000 | no: move 0.047 < 0.1 | +0.0001 +- 0.0002 | forward SR (4 draws) |
| attention | 32768 | bf16_eco | 2 | 0.756 | 0.304 | - | no: eco is not predicted by a trace | - |  |
| attention | 32768 | bf16_sr | 2 | 0.756 | 0.304 | 0.000 | yes | -0.0000 +- 0.0000 | forward SR (4 draws) |
| attention | 32768 | bf16_rn | 2 | 0.756 | 0.304 | 0.756 | no: lost 0.756 > 0.01 | +0.0091 +- 0.0000 | lost (1 draw) |
| attention | 32768 | fp8_kahan_e5m2 | 2 | 1.000 | 0.011 | 0.005 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| attention | 32768 | bf16_split8 | 3 | 0.756 | 0.304 | - | no: split is not predicted by a trace | - |  |
| attention | 32768 | bf16_kahan_e5m2 | 3 | 0.756 | 0.304 | 0.293 | no: lost 0.293 > 0.01 | - |  |
| attention | 32768 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| attention | 32768 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| attention | 32768 | bf16_kahan | 4 | 0.756 | 0.304 | 0.000 | yes | - |  |
| mlp | 65536 | fp8_eco | 1 | 1.000 | 0.011 | - | no: eco is not predicted by a trace | - |  |
| mlp | 65536 | **fp8_sr** | 1 | 1.000 | 0.011 | 0.000 | no: move 0.011 < 0.1 | +0.0003 +- 0.0002 | forward SR (4 draws) |
| mlp | 65536 | fp8_rn | 1 | 1.000 | 0.011 | 1.000 | no: lost 1.000 > 0.01 | +1.0756 +- 0.0000 | lost (1 draw) |
| mlp | 65536 | mx_eco | 1.03125 | 0.975 | 0.054 | - | no: eco is not predicted by a trace | - |  |
| mlp | 65536 | mx_sr | 1.03125 | 0.975 | 0.054 | 0.000 | no: move 0.054 < 0.1 | +0.0003 +- 0.0002 | forward SR (4 draws) |
| mlp | 65536 | bf16_eco | 2 | 0.721 | 0.337 | - | no: eco is not predicted by a trace | - |  |
| mlp | 65536 | bf16_sr | 2 | 0.721 | 0.337 | 0.000 | yes | +0.0000 +- 0.0000 | forward SR (4 draws) |
| mlp | 65536 | bf16_rn | 2 | 0.721 | 0.337 | 0.721 | no: lost 0.721 > 0.01 | +0.0074 +- 0.0000 | lost (1 draw) |
| mlp | 65536 | fp8_kahan_e5m2 | 2 | 1.000 | 0.011 | 0.006 | no: erased 1.000 > 0.99: the grid resolves no step | - |  |
| mlp | 65536 | bf16_split8 | 3 | 0.721 | 0.337 | - | no: split is not predicted by a trace | - |  |
| mlp | 65536 | bf16_kahan_e5m2 | 3 | 0.721 | 0.337 | 0.350 | no: lost 0.350 > 0.01 | - |  |
| mlp | 65536 | float32 | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| mlp | 65536 | bf16_remainder | 4 | 0.000 | - | 0.000 | yes | +0.0000 +- 0.0000 | exact |
| mlp | 65536 | bf16_kahan | 4 | 0.721 | 0.337 | 0.000 | yes | - |  |

| group | moments | bytes | mu stalled | nu stalled | safe |
|---|---|---:|---:|---:|---|
| embeddings | **q8** | 2.03125 | 0.205 | 0.795 | yes |
| embeddings | bf16 | 4 | 0.027 | 0.067 | yes |
| embeddings | float32 | 8 | 0.000 | 0.000 | yes |
| norms | **q8** | 2.03125 | 0.059 | 0.664 | yes |
| norms | bf16 | 4 | 0.009 | 0.148 | yes |
| norms | float32 | 8 | 0.000 | 0.000 | yes |
| biases | **q8** | 2.03125 | 0.124 | 0.685 | yes |
| biases | bf16 | 4 | 0.004 | 0.143 | yes |
| biases | float32 | 8 | 0.000 | 0.000 | yes |
| attention | **q8** | 2.03125 | 0.046 | 0.709 | yes |
| attention | bf16 | 4 | 0.004 | 0.139 | yes |
| attention | float32 | 8 | 0.000 | 0.000 | yes |
| mlp | **q8** | 2.03125 | 0.036 | 0.579 | yes |
| mlp | bf16 | 4 | 0.004 | 0.142 | yes |
| mlp | float32 | 8 | 0.000 | 0.000 | yes |

Recommended (3.031 bytes/param):
- predicted cost +0.0017 +- 0.0007 nats (weights; the cheapest choice whose prediction plus two standard errors stays under the margin of 0.01 nats)
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
