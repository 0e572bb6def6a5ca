"""Gated attention, the full-attention mixer of Qwen3.5, for one stream and one step.

    [q | gate] = q_proj(x) per head;  k = k_proj(x);  v = v_proj(x)
    q, k <- zero-centred RMSNorm per head, then partial RoPE at absolute positions
    out = softmax(q kᵀ / sqrt(D)) v over the stream's rows [0, end)   (GQA, causal on absolute positions)
    out <- out · sigmoid(gate) -> o_proj

The KvStore holds keys after k_norm and RoPE, values as projected.
Shapes in comments: T rows of this step, S = end keys visible to the last row, H/KV heads, D head_dim, E hidden.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kv import KvStore
from tensorfold.plan import StreamStep
from tensorfold_qwen.config import QwenConfig
from tensorfold_qwen.layers import apply_rope, rms_norm


@attrs.frozen
class AttentionWeights:
    """One attention layer's tensors (HF names under `self_attn.`)."""

    q_proj: torch.Tensor                # [H·2D, E]     per head: D query rows, then D gate rows
    k_proj: torch.Tensor                # [KV·D, E]
    v_proj: torch.Tensor                # [KV·D, E]
    o_proj: torch.Tensor                # [E, H·D]
    q_norm: torch.Tensor                # [D]           zero-centred
    k_norm: torch.Tensor                # [D]           zero-centred
    qkv: torch.Tensor | None = None     # [H·2D + 2·KV·D, E]: q_proj, k_proj, v_proj in one matrix (fused.py)


def gated_attention(w: AttentionWeights, c: QwenConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    layer: int, step: StreamStep, kv: KvStore) -> torch.Tensor:
    """Causal GQA attention of this step's rows over the stream's keys [0, end), output-gated: [T, E] -> [T, E]."""
    T, H, KV, D = x.shape[0], c.heads, c.kv_heads, c.head_dim
    q, gate = F.linear(x, w.q_proj).view(T, H, 2 * D).chunk(2, dim=-1)            # [T, H, D] each
    k = F.linear(x, w.k_proj).view(T, KV, D)                                       # [T, KV, D]
    v = F.linear(x, w.v_proj).view(T, KV, D)                                       # [T, KV, D]
    q = apply_rope(rms_norm(q, w.q_norm, c.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(k, w.k_norm, c.rms_norm_eps), cos, sin)

    # Write this step's rows first, then read the whole window back.
    kv.write_rows(layer, "k", step.slot, step.start, k)
    kv.write_rows(layer, "v", step.slot, step.start, v)
    keys = kv.rows(layer, "k", step.slot, step.end).repeat_interleave(H // KV, dim=1)      # [S, H, D]
    values = kv.rows(layer, "v", step.slot, step.end).repeat_interleave(H // KV, dim=1)    # [S, H, D]

    scores = torch.einsum("thd,shd->hts", q, keys) * D ** -0.5                     # [H, T, S]
    key_positions = torch.arange(step.end, device=x.device)                        # [S]
    query_positions = torch.arange(step.start, step.end, device=x.device)          # [T]
    visible = key_positions[None, :] <= query_positions[:, None]                   # [T, S]: causal
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")).float(), dim=-1).to(x.dtype)
    out = torch.einsum("hts,shd->thd", probs, values).reshape(T, H * D)           # [T, H·D]
    out = out * torch.sigmoid(gate.reshape(T, H * D))
    return F.linear(out, w.o_proj)                                                 # [T, E]
