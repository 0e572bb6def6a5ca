"""The batched forward: every stream's rows of a step through each layer together (the GPU path).

    rows of all streams -> one [N, E] tensor; norms and MLPs run once over all N rows
    1-row streams:  the decode step's own layer functions (decode.py), batched over their slots, so a stream's
                    decode row computes the same thing whether a step also holds prefill chunks or not
    longer streams: one stream at a time: conv prefill + chunked delta rule (GDN); keys/values written through
                    the stream's page table, then paged prefill attention

It computes what `QwenModel.hidden` computes, but a row's GEMMs now share a batch with other streams' rows, so
its bits may depend on the batch (a GEMM's kernel choice depends on N): concurrent == solo is measured on the
GPU, not assumed. The per-stream forward stays the CPU reference.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.causal_conv1d import causal_conv1d_prefill
from tensorfold.kernels.gated_delta import chunk_gated_delta, gdn_gate
from tensorfold.kernels.paged_attention import paged_prefill
from tensorfold.kernels.paged_write import row_ids, write_rows
from tensorfold.kernels.rmsnorm import gated_rms_norm, rms_norm
from tensorfold.kv import KvStore
from tensorfold.plan import StepPlan
from tensorfold_qwen import decode
from tensorfold_qwen.attention import AttentionWeights
from tensorfold_qwen.gdn import GdnWeights, l2norm

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
        x = x + decode.ffn(layer.ffn, h)
    last = x[rows.sampled_rows]
    return F.linear(rms_norm(last, w.norm, c.rms_norm_eps, zero_centred=True), w.lm_head).float()


def gdn(w: GdnWeights, c, h: torch.Tensor, rows: Rows, index: int, kv: KvStore) -> torch.Tensor:
    """Gated DeltaNet over the step's rows: [N, E] -> [N, E]; one-row streams exactly as the decode step runs."""
    out = torch.empty_like(h)
    if rows.single:
        out[rows.single_rows] = decode.gdn(w, c, h[rows.single_rows], rows.single_slots, index, kv)
    for i in rows.longer:
        a, b = rows.spans[i]
        out[a:b] = gdn_chunk(w, c, h[a:b], rows.slots[i], rows.starts[i], index, kv)
    return out


def gdn_chunk(w: GdnWeights, c, h: torch.Tensor, slot: int, start: int, index: int, kv: KvStore) -> torch.Tensor:
    """One stream's prefill chunk through a GDN layer: [T, E] -> [T, E]."""
    T, C, Z, NV = h.shape[0], 2 * c.k_heads * c.k_dim + c.v_heads * c.v_dim, c.v_heads * c.v_dim, c.v_heads
    proj = F.linear(h, w.in_proj)                                                      # [T, C + Z + 2·NV]
    mixed = causal_conv1d_prefill(proj[:, :C], w.conv, kv.fixed(index, CONV, slot))   # [T, C]
    q, k, v = mixed.split([c.k_heads * c.k_dim, c.k_heads * c.k_dim, Z], dim=-1)
    repeat = NV // c.k_heads
    q = l2norm(q.reshape(T, c.k_heads, c.k_dim).repeat_interleave(repeat, dim=1).float()) * c.k_dim ** -0.5
    k = l2norm(k.reshape(T, c.k_heads, c.k_dim).repeat_interleave(repeat, dim=1).float())
    g, beta = gdn_gate(proj[:, C + Z + NV:], proj[:, C + Z: C + Z + NV], w.A_log, w.dt_bias)   # [T, NV] each
    state = kv.fixed(index, RECURRENT, slot)
    # fla's chunked kernels take TF32 dots; a float32 model (the checking mode) keeps the exact chunked form.
    out, final = chunk_gated_delta(q, k, v.reshape(T, NV, c.v_dim).float(), g, beta, state, start,
                                   backend="naive" if h.dtype == torch.float32 else None)
    state.copy_(final)
    out = gated_rms_norm(out.to(h.dtype), proj[:, C: C + Z].reshape(T, NV, c.v_dim), w.norm, c.rms_norm_eps)
    return F.linear(out.reshape(T, Z), w.out_proj)


def attention(w: AttentionWeights, c, h: torch.Tensor, rows: Rows, index: int, kv: KvStore,
              inv_freq: torch.Tensor) -> torch.Tensor:
    """Gated attention over the step's rows, keys in pages: [N, E] -> [N, E]; one-row streams exactly as the
    decode step runs."""
    out = torch.empty_like(h)
    tables = kv.tables(list(rows.slots))                                               # int32 [streams, width]
    page_rows = kv.row_pages(index, KEYS).shape[1]
    if rows.single:
        r = rows.single_rows
        picked = tables[torch.tensor(rows.single, device=h.device)]
        positions = rows.positions[r]
        live = torch.ones_like(positions, dtype=torch.bool)
        out[r] = decode.attention(w, c, h[r], positions, picked, row_ids(picked, positions, live, page_rows),
                                  (positions + 1).int(), index, kv, inv_freq)
    for i in rows.longer:
        a, b = rows.spans[i]
        out[a:b] = attention_chunk(w, c, h[a:b], rows.positions[a:b], tables[i], rows.starts[i], index, kv,
                                   inv_freq)
    return out


def attention_chunk(w: AttentionWeights, c, h: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
                    start: int, index: int, kv: KvStore, inv_freq: torch.Tensor) -> torch.Tensor:
    """One stream's prefill chunk through an attention layer: [T, E] -> [T, E]."""
    q, gate, k, v = decode.attention_inputs(w, c, h, positions, inv_freq)
    k_pages, v_pages = kv.row_pages(index, KEYS), kv.row_pages(index, VALUES)
    dest = row_ids(table[None].expand(h.shape[0], -1), positions, torch.ones_like(positions, dtype=torch.bool),
                   k_pages.shape[1])
    write_rows(k_pages, k, dest)
    write_rows(v_pages, v, dest)
    return decode.attention_output(w, paged_prefill(q, k_pages, v_pages, table, start, c.head_dim ** -0.5), gate)
