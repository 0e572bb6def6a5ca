"""A decode step's attention inputs in one launch: the q and k heads' zero-centred RMSNorm and partial RoPE, and the
k and v rows written to their pages — six launches of the unfused form (two norms, two ropes, two writes).

    program (row n, head slot j):  j < H a query head, H <= j < H + KV a key head, past that a value head
        q, k:  x̂ = round((x · rstd) · (1 + w))  over the head's D (rstd = 1 / sqrt(Σx² / D + eps), float32)
               rotate-half RoPE of x̂'s first R columns at angle position · inv_freq (cos, sin rounded to x's dtype,
               each product and the sum rounded as the reference's x·cos + rot(x)·sin), the rest as x̂
        q -> q_out[n, j];  k, v -> the pages' flat row dest[n] (a negative dest writes nothing)

The same per-element arithmetic as the rms_norm and rope kernels (tensorfold.kernels); a head's sum of squares is
one reduction over its D inside one program, so a row's bits do not depend on the batch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tensorfold.kernels import pdl
from tensorfold.kernels.rope.triton_rope import product
from tensorfold.kernels.triton_rounding import round_to

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"      # libdevice has no interpreter version


@triton.jit
def _normed_rotated(base, weight, n, positions, inv_freq, eps, ty: tl.constexpr, D: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                    NORM_ROWS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """One head's D values at `base`: normalised (rms_norm's arithmetic), then rotated (rope's): the two halves of
    the rotary part and the tail, each float32 holding values of dtype ty."""
    # the sum of squares in the rms_norm kernel's [NORM_ROWS, BLOCK_D] tile (this head in row 0, the rest
    # masked), so its layout, and so its reduction order, are that kernel's
    cols = tl.arange(0, BLOCK_D)
    first_row = tl.arange(0, NORM_ROWS) == 0
    x = tl.load(base + (tl.arange(0, NORM_ROWS) * 0)[:, None] + cols[None, :],
                mask=first_row[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
    squares = tl.sum(tl.where(first_row, tl.sum(x * x, axis=1), 0.0), axis=0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(squares / D + eps))
    half = tl.arange(0, BLOCK_HALF)
    h_ok = half < HALF
    first = tl.load(base + half, mask=h_ok, other=0.0).to(tl.float32)
    second = tl.load(base + HALF + half, mask=h_ok, other=0.0).to(tl.float32)
    first = round_to((first * rstd) * (1.0 + tl.load(weight + half, mask=h_ok, other=0.0).to(tl.float32)), ty)
    second = round_to((second * rstd) * (1.0 + tl.load(weight + HALF + half, mask=h_ok, other=0.0).to(tl.float32)),
                      ty)
    angle = tl.load(positions + n).to(tl.float32) * tl.load(inv_freq + half, mask=h_ok, other=0.0).to(tl.float32)
    if LIBDEVICE:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    cos, sin = round_to(cos, ty), round_to(sin, ty)
    out_first = round_to(round_to(product(first, cos, LIBDEVICE), ty) + round_to(-product(second, sin, LIBDEVICE), ty),
                         ty)
    out_second = round_to(round_to(product(second, cos, LIBDEVICE), ty) + round_to(product(first, sin, LIBDEVICE), ty),
                          ty)
    rest = 2 * HALF + tl.arange(0, BLOCK_PASS)
    r_ok = rest < D
    tail = tl.load(base + rest, mask=r_ok, other=0.0).to(tl.float32)
    tail = round_to((tail * rstd) * (1.0 + tl.load(weight + rest, mask=r_ok, other=0.0).to(tl.float32)), ty)
    return out_first, out_second, tail


@triton.jit
def _inputs_kernel(proj, q_norm, k_norm, positions, inv_freq, q_out, k_flat, v_flat, dest, eps,
                   s_pn, s_qn, s_qh, s_kf, s_vf,
                   H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                   NORM_ROWS: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    """One head of one row (module docstring)."""
    pdl.ordered(PDL)
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    ty = q_out.dtype.element_ty
    row = proj + n * s_pn
    target = tl.load(dest + n)
    half = tl.arange(0, BLOCK_HALF)
    h_ok = half < HALF
    rest = 2 * HALF + tl.arange(0, BLOCK_PASS)
    r_ok = rest < D
    if j < H:                                                                      # a query head: q_out
        first, second, tail = _normed_rotated(row + j * 2 * D, q_norm, n, positions, inv_freq, eps, ty, D, HALF,
                                              BLOCK_D, BLOCK_HALF, BLOCK_PASS, NORM_ROWS, LIBDEVICE)
        dst = q_out + n * s_qn + j * s_qh
        tl.store(dst + half, first, mask=h_ok)
        tl.store(dst + HALF + half, second, mask=h_ok)
        tl.store(dst + rest, tail, mask=r_ok)
    elif j < H + KV:                                                               # a key head: its page row
        first, second, tail = _normed_rotated(row + 2 * H * D + (j - H) * D, k_norm, n, positions, inv_freq, eps,
                                              ty, D, HALF, BLOCK_D, BLOCK_HALF, BLOCK_PASS, NORM_ROWS, LIBDEVICE)
        dst = k_flat + target * s_kf + (j - H) * D
        live = target >= 0
        tl.store(dst + half, first, mask=h_ok & live)
        tl.store(dst + HALF + half, second, mask=h_ok & live)
        tl.store(dst + rest, tail, mask=r_ok & live)
    else:                                                                          # a value head: copied
        cols = tl.arange(0, BLOCK_D)
        head = j - H - KV
        ok = (cols < D) & (target >= 0)
        v = tl.load(row + 2 * H * D + KV * D + head * D + cols, mask=ok)
        tl.store(v_flat + target * s_vf + head * D + cols, v, mask=ok)


def norm_tile(D: int) -> tuple[int, int, int]:
    """(BLOCK_D, rows, warps) of core's rms_norm launch over rows of D (its `blocks` rule): the tile the sum of
    squares is taken in."""
    block_d = triton.next_power_of_2(D)
    rows = max(1, min(64, 2048 // block_d))
    tile = rows * block_d
    return block_d, rows, 4 if tile <= 8192 else 8 if tile <= 16384 else 16


def attention_inputs(proj: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                     positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int, heads: int, kv_heads: int,
                     head_dim: int, k_pages: torch.Tensor, v_pages: torch.Tensor, dest: torch.Tensor
                     ) -> torch.Tensor:
    """proj [N, 2·H·D + 2·KV·D] (q and gate interleaved per head, then k, then v) -> q [N, H, D], normalised and
    rotated; k (normalised, rotated) and v written to row dest[n] of the pages [P, R, KV, D] (contiguous)."""
    N = proj.shape[0]
    H, KV, D = heads, kv_heads, head_dim
    q = torch.empty((N, H, D), dtype=proj.dtype, device=proj.device)
    if N == 0:
        return q
    half = rotary_dim // 2
    block_d, norm_rows, warps = norm_tile(D)
    k_flat = k_pages.view(k_pages.shape[0] * k_pages.shape[1], -1)
    v_flat = v_pages.view(v_pages.shape[0] * v_pages.shape[1], -1)
    _inputs_kernel[(N, H + 2 * KV)](
        proj, q_norm, k_norm, positions, inv_freq.contiguous(), q, k_flat, v_flat, dest, float(eps),
        proj.stride(0), q.stride(0), q.stride(1), k_flat.stride(0), v_flat.stride(0),
        H=H, KV=KV, D=D, HALF=half, BLOCK_D=block_d, NORM_ROWS=norm_rows,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_PASS=triton.next_power_of_2(D - rotary_dim) if D > rotary_dim else 1,
        LIBDEVICE=not _INTERPRETED, num_warps=warps, **pdl.options(proj))
    return q
