"""float32 division, exp and sigmoid inside Triton kernels as torch's CUDA kernels compute them, so a kernel's
float32 math lands on torch's bits: division IEEE-rounded (triton's `/` is approximate on the GPU), exp CUDA's
expf from libdevice (triton's tl.exp is a faster approximation), sigmoid 1 / (1 + exp(-x)) as torch writes it.
Triton's interpreter has no libdevice: there exp is numpy's (kernels pass LIBDEVICE = not INTERPRETED)."""

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"       # read once: the interpreter is chosen at import


@triton.jit
def div(x, y):
    """x / y rounded as IEEE division, broadcast first."""
    x, y = tl.broadcast(x, y)
    return tl.div_rn(x, y)


@triton.jit
def exp(x, LIBDEVICE: tl.constexpr):
    """exp as CUDA's expf on the GPU (libdevice), numpy's under the interpreter."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def sigmoid(x, LIBDEVICE: tl.constexpr):
    """1 / (1 + exp(-x)), torch's sigmoid formula, in float32."""
    return div(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp(-x, LIBDEVICE))
