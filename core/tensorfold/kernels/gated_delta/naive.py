"""The gated delta rule in plain torch: the reference every fast version is measured against, and the CPU path.

    S_t = exp(g_t) S_{t-1} + k_t ⊗ beta_t (v_t - S_{t-1}ᵀ k_t exp(g_t))      state S [DK, DV] per value head
    o_t = S_tᵀ q_t

Conventions (those of tensorfold_qwen.gdn and of fla):
    g       log decay (natural log, <= 0), one per token and value head, float32
    beta    the write strength, after the sigmoid
    q, k    NK key heads; value head h reads key head h // (NV / NK) (GVA). With `qk_l2norm` they are
            l2-normalised here (x · rsqrt(Σx² + 1e-6), in the math dtype); q is then multiplied by `scale`
            (default 1.0: q, k arrive prepared as tensorfold_qwen.gdn prepares them; fla's own default is
            DK^-0.5, so pass that with qk_l2norm=True).
    state   [NV, DK, DV] per stream, key-major (fla's default layout, state_v_first=False), float32.

The arithmetic is tensorfold_qwen.gdn's, op for op, so on the CPU in float32 the two agree bit for bit (the tests
check it). Every stream runs on its own (a loop), so a stream's bits never depend on the others in the call.

Shapes: T rows of one call (all streams packed), N streams, NK/NV key/value heads, DK/DV their dims, B streams of a
decode step, S slots of a state pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tensorfold.kernels.per_stream import each_slot, each_stream
from tensorfold.kernels.stream_args import as_packed

CHUNK = 64          # the chunked form's block, on the absolute position grid


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x · rsqrt(Σx² + 1e-6) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, heads: int, scale: float, qk_l2norm: bool,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., NK, DK] -> [..., NV, DK] in `dtype`: repeated to the value heads, normalised, q scaled
    (in gdn.py's order: repeat, cast, l2norm, scale)."""
    group = heads // q.shape[-2]
    q = q.repeat_interleave(group, dim=-2).to(dtype)
    k = k.repeat_interleave(group, dim=-2).to(dtype)
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return (q * scale if scale != 1.0 else q), k


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor | None = None, start: int = 0, *,
                      cu_seqlens: Sequence[int] | None = None, starts: Sequence[int] | None = None,
                      scale: float = 1.0, qk_l2norm: bool = False,
                      math_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked delta rule over one stream's rows, or N streams' rows packed one after another.

    q, k [T, NK, DK]; v [T, NV, DV]; g, beta [T, NV].
    One stream (cu_seqlens None): initial_state [NV, DK, DV] or None (zeros); `start` the absolute position of
    the first row, which places the chunks on the absolute grid of CHUNK rows. Returns out [T, NV, DV] in v's
    dtype and the final state [NV, DK, DV].
    N streams: cu_seqlens N+1 row offsets; initial_state [N, NV, DK, DV] or None; starts N positions (None: 0).
    Returns out [T, NV, DV] and the final states [N, NV, DK, DV].
    The states come out in `math_dtype` (float32; float64 gives a truth to measure the fast versions against).
    """
    heads = v.shape[1]

    def one(a: int, b: int, state: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        qn, kn = prepare_qk(q[a:b], k[a:b], heads, scale, qk_l2norm, math_dtype)
        return chunked(qn, kn, v[a:b].to(math_dtype), g[a:b].to(math_dtype), beta[a:b].to(math_dtype), state, start)

    states, bounds, starts = as_packed(q.shape[0], initial_state, start, cu_seqlens, starts)
    out, final = each_stream(q, v, states, bounds, starts, math_dtype, one)
    return (out, final) if cu_seqlens is not None else (out, final[0])


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor | Sequence[int], *,
                               scale: float = 1.0, qk_l2norm: bool = False) -> torch.Tensor:
    """One token for each of B streams whose states live in `slots` of a pool, updated in place.

    q, k [B, NK, DK]; v [B, NV, DV]; g, beta [B, NV]; states [S, NV, DK, DV] (its dtype is the math dtype,
    float32); slots [B] distinct, negative for a padded row (out zero). Returns out [B, NV, DV] in v's dtype;
    the other slots are left untouched.
    """
    heads, dtype = v.shape[1], states.dtype

    def one(i: int, state: torch.Tensor) -> torch.Tensor:
        qi, ki = prepare_qk(q[i:i + 1], k[i:i + 1], heads, scale, qk_l2norm, dtype)
        return recurrent_step(qi[0], ki[0], v[i].to(dtype), g[i].to(dtype), beta[i].to(dtype), state)

    return each_slot(v, states, slots, one)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token of one stream. q, k [NV, DK]; v [NV, DV]; g, beta [NV]; state [NV, DK, DV] in place.
    Returns the output [NV, DV]."""
    state.mul_(g.exp()[:, None, None])                                             # decay
    predicted = (state * k[:, :, None]).sum(1)                                     # [NV, DV]: Sᵀk
    delta = (v - predicted) * beta[:, None]                                        # [NV, DV]
    state.add_(k[:, :, None] * delta[:, None, :])                                  # S += k ⊗ delta
    return (state * q[:, :, None]).sum(1)                                          # [NV, DV]: Sᵀq


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One stream's T >= 1 rows in chunks of CHUNK on the absolute grid. q, k [T, NV, DK] (prepared); v [T, NV, DV];
    g, beta [T, NV]; state [NV, DK, DV] (read only). Returns out [T, NV, DV] and the final state.

    Rows are padded with zeros in front (start % CHUNK) and behind up to the grid; a zero row (k = v = 0,
    beta = g = 0) leaves the state and every other row's output exactly as they were.
    """
    T = q.shape[0]
    lead = start % CHUNK
    trail = -(lead + T) % CHUNK

    def blocks(t: torch.Tensor) -> torch.Tensor:                                   # [T, NV, ...] -> [NV, N, CHUNK, ...]
        t = F.pad(t, [0, 0] * (t.dim() - 1) + [lead, trail])
        t = t.reshape(-1, CHUNK, *t.shape[1:])                                     # [N, CHUNK, NV, ...]
        return t.movedim(2, 0)

    q, k, v, g, beta = (blocks(t) for t in (q, k, v, g, beta))                     # [NV, N, CHUNK, ...]
    out, final = delta_rule_blocks(q, k, v, g, beta, state)
    heads, v_dim = out.shape[0], out.shape[-1]
    out = out.movedim(0, 2).reshape(-1, heads, v_dim)                              # [N·CHUNK, NV, DV]
    return out[lead: lead + T], final


def delta_rule_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (UT-transform) delta rule. q, k [NV, N, L, DK]; v [NV, N, L, DV]; g, beta [NV, N, L];
    state [NV, DK, DV]. Returns the outputs [NV, N, L, DV] and the final state [NV, DK, DV].

    Within a block, with G_i the cumulative log decay up to row i and Γ_ij = exp(G_i - G_j) for j <= i:
        (I + A) U = beta·v,   (I + A) W = beta·k·exp(G),   A_ij = beta_i (k_i·k_j) Γ_ij  for j < i
    then block by block, from the state S entering it:
        V' = U - W S;   out = exp(G)·q S + (q kᵀ ∘ Γ) V';   S <- exp(G_L) S + (k·exp(G_L - G))ᵀ V'
    """
    L = q.shape[2]
    lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()            # j <= i
    cumulative = g.cumsum(-1)                                                      # [NV, N, L]
    gaps = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = gaps.exp()                                                             # [NV, N, L, L]: Γ, 0 above
    k_beta = k * beta[..., None]                                                   # [NV, N, L, DK]
    system = (k_beta @ k.transpose(-1, -2)) * decay                                # A (its diagonal is ignored)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cumulative.exp()[..., None], upper=False,
                                      unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay                                     # [NV, N, L, L]
    q_decayed = q * cumulative.exp()[..., None]                                    # [NV, N, L, DK]
    k_to_end = k * (cumulative[..., -1:] - cumulative).exp()[..., None]            # [NV, N, L, DK]
    block_decay = cumulative[..., -1].exp()[..., None, None]                       # [NV, N, 1, 1]
    s = state.to(q.dtype)
    out = torch.empty_like(u)
    for n in range(q.shape[1]):
        fresh = u[:, n] - w[:, n] @ s                                              # [NV, L, DV]
        out[:, n] = q_decayed[:, n] @ s + scores[:, n] @ fresh
        s = s * block_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ fresh
    return out, s
