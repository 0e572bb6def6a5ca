"""Triton elementwise gates: silu(gate)·up (optionally clamped) and x·sigmoid(gate), one program per
(row, block of features); rows may be strided views (e.g. the two halves of a fused gate_up projection).

Each step is rounded to the inputs' dtype where the reference's torch ops round (the activation, then the
product); bfloat16 rounding is done on the bits (nearest even), because triton's interpreter truncates on
`.to(tl.bfloat16)`; on the GPU it equals cvt.rn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl
from tensorfold.kernels.strides import row_major
from tensorfold.kernels.triton_rounding import round_to


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, F, stride_g, stride_u, stride_o, limit,
                     HAS_LIMIT: tl.constexpr, BLOCK_F: tl.constexpr, PDL: tl.constexpr = False):
    """out = round(round(silu(g)) · u), with g <- min(g, L), u <- clamp(u, -L, L) first when limited."""
    pdl.ordered(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < F
    ty = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = round_to(tl.minimum(g, limit), ty)
        u = round_to(tl.minimum(tl.maximum(u, -limit), limit), ty)
    silu = round_to(g / (1.0 + tl.exp(-g)), ty)
    tl.store(out_ptr + row * stride_o + cols, round_to(silu * u, ty), mask=mask)


@triton.jit
def _sigmoid_mul_kernel(x_ptr, g_ptr, out_ptr, F, HEAD, stride_x, stride_g, stride_gh, stride_gf, stride_o,
                        BLOCK_F: tl.constexpr, PDL: tl.constexpr = False):
    """out = round(x · round(sigmoid(g))); feature f's gate at (f // HEAD)·stride_gh + (f % HEAD)·stride_gf (a gate
    of heads, each HEAD wide; HEAD = F for a plain row); stride_gf = 0 broadcasts one gate over a row."""
    pdl.ordered(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < F
    ty = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + (cols // HEAD) * stride_gh + (cols % HEAD) * stride_gf, mask=mask,
                other=0.0).to(tl.float32)
    gate = round_to(1.0 / (1.0 + tl.exp(-g)), ty)
    tl.store(out_ptr + row * stride_o + cols, round_to(x * gate, ty), mask=mask)


def _grid(N: int, F: int) -> tuple[int, tuple[int, int]]:
    """BLOCK_F and the grid: one program per row and 1024 features."""
    block_f = min(1024, triton.next_power_of_2(F))
    return block_f, (N, triton.cdiv(F, block_f))


def silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """Launcher: gate, up [N, F] -> [N, F]."""
    gate, up = row_major(gate), row_major(up)
    N, F = gate.shape
    out = torch.empty((N, F), dtype=gate.dtype, device=gate.device)
    if out.numel():
        block_f, grid = _grid(N, F)
        _silu_mul_kernel[grid](gate, up, out, F, gate.stride(0), up.stride(0), out.stride(0),
                               0.0 if limit is None else float(limit), HAS_LIMIT=limit is not None,
                               BLOCK_F=block_f, num_warps=4, **pdl.options(gate))
    return out


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Launcher: x [N, F], gate [N, F], [N, 1] or [N, H, D] (H·D = F, strided heads) -> [N, F]."""
    x = row_major(x)
    N, F = x.shape
    broadcast = gate.dim() == 2 and gate.shape[1] == 1 and F != 1
    gate = gate if broadcast else row_major(gate)
    heads = gate.dim() == 3
    head = gate.shape[2] if heads else max(F, 1)
    out = torch.empty((N, F), dtype=x.dtype, device=x.device)
    if out.numel():
        block_f, grid = _grid(N, F)
        _sigmoid_mul_kernel[grid](x, gate, out, F, head, x.stride(0), gate.stride(0), gate.stride(1) if heads else 0,
                                  0 if broadcast else 1, out.stride(0), BLOCK_F=block_f, num_warps=4,
                                  **pdl.options(x))
    return out
