"""Triton partial rotate-half RoPE: one program per (row, block of heads), angles computed in the kernel.

Float32 angles position · inv_freq; cos/sin from libdevice (full range reduction: positions reach 10^5-10^6
radians) on the GPU, tl.cos/tl.sin under the interpreter (numpy). Each product and the sum are rounded to x's
dtype as the reference's x·cos + rot(x)·sin in that dtype is, and each product is taken apart from the sum (never
contracted into an FMA: libdevice's mul_rn), as torch's separate ops take it; bfloat16 rounding is done on the
bits (nearest even), because the interpreter truncates on `.to(tl.bfloat16)`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tensorfold.kernels import pdl
from tensorfold.kernels.triton_rounding import round_to

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"      # libdevice has no interpreter version


@triton.jit
def product(a, b, LIBDEVICE: tl.constexpr):
    """a · b rounded on its own: on the GPU the compiler may not fuse it into a following add (an FMA would round
    the float32 sum of two products differently from torch's ops and from another kernel's choice of FMA)."""
    if LIBDEVICE:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, H, D, stride_xn, stride_xh, stride_on, stride_oh,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                 LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    """out[n, h, :R] = rotate-half(x[n, h, :R]) at angle positions[n]·inv_freq; out[n, h, R:] = x[n, h, R:]."""
    pdl.ordered(PDL)
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)                     # [BH]
    half = tl.arange(0, BLOCK_HALF)                                                # [BR] columns of one half
    h_ok = heads < H
    ty = out_ptr.dtype.element_ty
    angle = tl.load(pos_ptr + n).to(tl.float32) * tl.load(freq_ptr + half, mask=half < HALF, other=0.0).to(tl.float32)
    if LIBDEVICE:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    cos, sin = round_to(cos, ty)[None, :], round_to(sin, ty)[None, :]                  # [1, BR] in x's dtype
    mask = h_ok[:, None] & (half < HALF)[None, :]
    x_row = x_ptr + n * stride_xn + heads[:, None] * stride_xh                     # [BH, 1]
    o_row = out_ptr + n * stride_on + heads[:, None] * stride_oh
    first = tl.load(x_row + half[None, :], mask=mask, other=0.0).to(tl.float32)
    second = tl.load(x_row + HALF + half[None, :], mask=mask, other=0.0).to(tl.float32)
    out_first = round_to(round_to(product(first, cos, LIBDEVICE), ty) + round_to(-product(second, sin, LIBDEVICE), ty),
                         ty)
    out_second = round_to(round_to(product(second, cos, LIBDEVICE), ty) + round_to(product(first, sin, LIBDEVICE), ty),
                          ty)
    tl.store(o_row + half[None, :], out_first, mask=mask)
    tl.store(o_row + HALF + half[None, :], out_second, mask=mask)
    if BLOCK_PASS > 0:                                                             # the non-rotary tail
        rest = 2 * HALF + tl.arange(0, BLOCK_PASS)
        pass_mask = h_ok[:, None] & (rest < D)[None, :]
        tl.store(o_row + rest[None, :], tl.load(x_row + rest[None, :], mask=pass_mask), mask=pass_mask)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Launcher: x [N, H, D], positions [N], inv_freq [R/2], R = rotary_dim -> new [N, H, D]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    N, H, D = x.shape
    out = torch.empty((N, H, D), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(max(half, 1))
    block_pass = triton.next_power_of_2(D - rotary_dim) if D > rotary_dim else 0
    fits = max(1, 8192 // (2 * block_half + block_pass))                           # heads in ~8k elements
    block_h = min(triton.next_power_of_2(H), 1 << (fits.bit_length() - 1))         # a power of two
    grid = (N, triton.cdiv(H, block_h))
    _rope_kernel[grid](x, positions, inv_freq.contiguous(), out, H, D, x.stride(0), x.stride(1),
                       out.stride(0), out.stride(1), HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
                       BLOCK_PASS=block_pass, LIBDEVICE=not _INTERPRETED, num_warps=4, **pdl.options(x))
    return out
