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

from tensorfold.kernels.gated_delta import gate_terms, naive
from tensorfold.kernels.gated_delta.naive import l2norm, recurrent_step
from tensorfold_qwen.config import QwenConfig
from tensorfold_qwen.layers import gated_rms_norm


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
    in_proj: torch.Tensor | None = None  # [C + NV·DV + 2·NV, E]: qkv, z, b, a in one matrix (fused.py), the four
                                         # above being row views of it; the decode step's one GEMM
    gate_decay: torch.Tensor | None = None  # [NV] float32: -exp(A_log), computed once (with_gate_terms)
    gate_bias: torch.Tensor | None = None   # [NV] float32: dt_bias in float32, computed once (with_gate_terms)


def with_gate_terms(w: GdnWeights) -> GdnWeights:
    """The layer with its gate's per-layer factors computed once, on its weights' device (the batched step's gate
    reads them: the same bits as computing them in every step, without their launches)."""
    if w.gate_decay is not None:
        return w
    decay, bias = gate_terms(w.A_log, w.dt_bias)
    return attrs.evolve(w, gate_decay=decay, gate_bias=bias)


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


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, start: int) -> torch.Tensor:
    """The delta rule over T > 1 rows in chunks of CHUNK on the absolute grid (the kernels' naive form), float32;
    the state is read and written in place."""
    out, final = naive.chunked(q, k, v, g, beta, state, start)
    state.copy_(final)
    return out
