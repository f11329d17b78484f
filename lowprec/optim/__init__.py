"""Optax transforms: training with weights and optimizer state stored low.

Write-back without master weights (`writeback`; `compensated`: Kahan,
two-component, remainder; `eco` and its closed-form fold, `eco_fold`;
`split`), optimizer state in low
precision (`stored_state`; Adam with 8- or 4-bit moments in one Pallas kernel
per leaf, `fused_adam`, and with the write-back too, `fused_adamw`; the
write-back in one kernel per leaf, `writeback_kernel`), named recipes and
tensor groups (`recipes`, `groups`), what each transform counted
(`telemetry`), bytes per parameter (`memory`), float32 views of stored
weights (`float32_views`) and the Flax NNX optimizer (`nnx`).

May import: lowprec.grids, lowprec.engine.
"""
