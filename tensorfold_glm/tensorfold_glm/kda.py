"""Kimi Delta Attention (KDA), the linear-attention mixer of GLM-5.3-Flash, for one stream and one step.

    qkv = conv([q_proj x | k_proj x | v_proj x]) -> SiLU     depthwise causal conv (kernel K, no bias, computed in the
                                                             conv weight's dtype: float32 in the checkpoints); its
                                                             input tail (the last K-1 columns) is a fixed state
    g = lower_bound · sigmoid(exp(A_log) · (f_b(f_a x) + dt_bias))      log decay per head and KEY CHANNEL (float32)
    beta = sigmoid(b_proj x)                                 how much each token writes, per head
    q, k -> float32, l2-normalised as x / sqrt(Σx² + 1e-6), q · DK^-0.5     (a bf16 CUDA prefill: see below)
    S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t ⊗ beta_t (v_t - S_tᵀ k_t);  o_t = S_tᵀ q_t     state [H, DK, DV] float32
    out = o_proj(RMSNorm(o) · o_norm · sigmoid(g_b(g_a x)))  the norm and the gate in float32

A prefill step runs the chunked form (chunks of 64 on the absolute position grid, kernels/kda), so the arithmetic
depends only on the absolute rows a step covers and the state it starts from; a 1-token step always runs the
recurrent form. A bf16 model on CUDA runs kernels/kda's dispatched op (fla-core's chunk_kda and fused recurrent
step when installed: chunks counted from the step's first row, which keeps that property since steps start at
fixed cuts). Its prefill hands the op what HF's fla path hands fla's chunk_kda: q, k, v as the conv gives them and
beta in the model's dtype, g float32, the l2norm done by the op (fla stores the normalised q, k in bf16) and
scale DK^-0.5 applied by it, so fla's dots run in bf16 (float32 inputs make the same kernels much slower).
Without a lower bound the gate is HF's other form, -exp(A_log)·softplus(..).

Shapes in comments: T rows, E hidden, H heads, D head dim (DK = DV = D), C = 3·H·D conv channels, K kernel.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.kda import chunk_kda, kda_gate, recurrent_kda_step
from tensorfold.kernels.kda.naive import chunked, l2norm, recurrent_step


@attrs.frozen
class KdaWeights:
    """One KDA layer's tensors (HF names under `self_attn.`)."""

    q_proj: torch.Tensor                # [H·D, E]
    k_proj: torch.Tensor                # [H·D, E]
    v_proj: torch.Tensor                # [H·D, E]
    conv: torch.Tensor                  # [C, K]        {q,k,v}_conv1d.weight [H·D, 1, K], concatenated, squeezed;
                                        #               kept float32 when the rest is bf16 (HF's keep-in-fp32 list)
    f_a_proj: torch.Tensor              # [D, E]
    f_b_proj: torch.Tensor              # [H·D, D]
    b_proj: torch.Tensor                # [H, E]
    g_a_proj: torch.Tensor              # [D, E]
    g_b_proj: torch.Tensor              # [H·D, D]
    o_proj: torch.Tensor                # [E, H·D]
    A_log: torch.Tensor                 # [H]           float32
    dt_bias: torch.Tensor               # [H·D]         float32
    o_norm: torch.Tensor                # [D]           o_norm.weight (plain, not zero-centred)
    # The Triton path's stacked layout (fused.fuse_kda, at load; None: one GEMM each): q, k, v, f_a, b, g_a as row
    # views of one matrix, so the decode step runs one GEMM over x where the forward runs six.
    inputs: torch.Tensor | None = None  # [3·H·D + D + H + D, E]


def kimi_delta_attention(w: KdaWeights, heads: int, head_dim: int, conv_kernel: int, eps: float,
                         lower_bound: float | None, x: torch.Tensor, start: int, conv_tail: torch.Tensor,
                         state: torch.Tensor, *, dispatch: bool | None = None) -> torch.Tensor:
    """One step's rows [start, start + T) through the layer: x [T, E] -> [T, E] in x's dtype.

    heads, head_dim, conv_kernel: linear_num_heads, linear_head_dim, linear_conv_kernel_dim; eps: rms_norm_eps
    (the output norm's); lower_bound: linear_lower_bound (None: the softplus gate). conv_tail [C, K-1] (x's dtype)
    and state [H, D, D] (float32) are the stream's fixed states, read and updated in place; at start 0 they are
    taken as zero whatever they hold. dispatch: run kernels/kda's dispatched op (None: for a reduced-precision
    model on CUDA), or the exact naive form.
    """
    T, width = x.shape[0], heads * head_dim
    if w.conv.shape != (3 * width, conv_kernel):
        raise ValueError(f"conv weight must be [{3 * width}, {conv_kernel}], got {tuple(w.conv.shape)}")
    if conv_tail.shape != (3 * width, conv_kernel - 1) or conv_tail.dtype != x.dtype:
        raise ValueError(f"conv_tail must be [{3 * width}, {conv_kernel - 1}] in {x.dtype}, "
                         f"got {tuple(conv_tail.shape)} in {conv_tail.dtype}")
    if state.shape != (heads, head_dim, head_dim) or state.dtype != torch.float32:
        raise ValueError(f"state must be [{heads}, {head_dim}, {head_dim}] float32, "
                         f"got {tuple(state.shape)} in {state.dtype}")
    if start == 0:
        conv_tail.zero_()
        state.zero_()
    if T == 0:
        return x.new_zeros(0, w.o_proj.shape[0])
    qkv = torch.cat((F.linear(x, w.q_proj), F.linear(x, w.k_proj), F.linear(x, w.v_proj)), dim=-1)   # [T, C]
    qkv = causal_conv(qkv, w.conv, conv_tail)                                      # [T, C], x's dtype
    q, k, v = qkv.view(T, 3, heads, head_dim).unbind(1)                            # [T, H, D] each
    g, beta = kda_gate(F.linear(F.linear(x, w.f_a_proj), w.f_b_proj), F.linear(x, w.b_proj), w.A_log,
                       w.dt_bias, lower_bound)                                     # [T, H, D] and [T, H], float32
    if dispatch is None:
        dispatch = x.dtype != torch.float32 and x.device.type == "cuda"
    if dispatch and T > 1:                # HF's fla path: q, k, v, beta as they are, l2norm and DK^-0.5 in the op
        out, final = chunk_kda(q, k, v, g, beta.to(x.dtype), state, start, scale=head_dim ** -0.5, qk_l2norm=True)
        state.copy_(final)                                                         # out [T, H, D], x's dtype
    else:
        q = l2norm(q.float()) * (1 / head_dim ** 0.5)                              # HF's 1/sqrt(D), not D**-0.5
        k = l2norm(k.float())
        v = v.float()
        if dispatch:
            out = recurrent_kda_step(q, k, v, g, beta, state[None], [0])           # [1, H, D]
        elif T == 1:
            out = recurrent_step(q[0], k[0], v[0], g[0], beta[0], state)[None]     # [1, H, D]
        else:
            out, final = chunked(q, k, v, g, beta, state, start)                   # [T, H, D]
            state.copy_(final)
    gate = F.linear(F.linear(x, w.g_a_proj), w.g_b_proj).view(T, heads, head_dim)  # [T, H, D]
    out = gated_norm(out.to(x.dtype), gate, w.o_norm, eps)                         # [T, H, D]
    return F.linear(out.reshape(T, width), w.o_proj)                               # [T, E]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over [tail | x] in the weight's dtype, back to x's dtype (HF's flow with a
    float32 conv on bf16 activations); the tail becomes the last K-1 input columns.

    x [T, C], weight [C, K], tail [C, K-1] (x's dtype) -> [T, C]. One code path for every T.
    """
    C, K = weight.shape
    window = torch.cat((tail, x.transpose(0, 1)), dim=1)                           # [C, K-1+T]
    tail.copy_(window[:, window.shape[1] - (K - 1):])
    out = F.conv1d(window.to(weight.dtype)[None], weight[:, None, :], groups=C)[0]   # [C, T]
    return F.silu(out).transpose(0, 1).to(x.dtype)                                 # [T, C]


def gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output norm: all in float32, w·x̂·sigmoid(gate) (no cast between the norm and the weight, unlike
    Qwen's GDN norm), then back to x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)
