"""Triton RMSNorm (plain / zero-centred, optionally fused with the residual add) and the gated GDN norm.

Each program normalises BLOCK_N rows held whole in registers (D <= 65536). Float32 math in the reference's order;
1/sqrt is IEEE-rounded (div_rn, sqrt_rn) like torch.rsqrt on the CPU. bfloat16 rounding is done on the bits
(nearest even), because triton's interpreter truncates on `.to(tl.bfloat16)`; on the GPU it equals cvt.rn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl
from tensorfold.kernels.strides import row_major
from tensorfold.kernels.triton_rounding import round_to


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, N, D, stride_x, stride_r, stride_o, stride_s, eps,
                     ZERO_CENTRED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHT_AFTER_CAST: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    """out = (x·rstd)·(1 + w | w); with a residual, x <- round(x + r) first and written to sum_ptr.
    WEIGHT_AFTER_CAST: out = w · round(x·rstd)."""
    pdl.ordered(PDL)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)      # [BN]
    cols = tl.arange(0, BLOCK_D)                                                   # [BD]
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    ty = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, ty)
        tl.store(sum_ptr + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
    normalise_rows(x, rows, cols, mask, w_ptr, out_ptr, stride_o, D, eps, ZERO_CENTRED, WEIGHT_AFTER_CAST)


@triton.jit
def normalise_rows(x, rows, cols, mask, w_ptr, out_ptr, stride_o, D, eps, ZERO_CENTRED: tl.constexpr,
                   WEIGHT_AFTER_CAST: tl.constexpr):
    """The norm of float32 rows x [BN, BD] written to out: one body for every kernel that ends in this norm
    (the plain one above, the experts' sum-and-norm), so a row's bits are the same from each."""
    ty = out_ptr.dtype.element_ty
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps))           # [BN]
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        w = 1.0 + w
    if WEIGHT_AFTER_CAST:
        out = w[None, :] * round_to(x * rstd[:, None], ty)
    else:
        out = (x * rstd[:, None]) * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], round_to(out, ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, N, D, stride_x, stride_z, stride_o, eps,
                           z_heads, stride_zh,
                           ROUND_WN: tl.constexpr, Z_BY_HEAD: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """out = round(round_wn(w · round(x·rstd)) · silu(z)), rows of D (every head of every token). With
    Z_BY_HEAD, z's row r is head r % z_heads of token r // z_heads (strides stride_z, stride_zh)."""
    pdl.ordered(PDL)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    ty = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps))
    normed = round_to(x * rstd[:, None], ty)                                         # x̂ in x's dtype
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    wn = w[None, :] * normed
    if ROUND_WN:                                                                   # w · x̂ is in x's dtype
        wn = round_to(wn, ty)
    if Z_BY_HEAD:
        z_rows = (rows // z_heads) * stride_z + (rows % z_heads) * stride_zh
    else:
        z_rows = rows * stride_z
    z = tl.load(z_ptr + z_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = wn * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], round_to(out, ty), mask=mask)


@triton.jit
def _grouped_gated_kernel(y_ptr, z_ptr, w_ptr, out_ptr, stride_y, stride_z, stride_o, eps,
                          GROUP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One (row, group): g = y·silu(z); out = round(w · round(g·rstd)) over the group's GROUP channels."""
    pdl.ordered(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * GROUP + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < GROUP
    ty = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    gated = y * (z / (1.0 + tl.exp(-z)))
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(gated * gated, axis=0) / GROUP + eps))
    normed = round_to(gated * rstd, ty)                                            # to weight's dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, round_to(w * normed, ty), mask=mask)


def blocks(N: int, D: int) -> tuple[int, int, int, tuple[int]]:
    """BLOCK_N, BLOCK_D, num_warps and grid: whole rows, about 2k-4k elements per program."""
    block_d = triton.next_power_of_2(D)
    block_n = max(1, min(64, 2048 // block_d))
    tile = block_n * block_d
    num_warps = 4 if tile <= 8192 else 8 if tile <= 16384 else 16      # 4 beat 8 and 16 at D=5120 on an H200
    return block_n, block_d, num_warps, (triton.cdiv(N, block_n),)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, D] with a unit stride on D (a copy only when needed)."""
    return row_major(t.reshape(-1, t.shape[-1]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centred: bool,
             residual: torch.Tensor | None = None, weight_after_cast: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launcher: x [N, D], weight [D] (residual [N, D]) -> out [N, D] (and x + residual)."""
    x, weight = _rows(x), weight.contiguous()
    N, D = x.shape
    out = torch.empty((N, D), dtype=x.dtype, device=x.device)
    total = None if residual is None else torch.empty_like(out)
    if N > 0 and D > 0:
        r = x if residual is None else _rows(residual)
        s = out if total is None else total
        block_n, block_d, num_warps, grid = blocks(N, D)
        _rms_norm_kernel[grid](x, r, weight, out, s, N, D, x.stride(0), r.stride(0), out.stride(0), s.stride(0),
                               float(eps), ZERO_CENTRED=zero_centred, HAS_RESIDUAL=residual is not None,
                               BLOCK_N=block_n, BLOCK_D=block_d, WEIGHT_AFTER_CAST=weight_after_cast,
                               num_warps=num_warps, **pdl.options(x))
    return out if total is None else (out, total)


def _by_head(z: torch.Tensor) -> bool:
    """Whether z [N, H, D] is read in place, token and head strides apart: where viewing it as rows would copy it
    (heads cut from a wider projection), and only where its loads vectorise as that contiguous copy's would
    (16-byte aligned base; D and both strides multiples of 16 elements), so the kernel's layouts, and so its
    bits, are the copy's."""
    N, H, D = z.shape
    if N < 2 or H < 2 or z.stride(2) != 1 or z.stride(0) == H * z.stride(1):
        return False
    return z.data_ptr() % 16 == 0 and D % 16 == 0 and z.stride(0) % 16 == 0 and z.stride(1) % 16 == 0


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launcher: x, z [N, H, D], weight [D] -> [N, H, D] in x's dtype."""
    shape = x.shape
    by_head = _by_head(z)
    z_heads, stride_zh = (z.shape[1], z.stride(1)) if by_head else (1, 0)
    x, weight = _rows(x), weight.contiguous()
    z = z if by_head else _rows(z)
    rows, D = x.shape
    out = torch.empty((rows, D), dtype=x.dtype, device=x.device)
    if rows > 0 and D > 0:
        round_wn = x.dtype != torch.float32 and torch.promote_types(weight.dtype, x.dtype) == x.dtype
        block_n, block_d, num_warps, grid = blocks(rows, D)
        _gated_rms_norm_kernel[grid](x, z, weight, out, rows, D, x.stride(0), z.stride(0), out.stride(0),
                                     float(eps), z_heads, stride_zh, ROUND_WN=round_wn, Z_BY_HEAD=by_head,
                                     BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, **pdl.options(x))
    return out.view(shape)


def grouped_gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                           eps: float) -> torch.Tensor:
    """Launcher: y, z [N, I], weight [I] -> [N, I] in weight's dtype; one program per (row, group)."""
    y, z, weight = _rows(y), _rows(z), weight.contiguous()
    rows, width = y.shape
    out = torch.empty((rows, width), dtype=weight.dtype, device=y.device)
    if rows > 0 and width > 0:
        group = width // groups
        block = triton.next_power_of_2(group)
        num_warps = 4 if block <= 2048 else 8
        _grouped_gated_kernel[(rows, groups)](y, z, weight, out, y.stride(0), z.stride(0), out.stride(0),
                                              float(eps), GROUP=group, BLOCK=block, num_warps=num_warps,
                                              **pdl.options(y))
    return out
