"""Flax NNX training with weights stored in any dtype, float8 included.

`nnx.Optimizer.update` applies updates with `optax.apply_updates`, which
cannot add float32 deltas to float8 params (JAX refuses the implicit
promotion). `lowprec.nnx.Optimizer` is `nnx.Optimizer` with that one step
done by `lowprec.apply_updates`, which widens, adds and casts back. Its
state, checkpoints and `nnx.jit` behaviour are those of `nnx.Optimizer`.
"""

from __future__ import annotations

from flax import nnx

from lowprec.engine.weights import apply_updates


class Optimizer(nnx.Optimizer):
  """`nnx.Optimizer` that lands updates in every storage dtype.

  Same arguments and behaviour as `flax.nnx.Optimizer`; `update` adds the
  updates with `lowprec.apply_updates`, so params stored as float8 (or
  float16, bfloat16, float32) keep their dtype and, with the deltas of
  `lowprec.writeback`, land exactly on their grid. With float8 params, run
  the optimizer in float32 (`lowprec.in_float32`): NNX gradients come in
  the params' dtype.

  Example:
    ```python
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    rules = [(r".*bias", None), (r".*", "float8_e4m3fn")]
    params = nnx.state(model, nnx.Param)
    nnx.update(model, lowprec.to_grid(params, rules, storage="native"))
    tx = optax.chain(lowprec.in_float32(optax.adam(1e-2)),
                     lowprec.writeback(rules))
    opt = lowprec.nnx.Optimizer(model, tx, wrt=nnx.Param)
    opt.update(model, nnx.grad(loss_fn)(model))
    ```
  """

  def update(self, model, grads, /, **kwargs):
    """Updates the optimizer state and the params given the gradients."""
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    updates, new_state = self.tx.update(
      grads, nnx.as_pure(self.opt_state), params, **nnx.as_pure(kwargs)
    )
    nnx.update(model, apply_updates(params, updates))
    nnx.update(self.opt_state, nnx.state(new_state, graph=self.graph))
    self.step[...] += 1
    return updates
