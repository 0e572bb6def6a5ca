"""Our fused Mamba2 decode step: one token for each of Bt streams, states updated in place in their pool slots.

One program per (stream, head, block of BP head-dim rows): it loads x, dt, A, its group's B and C, and its [BP, N]
slice of the float32 state once, then

    S = exp(dt·A)·S + (x·dt) ⊗ B;   y = S C

and stores the slice back. Each output element reduces over N inside one program, with a fixed block shape and warp
count (no autotuning), so a stream's bits depend neither on the batch it runs in nor on the process: batch invariant
by construction. No host sync (slots stay on the device; a negative slot is masked in the kernel), so the step can be
captured in a CUDA graph. Math in float32 whatever the input dtype; y takes x's dtype.

GATED (ssd_step_gated, the family's decode glue fused in, same launch): dt arrives raw and becomes
clamp(softplus(dt + dt_bias), dt_min, dt_max) in the kernel (libdevice's log1p on the GPU), and the program writes
y_skip = round(y) + D·x in float32, y rounded to x's dtype first as the unfused path rounds it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tensorfold.kernels import pdl
from tensorfold.kernels.strides import row_major
from tensorfold.kernels.triton_rounding import round_to

BLOCK_P = 16        # head-dim rows per program: 16 x N float32 = 8 KiB of state at N = 128
NUM_WARPS = 4
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)      # torch's F.softplus default (beta 1): x itself above it
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"      # libdevice has no interpreter version


@triton.jit
def _softplus(v, LIBDEVICE: tl.constexpr):
    """torch's softplus (beta 1, threshold 20): v above 20, else log1p(exp(v)). The interpreter has no libdevice:
    log1p(e) there is log(u)·e/(u - 1) with u = 1 + e (exact where u rounds to 1: e itself)."""
    e = tl.exp(tl.minimum(v, SOFTPLUS_THRESHOLD))                                  # no inf where v is kept
    if LIBDEVICE:
        soft = libdevice.log1p(e)
    else:
        u = 1.0 + e
        soft = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(v > SOFTPLUS_THRESHOLD, v, soft)


@triton.jit
def _step_kernel(x, dt, A, B, C, states, slots, out, dt_bias, D, dt_min, dt_max,
                 stride_xb, stride_xh, stride_dtb, stride_bb, stride_bg, stride_cb, stride_cg, stride_ob, stride_oh,
                 H: tl.constexpr, GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                 BP: tl.constexpr, BN: tl.constexpr, GATED: tl.constexpr = False, LIBDEVICE: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    pdl.ordered(PDL)
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    i_g = i_h // GROUP
    slot = tl.load(slots + i_b).to(tl.int64)
    live = slot >= 0                                                               # negative: a padded row

    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    b_x = tl.load(x + i_b * stride_xb + i_h * stride_xh + o_p, mask=m_p, other=0.0).to(tl.float32)
    b_dt = tl.load(dt + i_b * stride_dtb + i_h).to(tl.float32)
    if GATED:                                                                      # dt raw: the time step here
        b_dt = _softplus(b_dt + tl.load(dt_bias + i_h).to(tl.float32), LIBDEVICE)
        b_dt = tl.minimum(tl.maximum(b_dt, dt_min), dt_max)                        # torch's clamp(min, max)
    b_a = tl.load(A + i_h).to(tl.float32)
    b_B = tl.load(B + i_b * stride_bb + i_g * stride_bg + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_C = tl.load(C + i_b * stride_cb + i_g * stride_cg + o_n, mask=m_n, other=0.0).to(tl.float32)

    p_s = states + (slot * H + i_h) * (P * N) + o_p[:, None] * N + o_n[None, :]
    m_s = m_p[:, None] & m_n[None, :] & live
    b_s = tl.load(p_s, mask=m_s, other=0.0)
    b_s = b_s * tl.exp(b_dt * b_a)                                                 # decay
    b_s = b_s + (b_x * b_dt)[:, None] * b_B[None, :]                               # S += (x·dt) ⊗ B
    b_y = tl.sum(b_s * b_C[None, :], 1)                                            # [BP]: S C
    tl.store(p_s, b_s, mask=m_s)
    b_y = tl.where(live, b_y, 0.0)
    if GATED:                                                                      # y in x's dtype, then the D skip
        b_y = round_to(b_y, x.dtype.element_ty) + tl.load(D + i_h).to(tl.float32) * b_x
    tl.store(out + i_b * stride_ob + i_h * stride_oh + o_p, b_y.to(out.dtype.element_ty), mask=m_p)


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """One token for each of Bt streams, in place: the naive module's contract.

    x [Bt, H, P]; dt [Bt, H] float32; A [H] float32; B, C [Bt, G, N]; states [S, H, P, N] float32, contiguous;
    slots [Bt] distinct (a tensor on the states' device, or ints; negative: a padded row, no state touched, y zero).
    Returns y [Bt, H, P] in x's dtype.
    """
    return _launch(x, dt, A, B, C, states, slots, None)


def ssd_step_gated(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor, states: torch.Tensor, slots: torch.Tensor | Sequence[int], *,
                   dt_min: float, dt_max: float) -> torch.Tensor:
    """The step with the time step and the D skip fused in (the naive module's ssd_step_gated): dt [Bt, H] raw,
    dt_bias [H], D [H]. Returns y_skip [Bt, H, P] float32. One launch."""
    return _launch(x, dt, A, B, C, states, slots, (dt_bias, D, float(dt_min), float(dt_max)))


def _launch(x, dt, A, B, C, states, slots, gated) -> torch.Tensor:
    """One _step_kernel launch; gated: None (the plain step) or (dt_bias, D, dt_min, dt_max)."""
    Bt, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if not isinstance(slots, torch.Tensor):
        slots = torch.tensor(list(slots), dtype=torch.int64, device=states.device)
    x, dt, A, B, C = (row_major(t) for t in (x, dt, A, B, C))
    if gated is None:
        dt_bias, D, dt_min, dt_max = dt, A, 0.0, 0.0                               # unused
    else:
        dt_bias, D, dt_min, dt_max = gated
        dt_bias, D = dt_bias.contiguous(), D.contiguous()
    out = torch.empty(Bt, H, P, dtype=x.dtype if gated is None else torch.float32, device=x.device)
    if Bt == 0:
        return out
    BP = min(BLOCK_P, triton.next_power_of_2(P))
    grid = (Bt, H, triton.cdiv(P, BP))
    _step_kernel[grid](x, dt, A, B, C, states, slots, out, dt_bias, D, dt_min, dt_max,
                       x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
                       out.stride(0), out.stride(1),
                       H=H, GROUP=H // G, P=P, N=N, BP=BP, BN=triton.next_power_of_2(N),
                       GATED=gated is not None, LIBDEVICE=not _INTERPRETED, num_warps=NUM_WARPS, **pdl.options(x))
    return out
