"""The routed experts' per-row sum, the residual add and the next RMSNorm in one launch (a decode step's MoE layer
ends in all three): program (row block)   x = round(Σ_j c[t·k + j], j in order, rounded after each add)
                                          s = round(x + residual)   -> written, the next residual
                                          out = the RMSNorm of s    -> rmsnorm's own body (normalise_rows)

The arithmetic is that of triton_moe's sum kernel (the plain mode: weights applied by the down kernel) followed by
triton_rmsnorm's rms_norm with a residual, op for op, with the norm's tiles (`blocks`): the bits equal the two
launches' (`test_moe_sum_norm.py`). A row reads only its own pairs and residual: batch invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl
from tensorfold.kernels.rmsnorm.triton_rmsnorm import blocks, normalise_rows
from tensorfold.kernels.triton_rounding import round_to


@triton.jit
def _sum_norm_kernel(c_ptr, expert_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, T, D, N, s_cp, s_r, s_o, s_s, eps,
                     K_TOP: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Rows [program · BLOCK_N, +BLOCK_N): the experts' sum, + residual, normalised (module docstring)."""
    pdl.ordered(PDL)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)      # [BN]
    cols = tl.arange(0, BLOCK_D)                                                   # [BD]
    row_ok = rows < T
    mask = row_ok[:, None] & (cols < D)[None, :]
    ty = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K_TOP):
        pair = rows * K_TOP + j
        expert = tl.load(expert_ptr + pair, mask=row_ok, other=N)
        c = tl.load(c_ptr + pair[:, None] * s_cp + cols[None, :], mask=mask & (expert < N)[:, None],
                    other=0.0).to(tl.float32)
        acc = round_to(acc + c, ty)
    r = tl.load(r_ptr + rows[:, None] * s_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = round_to(acc + r, ty)
    tl.store(sum_ptr + rows[:, None] * s_s + cols[None, :], x, mask=mask)
    normalise_rows(x, rows, cols, mask, w_ptr, out_ptr, s_o, D, eps, ZERO_CENTRED, False)


def sum_then_norm(contrib: torch.Tensor, expert: torch.Tensor, N: int, k: int, residual: torch.Tensor,
                  weight: torch.Tensor, eps: float, zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """contrib [T·k, D] (pair t·k + j's weighted output), expert [T·k] (N or more: the pair adds nothing),
    residual [T, D], weight [D] -> (the norm of s, s = residual + the pairs' sum), each [T, D]."""
    T, D = residual.shape
    out = torch.empty_like(residual)
    total = torch.empty_like(residual)
    if T == 0 or D == 0:
        return out, total
    block_n, block_d, num_warps, grid = blocks(T, D)
    _sum_norm_kernel[grid](contrib, expert, residual, weight.contiguous(), out, total, T, D, N, contrib.stride(0),
                           residual.stride(0), out.stride(0), total.stride(0), float(eps), K_TOP=k,
                           ZERO_CENTRED=zero_centred, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps,
                           **pdl.options(residual))
    return out, total
