"""Triton depthwise causal conv + SiLU: a chunk of one stream (prefill, K <= 4) and one row per stream (decode).
Each updates the tails in the same launch.

Accumulates in float32, rounds the conv to the input dtype before the SiLU (as F.conv1d then F.silu do), then
rounds again. bfloat16 rounding is done on the bits (round to nearest even), because triton's interpreter
truncates on `.to(tl.bfloat16)`; on the GPU it is the same rounding as cvt.rn. Inputs are validated by the
package's `__init__`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl
from tensorfold.kernels.strides import row_major
from tensorfold.kernels.triton_rounding import round_to

MAX_PREFILL_K = 4           # the prefill kernel keeps K-1 <= 3 rows of history in registers


@triton.jit
def _silu_rounded(acc, ty: tl.constexpr):
    """The conv result rounded to the output dtype (F.conv1d's output), then SiLU in float32, rounded again."""
    v = round_to(acc, ty)
    return round_to(v / (1.0 + tl.exp(-v)), ty)


@triton.jit
def _window_row(x_ptr, tail_ptr, src, c, c_ok, stride_xt, stride_tc, stride_tk, K: tl.constexpr):
    """Row src of [tailᵀ | x] (float32, [BC]): x[src] for src >= 0, else tail column K-1+src, else zeros."""
    from_x = src >= 0
    xv = tl.load(x_ptr + src.to(tl.int64) * stride_xt + c, mask=c_ok & from_x, other=0.0)
    tv = tl.load(tail_ptr + c * stride_tc + (K - 1 + src) * stride_tk, mask=c_ok & ~from_x & (K - 1 + src >= 0),
                 other=0.0)
    return tl.where(from_x, xv, tv).to(tl.float32)


@triton.jit
def _prefill_kernel(x_ptr, w_ptr, b_ptr, tail_ptr, y_ptr, T, C,
                    stride_xt, stride_wc, stride_tc, stride_tk, stride_yt,
                    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows [t0, t0 + BLOCK_T) of one channel block, K <= 4, the last K-1 inputs kept in registers (h1 = row
    t-1, ...). Only the first row block touches the tail (BLOCK_T >= K-1): it reads it, then rewrites it last."""
    pid_t = tl.program_id(0)
    t0 = pid_t * BLOCK_T
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    w0 = tl.load(w_ptr + c * stride_wc + (K - 1), mask=c_ok, other=0.0).to(tl.float32)     # tap on row t
    w1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    w2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    w3 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    h1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    h2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    h3 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if K >= 2:
        w1 = tl.load(w_ptr + c * stride_wc + (K - 2), mask=c_ok, other=0.0).to(tl.float32)
        h1 = _window_row(x_ptr, tail_ptr, t0 - 1, c, c_ok, stride_xt, stride_tc, stride_tk, K)
    if K >= 3:
        w2 = tl.load(w_ptr + c * stride_wc + (K - 3), mask=c_ok, other=0.0).to(tl.float32)
        h2 = _window_row(x_ptr, tail_ptr, t0 - 2, c, c_ok, stride_xt, stride_tc, stride_tk, K)
    if K >= 4:
        w3 = tl.load(w_ptr + c * stride_wc + (K - 4), mask=c_ok, other=0.0).to(tl.float32)
        h3 = _window_row(x_ptr, tail_ptr, t0 - 3, c, c_ok, stride_xt, stride_tc, stride_tk, K)
    bias = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    for i in tl.static_range(BLOCK_T):
        t = t0 + i
        ok = c_ok & (t < T)
        xt = tl.load(x_ptr + t.to(tl.int64) * stride_xt + c, mask=ok, other=0.0).to(tl.float32)
        acc = xt * w0
        if K >= 2:
            acc += h1 * w1
        if K >= 3:
            acc += h2 * w2
        if K >= 4:
            acc += h3 * w3
        if HAS_BIAS:
            acc += bias
        tl.store(y_ptr + t.to(tl.int64) * stride_yt + c, _silu_rounded(acc, y_ptr.dtype.element_ty), mask=ok)
        h3 = h2
        h2 = h1
        h1 = xt
    if pid_t == 0:                                 # tail[c, j] <- window column T + j, for increasing j: column
        for j in tl.static_range(K - 1):           # T + j > j still holds the old tail when it is read
            src = T - (K - 1) + j
            from_x = src >= 0
            xv = tl.load(x_ptr + src.to(tl.int64) * stride_xt + c, mask=c_ok & from_x, other=0.0)
            tv = tl.load(tail_ptr + c * stride_tc + (T + j) * stride_tk, mask=c_ok & ~from_x, other=0.0)
            tl.store(tail_ptr + c * stride_tc + j * stride_tk, tl.where(from_x, xv, tv), mask=c_ok)


@triton.jit
def _update_kernel(x_ptr, w_ptr, b_ptr, tails_ptr, slots_ptr, y_ptr, C,
                   stride_xb, stride_wc, stride_ts, stride_tc, stride_tk, stride_yb,
                   K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """One row of stream b: y = silu([tail | x] · w), and its tail (at tails[slots[b]]) shifts left by one.
    A negative slot is a padded row: no tail read or written, y = 0."""
    pdl.ordered(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = slot >= 0
    c_ok = (c < C) & live
    tail = tails_ptr + slot * stride_ts + c * stride_tc                            # [BC] pointers, column 0
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for k in tl.static_range(K - 1):                                               # each thread loads column k
        v = tl.load(tail + k * stride_tk, mask=c_ok, other=0.0)                    # before it writes column k
        acc += v.to(tl.float32) * tl.load(w_ptr + c * stride_wc + k, mask=c_ok, other=0.0).to(tl.float32)
        if k > 0:
            tl.store(tail + (k - 1) * stride_tk, v, mask=c_ok)
    xv = tl.load(x_ptr + b.to(tl.int64) * stride_xb + c, mask=c_ok, other=0.0)
    acc += xv.to(tl.float32) * tl.load(w_ptr + c * stride_wc + (K - 1), mask=c_ok, other=0.0).to(tl.float32)
    if K > 1:
        tl.store(tail + (K - 2) * stride_tk, xv, mask=c_ok)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    y = tl.where(live, _silu_rounded(acc, y_ptr.dtype.element_ty), 0.0)
    tl.store(y_ptr + b.to(tl.int64) * stride_yb + c, y.to(y_ptr.dtype.element_ty), mask=c < C)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor,
                          bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: x [T, C], weight [C, K <= MAX_PREFILL_K], tail [C, K-1] (in place), bias [C] | None -> [T, C],
    written into `out` when given (unit stride on C: rows of a wider buffer)."""
    x, weight = row_major(x), row_major(weight)
    T, C = x.shape
    K = weight.shape[1]
    if K > MAX_PREFILL_K:
        raise ValueError(f"causal_conv1d_prefill (triton): kernel width K <= {MAX_PREFILL_K}, got {K}")
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if T == 0 or C == 0:
        return y
    block_t, block_c = 8, 512                      # ~2.4 TB/s at T=4096, C=10240 on an H200; needs block_t >= K-1
    grid = (triton.cdiv(T, block_t), triton.cdiv(C, block_c))
    _prefill_kernel[grid](x, weight, bias if bias is not None else x, tail, y, T, C,
                          x.stride(0), weight.stride(0), tail.stride(0), tail.stride(1), y.stride(0),
                          K=K, HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    return y


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor, slots: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: x [B, C], weight [C, K], tails [S, C, K-1] (rows at slots, in place), slots [B] -> [B, C]."""
    x, weight = row_major(x), row_major(weight)
    B, C = x.shape
    K = weight.shape[1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if B == 0 or C == 0:
        return y
    block_c = 256
    _update_kernel[(B, triton.cdiv(C, block_c))](
        x, weight, bias if bias is not None else x, tails, slots, y, C,
        x.stride(0), weight.stride(0), tails.stride(0), tails.stride(1), tails.stride(2), y.stride(0),
        K=K, HAS_BIAS=bias is not None, BLOCK_C=block_c, num_warps=4, **pdl.options(x))
    return y
