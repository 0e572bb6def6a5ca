"""Kimi Delta Attention (KDA) in plain torch: the reference every fast version is measured against, and the CPU path.

    S_t = diag(exp(g_t)) S_{t-1}                    decay, one rate per key channel
    S_t = S_t + k_t ⊗ beta_t (v_t - S_tᵀ k_t)       the delta rule on the decayed state
    o_t = S_tᵀ q_t

It is the gated delta rule (kernels/gated_delta) with the scalar decay per head made a vector over the key
channels. Conventions (those of HF's glm5_next and of fla's chunk_kda):
    g       log decay (natural log, <= 0) per token, head and key channel, float32
    beta    the write strength, after the sigmoid
    q, k    H heads (as many as v's). With `qk_l2norm` they are l2-normalised here as x / sqrt(Σx² + 1e-6) (fla's
            form, which HF's glm5_next copies; Qwen's GDN uses x · rsqrt(..)), in the math dtype; q is then
            multiplied by `scale` (default 1.0: q, k arrive prepared; the models use DK^-0.5).
    state   [H, DK, DV] per stream, key-major, float32.

Chunked form, per block of L rows on the absolute grid, with G_i = Σ_{r<=i} g_r per channel and the pairwise decay
Γ_ijd = exp(G_id - G_jd) for j <= i (<= 1, so nothing overflows however strong the decay; exp(+G) never appears):
    A_ij = beta_i Σ_d k_id k_jd Γ_ijd (j < i);   (I + A) U = beta·v;   (I + A) W = beta·k·exp(G)
    V' = U - W S;   out = (q·exp(G)) S + P V' with P_ij = Σ_d q_id k_jd Γ_ijd (j <= i)
    S <- diag(exp(G_L)) S + (k·exp(G_L - G))ᵀ V'
Γ is [H, L, L, DK] per block; blocks run one after another, so memory does not grow with T and a block's bits
depend only on its own rows and the state entering it.

Shapes: T rows of one call (all streams packed), N streams, H heads, DK/DV key/value dims, B streams of a decode
step, S slots of a state pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tensorfold.kernels.per_stream import each_slot, each_stream
from tensorfold.kernels.stream_args import as_packed

CHUNK = 64          # the chunked form's block, on the absolute position grid
L2_EPS = 1e-6       # l2norm's epsilon, added under the square root


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last dim (HF glm5_next's and fla's form)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, scale: float, qk_l2norm: bool,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., H, DK] in `dtype`: cast, normalised when asked, q scaled (HF's order)."""
    q, k = q.to(dtype), k.to(dtype)
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return (q * scale if scale != 1.0 else q), k


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None = None, start: int = 0, *,
              cu_seqlens: Sequence[int] | None = None, starts: Sequence[int] | None = None,
              scale: float = 1.0, qk_l2norm: bool = False,
              math_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked KDA over one stream's rows, or N streams' rows packed one after another.

    q, k [T, H, DK]; v [T, H, DV]; g [T, H, DK]; beta [T, H].
    One stream (cu_seqlens None): initial_state [H, DK, DV] or None (zeros); `start` the absolute position of the
    first row, which places the chunks on the absolute grid of CHUNK rows. Returns out [T, H, DV] in v's dtype and
    the final state [H, DK, DV].
    N streams: cu_seqlens N+1 row offsets; initial_state [N, H, DK, DV] or None; starts N positions (None: 0).
    Returns out [T, H, DV] and the final states [N, H, DK, DV].
    The states come out in `math_dtype` (float32; float64 gives a truth to measure the fast versions against).
    """
    def one(a: int, b: int, state: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        qn, kn = prepare_qk(q[a:b], k[a:b], scale, qk_l2norm, math_dtype)
        return chunked(qn, kn, v[a:b].to(math_dtype), g[a:b].to(math_dtype), beta[a:b].to(math_dtype), state, start)

    states, bounds, starts = as_packed(q.shape[0], initial_state, start, cu_seqlens, starts)
    out, final = each_stream(q, v, states, bounds, starts, math_dtype, one)
    return (out, final) if cu_seqlens is not None else (out, final[0])


def recurrent_kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor | Sequence[int], *,
                       scale: float = 1.0, qk_l2norm: bool = False) -> torch.Tensor:
    """One token for each of B streams whose states live in `slots` of a pool, updated in place.

    q, k [B, H, DK]; v [B, H, DV]; g [B, H, DK]; beta [B, H]; states [S, H, DK, DV] (its dtype is the math
    dtype, float32); slots [B] distinct, negative for a padded row (out zero). Returns out [B, H, DV] in v's
    dtype; the other slots are left untouched.
    """
    dtype = states.dtype

    def one(i: int, state: torch.Tensor) -> torch.Tensor:
        qi, ki = prepare_qk(q[i], k[i], scale, qk_l2norm, dtype)
        return recurrent_step(qi, ki, v[i].to(dtype), g[i].to(dtype), beta[i].to(dtype), state)

    return each_slot(v, states, slots, one)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token of one stream, in HF's order of operations. q, k [H, DK] (prepared); v [H, DV]; g [H, DK];
    beta [H]; state [H, DK, DV] in place. Returns the output [H, DV]."""
    state.mul_(g.exp()[:, :, None])                                                # decay, per key channel
    predicted = (state * k[:, :, None]).sum(1)                                     # [H, DV]: Sᵀk
    delta = (v - predicted) * beta[:, None]                                        # [H, DV]
    state.add_(k[:, :, None] * delta[:, None, :])                                  # S += k ⊗ delta
    return (state * q[:, :, None]).sum(1)                                          # [H, DV]: Sᵀq


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One stream's T >= 1 rows in chunks of CHUNK on the absolute grid. q, k [T, H, DK] (prepared); v [T, H, DV];
    g [T, H, DK]; beta [T, H]; state [H, DK, DV] (read only). Returns out [T, H, DV] and the final state.

    Rows are padded with zeros in front (start % CHUNK) and behind up to the grid; a zero row (k = v = 0,
    beta = g = 0) leaves the state and every other row's output as they were.
    """
    T = q.shape[0]
    lead = start % CHUNK
    trail = -(lead + T) % CHUNK

    def blocks(t: torch.Tensor) -> torch.Tensor:                                   # [T, H, ...] -> [N, H, CHUNK, ...]
        t = F.pad(t, [0, 0] * (t.dim() - 1) + [lead, trail])
        return t.reshape(-1, CHUNK, *t.shape[1:]).movedim(1, 2)

    q, k, v, g, beta = (blocks(t) for t in (q, k, v, g, beta))                     # [N, H, CHUNK, ...]
    s = state.to(q.dtype)
    outs = []
    for n in range(q.shape[0]):
        out, s = kda_block(q[n], k[n], v[n], g[n], beta[n], s)
        outs.append(out)
    out = torch.stack(outs).movedim(2, 1).reshape(-1, v.shape[1], v.shape[-1])   # [N·CHUNK, H, DV]
    return out[lead: lead + T], s


def kda_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of L rows (the module docstring's equations). q, k, g [H, L, DK]; v [H, L, DV]; beta [H, L];
    state [H, DK, DV] entering the block. Returns the outputs [H, L, DV] and the state leaving it."""
    L = q.shape[1]
    lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()            # j <= i
    cumulative = g.cumsum(1)                                                       # [H, L, DK]: G
    gaps = cumulative[:, :, None, :] - cumulative[:, None, :, :]                   # [H, L, L, DK]: G_i - G_j
    decayed_k = gaps.masked_fill_(~lower[:, :, None], float("-inf")).exp_()       # Γ_ijd, 0 above the diagonal
    decayed_k.mul_(k[:, None, :, :])                                               # k_jd Γ_ijd
    k_beta = k * beta[..., None]                                                   # [H, L, DK]
    system = (decayed_k @ k_beta[..., None])[..., 0]                               # [H, L, L]: A (diagonal ignored)
    scores = (decayed_k @ q[..., None])[..., 0]                                    # [H, L, L]: P, 0 above
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cumulative.exp(), upper=False, unitriangular=True)
    last = cumulative[:, -1:, :]                                                   # [H, 1, DK]: G_L
    fresh = u - w @ state                                                          # [H, L, DV]: V'
    out = (q * cumulative.exp()) @ state + scores @ fresh                          # [H, L, DV]
    k_to_end = k * (last - cumulative).exp()                                       # [H, L, DK]
    state = state * last.exp().transpose(1, 2) + k_to_end.transpose(1, 2) @ fresh  # [H, DK, DV]
    return out, state
