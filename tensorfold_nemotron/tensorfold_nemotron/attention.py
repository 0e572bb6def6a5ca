"""Nemotron-H's attention mixer for one stream and one step: GQA with no RoPE and no q/k norm.

    q = q_proj(x);  k = k_proj(x);  v = v_proj(x)
    out = softmax(q kᵀ / sqrt(D)) v over the stream's rows [0, end)   (causal on absolute positions)
    -> o_proj

Position enters only through the causal mask (the Mamba2 layers carry order). The KvStore holds keys and values
as projected. On CUDA the chunk attends through core's paged prefill kernel (Triton, float32 softmax, never the
[H, T, S] scores in memory); on the CPU through the eager form below, the reference.
Shapes in comments: T rows of this step, S = end keys visible to the last row, H/KV heads, D head_dim, E hidden.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.paged_attention import paged_prefill
from tensorfold.kv import KvStore
from tensorfold.plan import StreamStep
from tensorfold_nemotron.config import NemotronConfig

KEYS, VALUES = "k", "v"


@attrs.frozen
class AttentionWeights:
    """One attention layer's tensors (HF names under `mixer.`)."""

    q_proj: torch.Tensor                # [H·D, E]
    k_proj: torch.Tensor                # [KV·D, E]
    v_proj: torch.Tensor                # [KV·D, E]
    o_proj: torch.Tensor                # [E, H·D]


def attention(w: AttentionWeights, c: NemotronConfig, x: torch.Tensor, layer: int, step: StreamStep,
              kv: KvStore) -> torch.Tensor:
    """Causal GQA attention of this step's rows over the stream's keys [0, end): [T, E] -> [T, E]."""
    T, H, KV, D = x.shape[0], c.heads, c.kv_heads, c.head_dim
    q = F.linear(x, w.q_proj).view(T, H, D)                                        # [T, H, D]
    # Write this step's rows first, then read the whole window back.
    kv.write_rows(layer, KEYS, step.slot, step.start, F.linear(x, w.k_proj).view(T, KV, D))
    kv.write_rows(layer, VALUES, step.slot, step.start, F.linear(x, w.v_proj).view(T, KV, D))
    if use_triton(x):
        table = kv.tables([step.slot])[0]                                          # [pages] int32
        out = paged_prefill(q, kv.row_pages(layer, KEYS), kv.row_pages(layer, VALUES), table, step.start,
                            D ** -0.5)                                             # [T, H, D]
        return F.linear(out.reshape(T, H * D), w.o_proj)
    keys = kv.rows(layer, KEYS, step.slot, step.end).repeat_interleave(H // KV, dim=1)      # [S, H, D]
    values = kv.rows(layer, VALUES, step.slot, step.end).repeat_interleave(H // KV, dim=1)  # [S, H, D]

    scores = torch.einsum("thd,shd->hts", q, keys) * D ** -0.5                     # [H, T, S]
    key_positions = torch.arange(step.end, device=x.device)                        # [S]
    query_positions = torch.arange(step.start, step.end, device=x.device)          # [T]
    visible = key_positions[None, :] <= query_positions[:, None]                   # [T, S]: causal
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")).float(), dim=-1).to(x.dtype)
    out = torch.einsum("hts,shd->thd", probs, values).reshape(T, H * D)            # [T, H·D]
    return F.linear(out, w.o_proj)                                                 # [T, E]
