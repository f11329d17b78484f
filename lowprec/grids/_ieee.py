"""Division and square root rounded as IEEE 754 rounds them, in XLA's
programs and in Pallas kernels alike.

XLA compiles a float32 `a / b` and `sqrt(x)` to correctly rounded
instructions on CPU and GPU. Triton, Pallas's GPU backend, does not: it
lowers a float32 division to PTX's `div.full.f32`, which is within two
ulps of the quotient, so a kernel written with `/` would not give the
bits an XLA program gives. Code shared by both divides with `div` and
takes roots with `sqrt`: the plain operations (the same jaxpr as `/` and
`jnp.sqrt`), except while a kernel is traced for CUDA inside `ptx()`,
where they are PTX's correctly rounded `div.rn.f32` and `sqrt.rn.f32`.
JAX reuses the trace of a function it has traced before with the same
shapes whatever the context, so `ptx()` must be open while a function
is traced for the first time: the kernel's body is a fresh partial
each time, with whether it is traced for Triton among its arguments.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton

_PTX = contextvars.ContextVar("lowprec_ptx", default=False)


@contextlib.contextmanager
def ptx(enabled: bool = True):
  """While open (and `enabled`), `div` and `sqrt` trace to PTX's
  correctly rounded instructions: for a Pallas kernel traced for Triton."""
  token = _PTX.set(enabled)
  try:
    yield
  finally:
    _PTX.reset(token)


def active() -> bool:
  """Whether `div` and `sqrt` trace to PTX here."""
  return _PTX.get()


def div(a, b):
  """`a / b`, correctly rounded (float32 under `ptx()`)."""
  if not _PTX.get():
    return a / b
  return _asm("div.rn.f32 $0, $1, $2;", a, b)


def sqrt(x):
  """`sqrt(x)`, correctly rounded (float32 under `ptx()`)."""
  if not _PTX.get():
    return jnp.sqrt(x)
  return _asm("sqrt.rn.f32 $0, $1;", x)


def _asm(code: str, *args):
  """One PTX instruction on float32 `args`, broadcast to one shape."""
  shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
  args = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in args]
  (out,) = triton.elementwise_inline_asm(
    code,
    args=args,
    constraints=",".join(["=f"] + ["f"] * len(args)),
    pack=1,
    result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)],
  )
  return out
