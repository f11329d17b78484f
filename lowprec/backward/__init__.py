"""The backward pass: what it reads from tensors the forward rounded.

`policy` names, use by use, the value each backward read takes;
`ops` holds `jax.custom_vjp` operators that follow a policy (dense,
norm-dense, attention, activation, block-scaled dense, and `Custom` for
your own); `nn` wraps them as Flax modules and a GPT; `audit` derives each
operator's requirements and checks a policy against the reference gradient
by Monte Carlo.

May import: lowprec.grids, lowprec.engine.
"""
