"""A decode step's few-row projections as a split-K GEMV, and the projection, the residual add and the next RMSNorm
in two launches instead of three (a library GEMM, its split-K reduce, the norm):

    parts kernel, program (N block, K split)   parts[s, m, n] = x[m, K slice s] · w[n, K slice s]   (float32)
    sum kernel, program (row)                  y[m] = round(parts[0, m] + parts[1, m] + ...)        (splits in order)
    a wide projection (N >= ONE_SLICE_FROM)    one K slice, rounded and stored by the parts kernel: one launch, the
                                               bits the sum kernel would give
    parts-norm kernel, program (row block)     y as the sum kernel; s = round(y + residual) -> written, the next
                                               residual; out = the RMSNorm of s (rmsnorm's own body and tiles)

The parts-norm kernel's bits are the sum kernel's then triton_rmsnorm's rms_norm with a residual, op for op. The
config (tiles, splits, warps, stages) is a function of nothing but the weight's shape (`splits_for`),
and a row's products read only its own x row: a row's bits are the same alone or among up to ROWS_UP_TO rows.
Float32 dots run in IEEE float32 (no TF32); bfloat16 dots accumulate in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import linear_norm, pdl
from tensorfold.kernels.linear_norm import ROWS_UP_TO, SPLIT_K
from tensorfold.kernels.rmsnorm.triton_rmsnorm import blocks, normalise_rows
from tensorfold.kernels.strides import row_major
from tensorfold.kernels.triton_rounding import round_to

BLOCK_N = 32        # output features per program
BLOCK_K = 256       # reduction step
NUM_WARPS = 4
NUM_STAGES = 3      # software pipelining depth of the K loop


@triton.jit
def _parts_kernel(x_ptr, w_ptr, parts_ptr, M, N, K, K_SLICE, s_xm, s_wn, s_ps, s_pm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                  ROUND: tl.constexpr = False, PDL: tl.constexpr = False):
    """parts[split, rows, n block] = x[rows, K slice] · w[n block, K slice]ᵀ in float32 (ROUND: one slice, rounded
    to parts' dtype, the finished projection)."""
    pdl.ordered(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    begin = split * K_SLICE
    for k0 in range(0, K_SLICE, BLOCK_K):
        step = k0 + tl.arange(0, BLOCK_K)
        kk = begin + step
        k_ok = (kk < K) & (step < K_SLICE)
        a = tl.load(x_ptr + rows[:, None] * s_xm + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + n[None, :].to(tl.int64) * s_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if ROUND:
        acc = round_to(acc, parts_ptr.dtype.element_ty)
    tl.store(parts_ptr + split * s_ps + rows[:, None] * s_pm + n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def summed(parts_ptr, offsets, mask, s_ps, SPLITS: tl.constexpr, ty: tl.constexpr):
    """The splits' partial sums at `offsets` (within a split) added in split order, rounded once to ty (kept as
    float32)."""
    acc = tl.load(parts_ptr + offsets, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc = acc + tl.load(parts_ptr + s * s_ps + offsets, mask=mask, other=0.0)
    return round_to(acc, ty)


@triton.jit
def _sum_kernel(parts_ptr, out_ptr, M, N, s_ps, s_pm, s_om, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                PDL: tl.constexpr = False):
    """out[row] = the splits' sum, rounded to out's dtype."""
    pdl.ordered(PDL)
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    y = summed(parts_ptr, rows[:, None] * s_pm + cols[None, :], mask, s_ps, SPLITS, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * s_om + cols[None, :], y, mask=mask)


@triton.jit
def _parts_norm_kernel(parts_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, M, D, s_ps, s_pm, s_r, s_o, s_s, eps,
                       SPLITS: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Rows [program · BLOCK_N, +BLOCK_N): the splits' sum, + residual, normalised (module docstring)."""
    pdl.ordered(PDL)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    ty = out_ptr.dtype.element_ty
    y = summed(parts_ptr, rows[:, None] * s_pm + cols[None, :], mask, s_ps, SPLITS, ty)
    r = tl.load(r_ptr + rows[:, None] * s_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = round_to(y + r, ty)
    tl.store(sum_ptr + rows[:, None] * s_s + cols[None, :], x, mask=mask)
    normalise_rows(x, rows, cols, mask, w_ptr, out_ptr, s_o, D, eps, ZERO_CENTRED, False)


def splits_for(N: int) -> int:
    """K slices of a projection to N features: one where N blocks alone fill the SMs, else SPLIT_K."""
    return 1 if N >= linear_norm.ONE_SLICE_FROM else SPLIT_K


def _launch_parts(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, splits: int, round_out: bool) -> None:
    M, K = x.shape
    N = weight.shape[0]
    if M > ROWS_UP_TO:
        raise ValueError(f"linear_norm: at most {ROWS_UP_TO} rows, got {M}")
    k_slice = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
    _parts_kernel[(triton.cdiv(N, BLOCK_N), splits)](
        x, weight, out, M, N, K, k_slice, x.stride(0), weight.stride(0), out.stride(0) if splits > 1 else 0,
        out.stride(-2), BLOCK_M=ROWS_UP_TO, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ROUND=round_out, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES, **pdl.options(x))


def parts(x: torch.Tensor, weight: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= ROWS_UP_TO), weight [N, K] -> float32 partial sums [splits, M, N] (split s over K slice s;
    splits: the shape's, splits_for(N), unless given)."""
    x, weight = row_major(x), row_major(weight)
    splits = splits_for(weight.shape[0]) if splits is None else splits
    out = torch.empty((splits, x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    _launch_parts(x, weight, out, splits, round_out=False)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Launcher: x [M, K], weight [N, K] -> x @ weightᵀ [M, N] in x's dtype."""
    M, N = x.shape[0], weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    splits = splits_for(N)
    if splits == 1:                                   # the parts kernel rounds and stores the projection itself
        _launch_parts(row_major(x), row_major(weight), out, 1, round_out=True)
        return out
    p = parts(x, weight, splits)
    _sum_kernel[(M,)](p, out, M, N, p.stride(0), p.stride(1), out.stride(0), SPLITS=splits,
                      BLOCK_D=triton.next_power_of_2(N), num_warps=4, **pdl.options(x))
    return out


def linear_then_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: x [M, K], weight [D, K], residual [M, D], norm_weight [D] -> (the norm of s, s = residual +
    x @ weightᵀ), each [M, D] in x's dtype."""
    M, D = residual.shape
    out = torch.empty_like(residual)
    total = torch.empty_like(residual)
    if M == 0 or D == 0:
        return out, total
    p = parts(x, weight)
    block_n, block_d, num_warps, grid = blocks(M, D)
    _parts_norm_kernel[grid](p, residual, norm_weight.contiguous(), out, total, M, D, p.stride(0), p.stride(1),
                             residual.stride(0), out.stride(0), total.stride(0), float(eps), SPLITS=p.shape[0],
                             ZERO_CENTRED=zero_centred, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
                             **pdl.options(x))
    return out, total
