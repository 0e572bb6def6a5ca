"""Gated DeltaNet, the linear-attention mixer of Qwen3.5, for one stream and one step.

    qkv = conv(in_proj_qkv(x)) -> SiLU        depthwise causal conv (kernel K, no bias) over [q | k | v]; its input
                                              tail (the last K-1 columns) is a fixed state
    beta = sigmoid(in_proj_b(x))              how much each token writes
    g = -exp(A_log) · softplus(in_proj_a(x) + dt_bias)     log decay per token and value head (float32)
    q, k -> repeat to NV heads, l2-normalised, q · DK^-0.5
    S_t = exp(g_t) S_{t-1} + k_t ⊗ beta_t (v_t - S_{t-1}ᵀ k_t exp(g_t))     float32 state [NV, DK, DV]
    o_t = S_tᵀ q_t  -> gated RMSNorm (w · x̂ · silu(z)) -> out_proj

A prefill step runs the chunked form (chunks of 64 on the absolute position grid, so the arithmetic depends only
on the absolute rows a step covers and the state it starts from); a 1-token step always runs the recurrent form.

Shapes in comments: T rows, E hidden, C conv channels, K kernel, NK/NV key/value heads, DK/DV their dims.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold_qwen.config import QwenConfig
from tensorfold_qwen.layers import gated_rms_norm

CHUNK = 64          # the chunked form's block, as in HF's torch fallback and fla


@attrs.frozen
class GdnWeights:
    """One GDN layer's tensors (HF names under `linear_attn.`)."""

    in_proj_qkv: torch.Tensor           # [C, E]        C = 2·NK·DK + NV·DV
    in_proj_z: torch.Tensor             # [NV·DV, E]
    in_proj_b: torch.Tensor             # [NV, E]
    in_proj_a: torch.Tensor             # [NV, E]
    conv: torch.Tensor                  # [C, K]        conv1d.weight [C, 1, K], squeezed
    A_log: torch.Tensor                 # [NV]
    dt_bias: torch.Tensor               # [NV]
    norm: torch.Tensor                  # [DV]          norm.weight (plain, not zero-centred)
    out_proj: torch.Tensor              # [E, NV·DV]


def gated_delta_net(w: GdnWeights, c: QwenConfig, x: torch.Tensor, start: int,
                    conv_tail: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One step's rows [start, start + T) through the layer: [T, E] -> [T, E].

    conv_tail [C, K-1] (x's dtype) and state [NV, DK, DV] (float32) are the stream's fixed states, read and
    updated in place; at start 0 they are taken as zero whatever they hold.
    """
    T = x.shape[0]
    if start == 0:
        conv_tail.zero_()
        state.zero_()
    qkv = causal_conv(F.linear(x, w.in_proj_qkv), w.conv, conv_tail)               # [T, C]
    q, k, v = qkv.split([c.k_heads * c.k_dim, c.k_heads * c.k_dim, c.v_heads * c.v_dim], dim=-1)
    q = q.reshape(T, c.k_heads, c.k_dim).repeat_interleave(c.v_heads // c.k_heads, dim=1)   # [T, NV, DK]
    k = k.reshape(T, c.k_heads, c.k_dim).repeat_interleave(c.v_heads // c.k_heads, dim=1)   # [T, NV, DK]
    v = v.reshape(T, c.v_heads, c.v_dim).float()                                   # [T, NV, DV]
    beta = torch.sigmoid(F.linear(x, w.in_proj_b)).float()                         # [T, NV]
    g = -w.A_log.float().exp() * F.softplus(F.linear(x, w.in_proj_a).float() + w.dt_bias)   # [T, NV] float32
    q = l2norm(q.float()) * c.k_dim ** -0.5
    k = l2norm(k.float())
    if T == 1:
        out = recurrent_step(q[0], k[0], v[0], g[0], beta[0], state)[None]         # [1, NV, DV]
    else:
        out = chunked(q, k, v, g, beta, state, start)                              # [T, NV, DV]
    z = F.linear(x, w.in_proj_z).view(T, c.v_heads, c.v_dim)                       # [T, NV, DV]
    out = gated_rms_norm(out.to(x.dtype), z, w.norm, c.rms_norm_eps)               # [T, NV, DV]
    return F.linear(out.reshape(T, c.v_heads * c.v_dim), w.out_proj)               # [T, E]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over [tail | x]; the tail becomes the last K-1 input columns.

    x [T, C], weight [C, K], tail [C, K-1] -> [T, C]. One code path for every T.
    """
    C, K = weight.shape
    window = torch.cat((tail, x.transpose(0, 1)), dim=1)                           # [C, K-1+T]
    tail.copy_(window[:, window.shape[1] - (K - 1):])
    out = F.conv1d(window[None], weight[:, None, :], groups=C)[0]                  # [C, T]
    return F.silu(out).transpose(0, 1)                                             # [T, C]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x · rsqrt(Σx² + 1e-6) over the last dim (float32)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token of the delta rule, float32. q, k [NV, DK]; v [NV, DV]; g, beta [NV]; state [NV, DK, DV] in place.
    Returns the output [NV, DV]."""
    state.mul_(g.exp()[:, None, None])                                             # decay
    predicted = (state * k[:, :, None]).sum(1)                                     # [NV, DV]: Sᵀk
    delta = (v - predicted) * beta[:, None]                                        # [NV, DV]
    state.add_(k[:, :, None] * delta[:, None, :])                                  # S += k ⊗ delta
    return (state * q[:, :, None]).sum(1)                                          # [NV, DV]: Sᵀq


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, start: int) -> torch.Tensor:
    """The delta rule over T > 1 rows in chunks of CHUNK on the absolute grid, float32.

    q, k [T, NV, DK]; v [T, NV, DV]; g, beta [T, NV]; state [NV, DK, DV] read and written in place.
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
    state.copy_(final)
    heads, v_dim = out.shape[0], out.shape[-1]
    out = out.movedim(0, 2).reshape(-1, heads, v_dim)                              # [N·CHUNK, NV, DV]
    return out[lead: lead + T]


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
    s = state.float()
    out = torch.empty_like(u)
    for n in range(q.shape[1]):
        fresh = u[:, n] - w[:, n] @ s                                              # [NV, L, DV]
        out[:, n] = q_decayed[:, n] @ s + scores[:, n] @ fresh
        s = s * block_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ fresh
    return out, s
