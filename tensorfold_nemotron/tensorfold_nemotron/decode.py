"""The decode step: one token for each of B streams, tensors in and out, no host sync, so a CUDA graph captures it
(core's engine/graphs.py) and replays it for every batch padded to B.

    x = embed(tokens)                                                              [B, E]
    per layer:  x = x + mixer(rms_norm(x))
                Mamba2:     in_proj, conv update on the streams' tails, the SSD step on their float32 states
                            with dt as mamba.time_steps and the D skip inside it (kernels.ssd.ssd_step_gated; both
                            in place; padded rows touch neither), the grouped gated norm in one kernel
                            (kernels.rmsnorm.grouped_gated_rms_norm), out_proj
                norms:      each block's norm fused with the residual add before it (kernels.rmsnorm.rms_norm)
                attention:  this row's key/value written through the page tables (padded rows write none), paged
                            decode over keys [0, position]
                MLP / MoE:  mlp.py's own functions (the router has no host sync; the experts run through
                            kernels.moe.routed_experts, whose Triton path has none)
                TP=N:       each mixer's output is this rank's part, summed over ranks by shard.reduce as in
                            model.py (every kernel above runs on the rank's heads, groups and columns)
    logits = lm_head(rms_norm(x))                                                  [B, V] float32

Every op is model.py's one-token path on B rows instead of one, except the two that take slots instead of one
stream's state (causal_conv1d_update for causal_conv1d_prefill, paged_decode for the dense attention), so a
stream's row computes what `forward` computes for it: on the CPU a batch of one gives forward's bits; in a larger
batch the GEMMs and the vectorised softplus, sigmoid, silu and rsqrt round a row by its place in the batch (a few
ulps; tests/test_nemotron_decode.py). On CUDA the conv, SSD step, paged write/decode and MoE kernels are Triton.
A row at position 0 must go through `forward` (it clears the stream's states); the runner never sends one.
Shapes in comments: B rows, E hidden, I Mamba2 inner, C conv channels, MH heads of P, G groups, N state, H/KV
attention heads of D, V vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tensorfold.kernels.causal_conv1d import causal_conv1d_update
from tensorfold.kernels.paged_attention import paged_decode
from tensorfold.kernels.paged_write import decode_rows, write_rows
from tensorfold.kernels.rmsnorm import grouped_gated_rms_norm
from tensorfold.kernels.rmsnorm import rms_norm as core_rms_norm
from tensorfold.kernels.ssd import ssd_step_gated
from tensorfold.kv import KvStore
from tensorfold.plan import DecodeBatch
from tensorfold_nemotron.attention import AttentionWeights
from tensorfold_nemotron.config import NemotronConfig
from tensorfold_nemotron.mamba import MambaWeights
from tensorfold_nemotron.mlp import MoeWeights, mlp, moe

if TYPE_CHECKING:
    from tensorfold_nemotron.model import NemotronModel, Weights

CONV, SSM, KEYS, VALUES = "conv", "ssm", "k", "v"


def decode(model: NemotronModel, batch: DecodeBatch, kv: KvStore) -> torch.Tensor:
    """One token per row through every layer; float32 logits [B, V] (rows of padding hold no meaning)."""
    c, w = model.config, model.weights
    first = _first_attention(w)
    dest, lengths = None, None
    if first is not None:                   # [B] flat rows, -1 pads; [B] int32 keys seen, 0 pads
        dest, lengths = decode_rows(batch.tables, batch.positions, batch.slots, kv.row_pages(first, KEYS).shape[1])
    x = w.embed[batch.tokens]                                                           # [B, E]
    h = fused_norm(x, w.layers[0].norm, c.eps)
    for index, layer in enumerate(w.layers):
        mixer = layer.mixer
        if isinstance(mixer, MambaWeights):
            out = mamba2(mixer, c, h, batch.slots, index, kv)
        elif isinstance(mixer, AttentionWeights):
            out = attention(mixer, c, h, batch.tables, dest, lengths, index, kv)
        elif isinstance(mixer, MoeWeights):
            out = moe(mixer, c, h)
        else:
            out = mlp(mixer, h)
        out = model.shard.reduce(out)                                                  # the ranks' parts (TP=N)
        following = w.layers[index + 1].norm if index + 1 < len(w.layers) else w.norm
        h, x = fused_norm(out, following, c.eps, residual=x)                          # x + out, normalised
    return F.linear(h, w.lm_head).float()


def fused_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """norms.rms_norm through core's op (plain, not zero-centred: the same float32 math and one cast, so the CPU's
    bits are the family's), with the residual add fused in: one kernel on CUDA instead of eight."""
    return core_rms_norm(x, weight, eps, zero_centred=False, residual=residual)


def _first_attention(w: Weights) -> int | None:
    """The first attention layer's index (its pages give the page size), or None in a model without one."""
    return next((i for i, layer in enumerate(w.layers) if isinstance(layer.mixer, AttentionWeights)), None)


def mamba2(w: MambaWeights, c: NemotronConfig, h: torch.Tensor, slots: torch.Tensor, index: int,
           kv: KvStore) -> torch.Tensor:
    """Mamba2, one row per stream, on the slots' conv tails and SSM states (in place): [B, E] -> [B, E]."""
    rows, inner, G, N, MH, P = h.shape[0], c.mamba_inner, c.n_groups, c.state_size, c.mamba_heads, c.mamba_head_dim
    z, xbc, dt = F.linear(h, w.in_proj).split([inner, c.conv_dim, MH], dim=-1)        # [B, I], [B, C], [B, MH]
    xbc = causal_conv1d_update(xbc, w.conv, kv.fixed_states(index, CONV, h.dtype), slots, w.conv_bias)  # silu'd
    xs, B, C = xbc.split([inner, G * N, G * N], dim=-1)
    xs = xs.reshape(rows, MH, P)                                                       # [B, MH, P]
    B, C = B.reshape(rows, G, N), C.reshape(rows, G, N)                                # [B, G, N]
    low, high = c.dt_limit
    y = ssd_step_gated(xs, dt, w.dt_bias, w.A, w.D, B, C, kv.fixed_states(index, SSM, torch.float32), slots,
                       dt_min=low, dt_max=high)                                        # [B, MH, P] float32, D skip
    out = grouped_gated_rms_norm(y.reshape(rows, inner), z, w.norm, G, c.eps)          # [B, I]
    return F.linear(out, w.out_proj)                                                   # [B, E]


def attention(w: AttentionWeights, c: NemotronConfig, h: torch.Tensor, tables: torch.Tensor,
              dest: torch.Tensor, lengths: torch.Tensor, index: int, kv: KvStore) -> torch.Tensor:
    """GQA (no RoPE), one row per stream, keys in pages: [B, E] -> [B, E]. dest: each row's flat page row (-1:
    write none); lengths: keys each row sees (0: none)."""
    rows, H, KV, D = h.shape[0], c.heads, c.kv_heads, c.head_dim
    q = F.linear(h, w.q_proj).view(rows, H, D)                                         # [B, H, D]
    k_pages, v_pages = kv.row_pages(index, KEYS), kv.row_pages(index, VALUES)        # [pages, R, KV, D]
    write_rows(k_pages, F.linear(h, w.k_proj).view(rows, KV, D), dest)
    write_rows(v_pages, F.linear(h, w.v_proj).view(rows, KV, D), dest)
    out = paged_decode(q, k_pages, v_pages, tables, lengths, D ** -0.5)                # [B, H, D]
    return F.linear(out.reshape(rows, H * D), w.o_proj)                                # [B, E]
