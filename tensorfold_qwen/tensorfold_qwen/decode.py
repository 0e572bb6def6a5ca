"""The decode step on the GPU: one token for each of B streams, tensors in and out, no host sync, so a CUDA graph
captures it (core's engine/graphs.py) and replays it for every batch padded to B.

    x = embed(tokens)                                                              [B, E]
    per layer:  h, x = norm(x + mixer output)     the residual add fused into the next norm (at one rank, with
                                                  the mixer's output projection too: kernels.linear_norm)
                GDN:        one GEMM for every input projection, conv update, the delta step with its gate and
                            q/k norms fused, on the streams' slots (padded rows touch none)
                attention:  this row's key/value written through the page tables (padded rows write none),
                            paged decode over keys [0, position]
                ffn:        SwiGLU, or the routed MoE with no host sync (mlp.moe_fused: one GEMM, the routing
                            kernel, the grouped experts with the shared expert among them)
    logits = lm_head(norm(x))                                                      [B, V] float32

The same kernels as batched.py's one-row path, so a stream's rows compute what they compute there.
Shapes in comments: B rows, E hidden, C conv channels, NK/NV key/value heads, DK/DV their dims, H/KV attention
heads, D head dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.causal_conv1d import causal_conv1d_update
from tensorfold.kernels.gated_delta import recurrent_gated_delta_step_gated
from tensorfold.kernels.linear_norm import linear, linear_then_norm, one_launch
from tensorfold.kernels.paged_attention import paged_decode
from tensorfold.kernels.paged_write import decode_rows, write_rows
from tensorfold.kernels.rmsnorm import gated_rms_norm, rms_norm
from tensorfold.kernels.rope import apply_rope
from tensorfold.kernels.silu_gate import sigmoid_mul, silu_mul
from tensorfold.kv import KvStore
from tensorfold.plan import DecodeBatch
from tensorfold_qwen.attention import AttentionWeights
from tensorfold_qwen.gdn import GdnWeights
from tensorfold_qwen.mlp import MoeWeights, moe_then_norm

CONV, RECURRENT, KEYS, VALUES = "conv", "recurrent", "k", "v"
INPUT_GEMV = True   # the mixers' input projections through kernels.linear_norm's one-launch GEMV; False: torch's
                    # (an A/B: docs/kernels.md "linear_norm")
GATE_IN_ATTENTION = True    # the attention output gated in paged_decode's combine; False: sigmoid_mul apart (an A/B)


def decode(model, batch: DecodeBatch, kv: KvStore) -> torch.Tensor:
    """One token per row through every layer; float32 logits [B, V] (rows of padding hold no meaning)."""
    c, w = model.config, model.weights
    page_rows = kv.row_pages(_first_attention(w), KEYS).shape[1]
    dest, lengths = decode_rows(batch.tables, batch.positions, batch.slots, page_rows)  # [B] flat rows, -1 pads;
                                                                                        # [B] keys seen, 0 pads
    x = w.embed[batch.tokens]                                                           # [B, E]
    h = rms_norm(x, w.layers[0].input_norm, c.rms_norm_eps, zero_centred=True)
    for index, layer in enumerate(w.layers):
        if isinstance(layer.mixer, GdnWeights):
            heads, out_proj = gdn_heads(layer.mixer, c, h, batch.slots, index, kv), layer.mixer.out_proj
        else:
            heads = attention_heads(layer.mixer, c, h, batch.positions, batch.tables, dest, lengths, index, kv,
                                    model.inv_freq)
            out_proj = layer.mixer.o_proj
        if model.shard.world == 1:      # the projection, the residual add and the norm: the bits of the three apart
            h, x = linear_then_norm(heads, out_proj, x, layer.post_norm, c.rms_norm_eps, zero_centred=True)
        else:
            h, x = rms_norm(model.shard.reduce(linear(heads, out_proj)), layer.post_norm, c.rms_norm_eps,
                            zero_centred=True, residual=x)
        following = w.layers[index + 1].input_norm if index + 1 < len(w.layers) else w.norm
        joined = None
        if isinstance(layer.ffn, MoeWeights) and model.shard.world == 1:
            joined = moe_then_norm(layer.ffn, h, x, following, c.rms_norm_eps)   # the sum and the norm in one launch
        if joined is None:
            out = model.shard.reduce(ffn(layer.ffn, h))
            joined = rms_norm(out, following, c.rms_norm_eps, zero_centred=True, residual=x)
        h, x = joined
    return F.linear(h, w.lm_head).float()


def _first_attention(w) -> int:
    return next(i for i, layer in enumerate(w.layers) if isinstance(layer.mixer, AttentionWeights))


def ffn(w, h: torch.Tensor) -> torch.Tensor:
    """The dense MLP (gate and up in one GEMM when stacked: the Triton path's layout), or the routed MoE's
    sync-free path."""
    if isinstance(w, MoeWeights):
        from tensorfold_qwen.mlp import moe_routed

        return moe_routed(w, h)
    if w.gate_up is not None:
        gate_up, inner = F.linear(h, w.gate_up), w.down_proj.shape[1]                   # [N, 2F]
        return F.linear(silu_mul(gate_up[:, :inner], gate_up[:, inner:]), w.down_proj)
    return F.linear(silu_mul(F.linear(h, w.gate_proj), F.linear(h, w.up_proj)), w.down_proj)


def gdn(w: GdnWeights, c, h: torch.Tensor, slots: torch.Tensor, index: int, kv: KvStore) -> torch.Tensor:
    """Gated DeltaNet, one row per stream: [B, E] -> [B, E] (the output projection through kernels.linear_norm,
    as the decode step's fused form computes it)."""
    return linear(gdn_heads(w, c, h, slots, index, kv), w.out_proj)


def project_inputs(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A mixer's stacked input projection of one-row streams: linear_norm's GEMV where it is one launch (with
    programmatic dependent launch), so the launches around it need not wait for a library GEMM; else torch's."""
    return linear(h, weight) if INPUT_GEMV and one_launch(h, weight) else F.linear(h, weight)


def gdn_heads(w: GdnWeights, c, h: torch.Tensor, slots: torch.Tensor, index: int, kv: KvStore) -> torch.Tensor:
    """Gated DeltaNet before its output projection: [B, E] -> [B, NV·DV]. One GEMM for [qkv | z | b | a], the
    gate and the q/k l2 norms inside the step kernel."""
    B, C, Z, NV = h.shape[0], 2 * c.k_heads * c.k_dim + c.v_heads * c.v_dim, c.v_heads * c.v_dim, c.v_heads
    proj = project_inputs(h, w.in_proj)                                                 # [B, C + Z + 2·NV]
    mixed = causal_conv1d_update(proj[:, :C], w.conv, kv.fixed_states(index, CONV), slots)   # [B, C]
    q, k, v = mixed.split([c.k_heads * c.k_dim, c.k_heads * c.k_dim, Z], dim=-1)
    out = recurrent_gated_delta_step_gated(
        q.reshape(B, c.k_heads, c.k_dim), k.reshape(B, c.k_heads, c.k_dim), v.reshape(B, NV, c.v_dim),
        proj[:, C + Z + NV:], proj[:, C + Z: C + Z + NV], w.A_log, w.dt_bias, kv.fixed_states(index, RECURRENT),
        slots, scale=c.k_dim ** -0.5)                                                   # [B, NV, DV]
    out = gated_rms_norm(out, proj[:, C: C + Z].reshape(B, NV, c.v_dim), w.norm, c.rms_norm_eps)
    return out.reshape(B, Z)


def attention(w: AttentionWeights, c, h: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
              dest: torch.Tensor, lengths: torch.Tensor, index: int, kv: KvStore,
              inv_freq: torch.Tensor) -> torch.Tensor:
    """Gated attention, one row per stream, keys in pages: [B, E] -> [B, E] (the output projection through
    kernels.linear_norm, as the decode step's fused form computes it)."""
    return linear(attention_heads(w, c, h, positions, tables, dest, lengths, index, kv, inv_freq), w.o_proj)


def attention_heads(w: AttentionWeights, c, h: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                    dest: torch.Tensor, lengths: torch.Tensor, index: int, kv: KvStore,
                    inv_freq: torch.Tensor) -> torch.Tensor:
    """Gated attention before its output projection: [B, E] -> [B, H·D] (the heads gated by sigmoid(gate)).
    dest: each row's flat page row (-1: write none); lengths: keys each row sees (0: none). On a Triton device the
    norms, rotations and page writes are one launch (attention_inputs.py), bit for bit the unfused kernels, and the
    gate is applied in paged decode's combine launch, bit for bit sigmoid_mul."""
    k_pages, v_pages = kv.row_pages(index, KEYS), kv.row_pages(index, VALUES)
    if use_triton(h):
        from tensorfold_qwen.attention_inputs import attention_inputs as fused_attention_inputs

        N, H, D = h.shape[0], c.heads, c.head_dim
        proj = project_inputs(h, w.qkv)                                                 # [N, 2HD + 2·KV·D]
        q = fused_attention_inputs(proj, w.q_norm, w.k_norm, c.rms_norm_eps, positions, inv_freq, c.rotary_dim,
                                   H, c.kv_heads, D, k_pages, v_pages, dest)
        gate = proj[:, : 2 * H * D].view(N, H, 2 * D)[..., D:]                        # [N, H, D] in place
        if GATE_IN_ATTENTION:                                   # gated in paged decode's combine launch
            return paged_decode(q, k_pages, v_pages, tables, lengths, c.head_dim ** -0.5, gate=gate).view(N, H * D)
    else:
        q, gate, k, v = attention_inputs(w, c, h, positions, inv_freq)
        write_rows(k_pages, k, dest)
        write_rows(v_pages, v, dest)
    out = paged_decode(q, k_pages, v_pages, tables, lengths, c.head_dim ** -0.5)
    return sigmoid_mul(out.reshape(h.shape[0], c.heads * c.head_dim), gate)


def attention_inputs(w: AttentionWeights, c, h: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, H, D], gate [N, H·D], k, v [N, KV, D] from one GEMM; q and k normalised and rotated."""
    N, H, KV, D = h.shape[0], c.heads, c.kv_heads, c.head_dim
    q, k, v = F.linear(h, w.qkv).split([2 * H * D, KV * D, KV * D], dim=-1)
    q, gate = q.reshape(N, H, 2 * D).chunk(2, dim=-1)
    q = rms_norm(q.reshape(N * H, D), w.q_norm, c.rms_norm_eps, zero_centred=True).view(N, H, D)
    k = rms_norm(k.reshape(N * KV, D), w.k_norm, c.rms_norm_eps, zero_centred=True).view(N, KV, D)
    q = apply_rope(q, positions, inv_freq, c.rotary_dim)
    k = apply_rope(k, positions, inv_freq, c.rotary_dim)
    return q, gate.reshape(N, H * D), k, v.reshape(N, KV, D)


def attention_output(w: AttentionWeights, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output [N, H, D] gated by sigmoid(gate) and projected: [N, E]."""
    return F.linear(sigmoid_mul(out.reshape(gate.shape), gate), w.o_proj)
