"""The batched forward: every stream's rows of a step through each layer together (the GPU path).

    rows of all streams -> one [N, E] tensor; projections, norms, MLPs run once over all N rows
    GDN:        1-row streams: conv update + recurrent delta step, batched over slots
                longer streams: conv prefill + chunked delta rule, one stream at a time
    attention:  keys/values scattered into pages through the slots' tables;
                1-row streams: paged decode, batched; longer streams: paged prefill, one stream at a time

It computes what `QwenModel.hidden` computes, but a row's GEMMs now share a batch with other streams' rows, so
its bits may depend on the batch (a GEMM's kernel choice depends on N): concurrent == solo is measured on the
GPU, not assumed. The per-stream forward stays the CPU reference.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.causal_conv1d import causal_conv1d_prefill, causal_conv1d_update
from tensorfold.kernels.gated_delta import chunk_gated_delta, recurrent_gated_delta_step
from tensorfold.kernels.paged_attention import paged_decode, paged_prefill
from tensorfold.kernels.rmsnorm import gated_rms_norm, rms_norm
from tensorfold.kernels.rope import apply_rope
from tensorfold.kv import KvStore
from tensorfold.plan import StepPlan
from tensorfold_qwen.attention import AttentionWeights
from tensorfold_qwen.gdn import GdnWeights, l2norm
from tensorfold_qwen.mlp import MoeWeights, moe, swiglu

CONV, RECURRENT, KEYS, VALUES = "conv", "recurrent", "k", "v"


@attrs.frozen
class Rows:
    """Where each stream's rows sit in the flattened step, and which streams take the one-row path."""

    tokens: torch.Tensor            # [N] long
    positions: torch.Tensor         # [N] long, absolute
    spans: tuple[tuple[int, int], ...]
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    single: tuple[int, ...]         # stream indices with one row
    longer: tuple[int, ...]         # stream indices with more
    single_rows: torch.Tensor       # [B] long: the row of each single stream
    single_slots: torch.Tensor      # [B] long
    sampled_rows: torch.Tensor      # [sampled] long: each sampling stream's last row


def flatten(plan: StepPlan, device: torch.device) -> Rows:
    """Lay every stream's rows end to end."""
    tokens, positions, spans, offset = [], [], [], 0
    for step in plan.streams:
        tokens.extend(step.tokens)
        positions.extend(range(step.start, step.end))
        spans.append((offset, offset + len(step.tokens)))
        offset += len(step.tokens)
    single = tuple(i for i, s in enumerate(plan.streams) if len(s.tokens) == 1)
    longer = tuple(i for i, s in enumerate(plan.streams) if len(s.tokens) > 1)
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return Rows(tokens=as_long(tokens), positions=as_long(positions), spans=tuple(spans),
                slots=tuple(s.slot for s in plan.streams), starts=tuple(s.start for s in plan.streams),
                single=single, longer=longer, single_rows=as_long([spans[i][0] for i in single]),
                single_slots=as_long([plan.streams[i].slot for i in single]),
                sampled_rows=as_long([spans[i][1] - 1 for i, s in enumerate(plan.streams) if s.sample]))


def batched_forward(model, plan: StepPlan, kv: KvStore) -> torch.Tensor:
    """One step for every stream at once; float32 logits [plan.sampled, V]."""
    c, w = model.config, model.weights
    rows = flatten(plan, model.device)
    fresh = [rows.slots[i] for i, start in enumerate(rows.starts) if start == 0]
    x = w.embed[rows.tokens]                                                           # [N, E]
    for index, layer in enumerate(w.layers):
        h = rms_norm(x, layer.input_norm, c.rms_norm_eps, zero_centred=True)
        if isinstance(layer.mixer, GdnWeights):
            for slot in fresh:
                kv.fixed(index, CONV, slot).zero_()
                kv.fixed(index, RECURRENT, slot).zero_()
            x = x + gdn(layer.mixer, c, h, rows, index, kv)
        else:
            x = x + attention(layer.mixer, c, h, rows, index, kv, model.inv_freq)
        h = rms_norm(x, layer.post_norm, c.rms_norm_eps, zero_centred=True)
        x = x + (moe(layer.ffn, h) if isinstance(layer.ffn, MoeWeights) else swiglu(layer.ffn, h))
    last = x[rows.sampled_rows]
    return F.linear(rms_norm(last, w.norm, c.rms_norm_eps, zero_centred=True), w.lm_head).float()


def gdn(w: GdnWeights, c, h: torch.Tensor, rows: Rows, index: int, kv: KvStore) -> torch.Tensor:
    """Gated DeltaNet over the step's rows: [N, E] -> [N, E]."""
    N = h.shape[0]
    mixed = F.linear(h, w.in_proj_qkv)                                                 # [N, C]
    conv = torch.empty_like(mixed)
    if rows.single:
        conv[rows.single_rows] = causal_conv1d_update(mixed[rows.single_rows], w.conv,
                                                      kv.fixed_states(index, CONV), rows.single_slots)
    for i in rows.longer:
        a, b = rows.spans[i]
        conv[a:b] = causal_conv1d_prefill(mixed[a:b], w.conv, kv.fixed(index, CONV, rows.slots[i]))
    q, k, v = conv.split([c.k_heads * c.k_dim, c.k_heads * c.k_dim, c.v_heads * c.v_dim], dim=-1)
    repeat = c.v_heads // c.k_heads
    q = l2norm(q.reshape(N, c.k_heads, c.k_dim).repeat_interleave(repeat, dim=1).float()) * c.k_dim ** -0.5
    k = l2norm(k.reshape(N, c.k_heads, c.k_dim).repeat_interleave(repeat, dim=1).float())
    v = v.reshape(N, c.v_heads, c.v_dim).float()
    beta = torch.sigmoid(F.linear(h, w.in_proj_b)).float()                             # [N, NV]
    g = -w.A_log.float().exp() * F.softplus(F.linear(h, w.in_proj_a).float() + w.dt_bias)   # [N, NV]
    out = torch.empty_like(v)                                                          # [N, NV, DV]
    # fla's chunked kernels take TF32 dots; a float32 model (the checking mode) keeps the exact chunked form.
    chunk_backend = "naive" if h.dtype == torch.float32 else None
    if rows.single:
        r = rows.single_rows
        out[r] = recurrent_gated_delta_step(q[r], k[r], v[r], g[r], beta[r], kv.fixed_states(index, RECURRENT),
                                            rows.single_slots)
    for i in rows.longer:
        a, b = rows.spans[i]
        state = kv.fixed(index, RECURRENT, rows.slots[i])
        out[a:b], final = chunk_gated_delta(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, rows.starts[i],
                                            backend=chunk_backend)
        state.copy_(final)
    z = F.linear(h, w.in_proj_z).view(N, c.v_heads, c.v_dim)
    out = gated_rms_norm(out.to(h.dtype), z, w.norm, c.rms_norm_eps)
    return F.linear(out.reshape(N, c.v_heads * c.v_dim), w.out_proj)


def attention(w: AttentionWeights, c, h: torch.Tensor, rows: Rows, index: int, kv: KvStore,
              inv_freq: torch.Tensor) -> torch.Tensor:
    """Gated attention over the step's rows, keys in pages: [N, E] -> [N, E]."""
    N, H, KV, D = h.shape[0], c.heads, c.kv_heads, c.head_dim
    q, gate = F.linear(h, w.q_proj).view(N, H, 2 * D).chunk(2, dim=-1)
    k = F.linear(h, w.k_proj).view(N, KV, D)
    v = F.linear(h, w.v_proj).view(N, KV, D)
    q = rms_norm(q.reshape(N * H, D), w.q_norm, c.rms_norm_eps, zero_centred=True).view(N, H, D)
    k = rms_norm(k.reshape(N * KV, D), w.k_norm, c.rms_norm_eps, zero_centred=True).view(N, KV, D)
    q = apply_rope(q, rows.positions, inv_freq, c.rotary_dim)
    k = apply_rope(k, rows.positions, inv_freq, c.rotary_dim)
    k_pages, v_pages = kv.row_pages(index, KEYS), kv.row_pages(index, VALUES)
    tables = kv.tables(list(rows.slots)).long()                                        # [streams, width]
    page_rows = k_pages.shape[1]
    owner = torch.repeat_interleave(torch.arange(len(rows.spans), device=h.device),
                                    torch.tensor([b - a for a, b in rows.spans], device=h.device))
    page = tables[owner, rows.positions // page_rows]
    k_pages[page, rows.positions % page_rows] = k
    v_pages[page, rows.positions % page_rows] = v
    out = torch.empty(N, H, D, dtype=h.dtype, device=h.device)
    scale = D ** -0.5
    if rows.single:
        picked = torch.tensor(rows.single, device=h.device)
        r = rows.single_rows
        out[r] = paged_decode(q[r], k_pages, v_pages, tables[picked].int(), (rows.positions[r] + 1).int(), scale)
    for i in rows.longer:
        a, b = rows.spans[i]
        out[a:b] = paged_prefill(q[a:b], k_pages, v_pages, tables[i].int(), rows.starts[i], scale)
    out = out.reshape(N, H * D) * torch.sigmoid(gate.reshape(N, H * D))
    return F.linear(out, w.o_proj)
