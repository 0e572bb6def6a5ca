"""Our fused decode step of the gated delta rule: one token for each of B streams, states updated in place in
their pool slots.

One program per (stream, value head, block of BV value columns): it loads q, k (its key head, l2-normalised and
scaled in-kernel when asked), v, g, beta, and its [DK, BV] slice of the float32 state once, then

    S *= exp(g);   delta = (v - Sᵀk)·beta;   S += k ⊗ delta;   o = Sᵀq

and stores the slice back. Each output column reduces over DK inside one program, with a fixed block shape and
warp count (no autotuning), so a stream's bits depend neither on the batch it runs in nor on the process: batch
invariant by construction. Math in float32 whatever the input dtype; the output takes v's dtype.

Reads and writes the state once each (2·DK·DV·4 bytes per head), which is the floor for an in-place step; a
library step that takes `initial_state` and returns a new `final_state` needs a gather and a scatter on top.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl
from tensorfold.kernels.strides import row_major
from tensorfold.kernels.triton_rounding import round_to

BLOCK_V = 32        # value columns per program: DK x 32 float32 = 16 KiB of state at DK = 128
NUM_WARPS = 4


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20), in float32."""
    return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))


@triton.jit
def _step_kernel(q, k, v, g, beta, states, slots, out, A_log, dt_bias,
                 stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_betab,
                 stride_ob, stride_oh, scale,
                 NV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, GATED: tl.constexpr,
                 PDL: tl.constexpr = False):
    pdl.ordered(PDL)
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_kh = i_h // GROUP
    slot = tl.load(slots + i_b).to(tl.int64)
    live = slot >= 0                                                               # negative: a padded row

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    b_q = tl.load(q + i_b * stride_qb + i_kh * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_b * stride_kb + i_kh * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
    if L2NORM:
        b_q = b_q * tl.math.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
        b_k = b_k * tl.math.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_q = b_q * scale
    b_v = tl.load(v + i_b * stride_vb + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
    if GATED:       # g holds the raw projection a, beta the raw b: the GDN gate computed here
        b_a = tl.load(g + i_b * stride_gb + i_h).to(tl.float32)
        b_g = -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * _softplus(b_a + tl.load(dt_bias + i_h).to(tl.float32))
        b_b = tl.load(beta + i_b * stride_betab + i_h).to(tl.float32)
        b_beta = round_to(1.0 / (1.0 + tl.exp(-b_b)), beta.dtype.element_ty).to(tl.float32)
    else:
        b_g = tl.load(g + i_b * stride_gb + i_h).to(tl.float32)
        b_beta = tl.load(beta + i_b * stride_betab + i_h).to(tl.float32)

    p_s = states + (slot * NV + i_h) * (DK * DV) + o_k[:, None] * DV + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :] & live
    b_s = tl.load(p_s, mask=m_s, other=0.0)
    b_s = b_s * tl.exp(b_g)                                                        # decay
    predicted = tl.sum(b_s * b_k[:, None], 0)                                      # [BV]: Sᵀk
    delta = (b_v - predicted) * b_beta
    b_s = b_s + b_k[:, None] * delta[None, :]                                      # S += k ⊗ delta
    b_o = tl.sum(b_s * b_q[:, None], 0)                                            # [BV]: Sᵀq
    tl.store(p_s, b_s, mask=m_s)
    b_o = tl.where(live, b_o, 0.0)
    tl.store(out + i_b * stride_ob + i_h * stride_oh + o_v, b_o.to(out.dtype.element_ty), mask=m_v)


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor | Sequence[int], *,
                               scale: float = 1.0, qk_l2norm: bool = False,
                               gate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One token for each of B streams, in place: the naive module's contract. With `gate` = (A_log, dt_bias),
    g and beta are the raw projections a, b, and the kernel computes g = -exp(A_log)·softplus(a + dt_bias),
    beta = sigmoid(b) (rounded to b's dtype).

    q, k [B, NK, DK]; v [B, NV, DV]; g, beta [B, NV]; states [S, NV, DK, DV] float32, contiguous; slots [B]
    distinct (a tensor on the states' device, or ints; negative: a padded row, no state touched, out zero).
    Returns out [B, NV, DV] in v's dtype.
    """
    B, NK, DK = q.shape
    NV, DV = v.shape[1], v.shape[2]
    scale = float(scale)
    if not isinstance(slots, torch.Tensor):
        slots = torch.tensor(list(slots), dtype=torch.int64, device=states.device)
    q, k, v, g, beta = (row_major(t) for t in (q, k, v, g, beta))
    out = torch.empty(B, NV, DV, dtype=v.dtype, device=v.device)
    if B == 0:
        return out
    BV = min(BLOCK_V, triton.next_power_of_2(DV))
    grid = (B, NV, triton.cdiv(DV, BV))
    A_log, dt_bias = gate if gate is not None else (g, g)
    _step_kernel[grid](q, k, v, g, beta, states, slots, out, A_log, dt_bias,
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                       g.stride(0), beta.stride(0), out.stride(0), out.stride(1), scale,
                       NV=NV, GROUP=NV // NK, DK=DK, DV=DV, BK=triton.next_power_of_2(DK), BV=BV,
                       L2NORM=qk_l2norm, GATED=gate is not None, num_warps=NUM_WARPS, **pdl.options(q))
    return out
