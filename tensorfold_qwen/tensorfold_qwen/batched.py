"""The batched forward: every stream's rows of a step through each layer together (the GPU path).

    rows of all streams -> one [N, E] tensor; norms and MLPs run once over all N rows, each residual add fused
                    into the norm after it (the sum rounded as the unfused add rounds it); in a step of prefill
                    chunks alone, a folded MoE's experts' sum, that add and the norm are one launch
    attention:      the step's page tables and its rows' flat key rows uploaded and computed once (KeyRows), at
                    its first attention layer, and read by every attention layer after it
    1-row streams:  the decode step's own layer functions (decode.py), batched over their slots, so a stream's
                    decode row computes the same thing whether a step also holds prefill chunks or not
    longer streams: packed end to end, their GEMMs, norms and rotations once over all their rows; the causal
                    conv one stream at a time (its tail is the stream's); the chunked delta rule in one varlen
                    call (cu_seqlens, each stream's initial state gathered by slot, final states scattered back;
                    q and k l2-normalised and read by the value heads inside that op);
                    keys and values written through each row's page table, then one varlen paged prefill
                    attention. A step's launches grow with its layers, not with its prefilling streams; a step
                    with no one-row stream hands its rows to the mixers as they are (no gather, no scatter)

It computes what `QwenModel.hidden` computes, but a row's GEMMs now share a batch with other streams' rows, so
its bits may depend on the batch (a GEMM's kernel choice depends on N): concurrent == solo is measured on the
GPU, not assumed. The per-stream forward stays the CPU reference.
"""

from __future__ import annotations

from functools import partial

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.causal_conv1d import causal_conv1d_prefill
from tensorfold.kernels.gated_delta import chunk_gated_delta, gdn_gate_from_terms
from tensorfold.kernels.paged_attention import paged_prefill_varlen
from tensorfold.kernels.paged_write import decode_rows, row_ids, write_rows
from tensorfold.kernels.rmsnorm import gated_rms_norm, rms_norm
from tensorfold.kernels.upload import ints
from tensorfold.kv import KvStore
from tensorfold.plan import StepPlan
from tensorfold_qwen import decode
from tensorfold_qwen.attention import AttentionWeights
from tensorfold_qwen.gdn import GdnWeights
from tensorfold_qwen.mlp import MoeWeights, moe_routed, moe_then_norm

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
    extra_rows: torch.Tensor | None  # [logit_rows - sampled] long: every_row shares' other rows (None: no such share)
    logit_order: torch.Tensor | None  # [logit_rows] long: plan order's rows in cat(sampled, extra) (with extra_rows)
    longer_rows: torch.Tensor       # [L] long: the rows of the longer streams, stream after stream
    packed: tuple[int, ...]         # len(longer) + 1 offsets of each longer stream's rows in longer_rows
    longer_slots: torch.Tensor      # [len(longer)] long
    longer_of_row: torch.Tensor     # [L] long: each packed row's longer stream (0 .. len(longer) - 1)
    longer_index: torch.Tensor      # [len(longer)] long: the longer streams' indices in the step
    single_index: torch.Tensor      # [len(single)] long: the one-row streams' indices in the step
    packed_offsets: torch.Tensor    # [len(longer) + 1] int32: `packed` on the device (varlen attention)
    longer_starts: torch.Tensor     # [len(longer)] int32: their first rows' absolute positions
    keys: dict[int, KeyRows] = attrs.field(factory=dict)   # by page rows: filled at the step's first attention layer


@attrs.frozen
class KeyRows:
    """Where a step's rows keep their keys and values: the same page tables and flat rows in every attention layer
    (each layer's pages are indexed alike), so they are uploaded and computed once a step, not once a layer."""

    longer_tables: torch.Tensor | None    # int32 [len(longer), width]: the prefilling streams' tables
    longer_dest: torch.Tensor | None      # [L] int64: each packed row's flat row
    single_tables: torch.Tensor | None    # int32 [len(single), width]
    single_dest: torch.Tensor | None      # [len(single)] int64
    single_lengths: torch.Tensor | None   # [len(single)] int32: the keys each one-row stream's row sees


def key_rows(rows: Rows, kv: KvStore, page_rows: int) -> KeyRows:
    """The step's KeyRows for pages of `page_rows` rows, computed on first use."""
    if page_rows in rows.keys:
        return rows.keys[page_rows]
    tables = kv.tables(list(rows.slots))                                               # int32 [streams, width]
    longer_tables = longer_dest = single_tables = single_dest = single_lengths = None
    if rows.longer:
        longer_tables = tables if only_longer(rows) else tables[rows.longer_index]
        positions = rows.positions if only_longer(rows) else rows.positions[rows.longer_rows]
        longer_dest = row_ids(longer_tables[rows.longer_of_row], positions,
                              torch.ones_like(positions, dtype=torch.bool), page_rows)
    if rows.single:                      # the decode step's own rows and key counts (one launch on a Triton device)
        single_tables = tables[rows.single_index]
        single_dest, single_lengths = decode_rows(single_tables, rows.positions[rows.single_rows], rows.single_slots,
                                                  page_rows)
    rows.keys[page_rows] = KeyRows(longer_tables, longer_dest, single_tables, single_dest, single_lengths)
    return rows.keys[page_rows]


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
    as_long = partial(ints, dtype=torch.long, device=device)
    as_int = partial(ints, dtype=torch.int32, device=device)
    packed, longer_rows, longer_of_row = [0], [], []
    for n, i in enumerate(longer):
        a, b = spans[i]
        longer_rows.extend(range(a, b))
        longer_of_row.extend([n] * (b - a))
        packed.append(packed[-1] + b - a)
    return Rows(tokens=as_long(tokens), positions=as_long(positions), spans=tuple(spans),
                slots=tuple(s.slot for s in plan.streams), starts=tuple(s.start for s in plan.streams),
                single=single, longer=longer, single_rows=as_long([spans[i][0] for i in single]),
                single_slots=as_long([plan.streams[i].slot for i in single]),
                sampled_rows=as_long([spans[i][1] - 1 for i, s in enumerate(plan.streams) if s.sample]),
                **logit_rows(plan, spans, device),
                longer_rows=as_long(longer_rows), packed=tuple(packed),
                longer_slots=as_long([plan.streams[i].slot for i in longer]), longer_of_row=as_long(longer_of_row),
                longer_index=as_long(list(longer)), single_index=as_long(list(single)), packed_offsets=as_int(packed),
                longer_starts=as_int([plan.streams[i].start for i in longer]))


def logit_rows(plan: StepPlan, spans: list[tuple[int, int]], device: torch.device) -> dict[str, torch.Tensor | None]:
    """For a step with every_row shares: their rows other than the sampled ones, and where each of the forward's
    rows (plan order) sits in cat(sampled rows' logits, those rows' logits); the sampled rows' logits are computed
    as in a step without such shares (one GEMM over the same rows), so they stay bitwise the same."""
    if not plan.every_row:
        return {"extra_rows": None, "logit_order": None}
    sampled = sum(1 for s in plan.streams if s.sample)
    extra, order, k = [], [], 0
    for (a, b), s in zip(spans, plan.streams, strict=True):
        if s.every_row:
            for r in range(a, b - s.sample):
                order.append(sampled + len(extra))
                extra.append(r)
        if s.sample:
            order.append(k)
            k += 1
    as_long = partial(ints, dtype=torch.long, device=device)
    return {"extra_rows": as_long(extra), "logit_order": as_long(order)}


def batched_forward(model, plan: StepPlan, kv: KvStore) -> torch.Tensor:
    """One step for every stream at once; float32 logits [plan.logit_rows, V]."""
    c, w = model.config, model.weights
    rows = flatten(plan, model.device)
    fresh = [rows.slots[i] for i, start in enumerate(rows.starts) if start == 0]
    x = w.embed[rows.tokens]                                                           # [N, E]
    h = rms_norm(x, w.layers[0].input_norm, c.rms_norm_eps, zero_centred=True)
    for index in range(len(w.layers)):
        h, x = layer_step(model, index, h, x, rows, kv, fresh)
    last = x[rows.sampled_rows]
    logits = F.linear(rms_norm(last, w.norm, c.rms_norm_eps, zero_centred=True), w.lm_head).float()
    if rows.extra_rows is None:
        return logits
    extra = F.linear(rms_norm(x[rows.extra_rows], w.norm, c.rms_norm_eps, zero_centred=True), w.lm_head).float()
    return torch.cat([logits, extra]).index_select(0, rows.logit_order)


def layer_step(model, index: int, h: torch.Tensor, x: torch.Tensor, rows: Rows, kv: KvStore, fresh: list[int]
               ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Layer `index` over the step's rows, from x (the residual stream, [N, E]) and h (its input norm): returns
    the next layer's h and x. Each residual add is fused into the norm after it (the kernel rounds the sum as
    `x + out` does); the last layer's is not (h None), as the final norm reads only the rows that give logits."""
    c, w = model.config, model.weights
    layer = w.layers[index]
    if isinstance(layer.mixer, GdnWeights):
        for slot in fresh:                                                             # streams starting here
            kv.fixed(index, CONV, slot).zero_()
            kv.fixed(index, RECURRENT, slot).zero_()
        mixed = gdn(layer.mixer, c, h, rows, index, kv)
    else:
        mixed = attention(layer.mixer, c, h, rows, index, kv, model.inv_freq)
    h, x = rms_norm(model.shard.reduce(mixed), layer.post_norm, c.rms_norm_eps, zero_centred=True,
                    residual=x)                                                        # row-parallel: summed
    last = index + 1 == len(w.layers)
    if not last and model.shard.world == 1 and isinstance(layer.ffn, MoeWeights) and only_longer(rows):
        joined = moe_then_norm(layer.ffn, h, x, w.layers[index + 1].input_norm, c.rms_norm_eps, kind="prefill")
        if joined is not None:                                  # the experts' sum, the add and the norm in one launch
            return joined
    out = model.shard.reduce(ffn(layer.ffn, h, rows))
    if last:
        return None, x + out
    return rms_norm(out, w.layers[index + 1].input_norm, c.rms_norm_eps, zero_centred=True, residual=x)


def ffn(w, h: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The feed-forward over the step's rows: a MoE's prefill rows through the experts' prefill tiles, its one-row
    streams through the decode tiles the captured step uses (a row's bits are the same in any call of one kind)."""
    if not isinstance(w, MoeWeights) or not rows.longer:
        return decode.ffn(w, h)
    if not rows.single:
        return moe_routed(w, h, kind="prefill")
    out = torch.empty_like(h)
    out[rows.single_rows] = moe_routed(w, h[rows.single_rows])
    out[rows.longer_rows] = moe_routed(w, h[rows.longer_rows], kind="prefill")
    return out


def only_longer(rows: Rows) -> bool:
    """Every row of the step is a prefilling stream's, in order (longer_rows is 0 .. N-1): a mixer takes them as
    they are, no gather in and no scatter out."""
    return bool(rows.longer) and not rows.single


def gdn(w: GdnWeights, c, h: torch.Tensor, rows: Rows, index: int, kv: KvStore) -> torch.Tensor:
    """Gated DeltaNet over the step's rows: [N, E] -> [N, E]; one-row streams exactly as the decode step runs."""
    if only_longer(rows):
        return gdn_chunks(w, c, h, rows, index, kv)
    out = torch.empty_like(h)
    if rows.single:
        out[rows.single_rows] = decode.gdn(w, c, h[rows.single_rows], rows.single_slots, index, kv)
    if rows.longer:
        out[rows.longer_rows] = gdn_chunks(w, c, h[rows.longer_rows], rows, index, kv)
    return out


def gdn_chunks(w: GdnWeights, c, h: torch.Tensor, rows: Rows, index: int, kv: KvStore) -> torch.Tensor:
    """The prefilling streams' chunks through a GDN layer, packed: [T, E] -> [T, E] (T their rows end to end)."""
    T, C, Z, NV = h.shape[0], 2 * c.k_heads * c.k_dim + c.v_heads * c.v_dim, c.v_heads * c.v_dim, c.v_heads
    proj = F.linear(h, w.in_proj)                                                      # [T, C + Z + 2·NV]
    bounds = rows.packed
    mixed = torch.empty((T, C), dtype=h.dtype, device=h.device)                        # [T, C]
    for i, a, b in zip(rows.longer, bounds[:-1], bounds[1:], strict=True):            # each stream's rows in place
        causal_conv1d_prefill(proj[a:b, :C], w.conv, kv.fixed(index, CONV, rows.slots[i]), out=mixed[a:b])
    q, k, v = mixed.split([c.k_heads * c.k_dim, c.k_heads * c.k_dim, Z], dim=-1)
    # q, k go in as the conv wrote them, NK heads each: the op reads key head i // (NV / NK) for value head i and
    # l2-normalises q and k itself, q scaled by DK^-0.5 (a bf16 model: fla's in-kernel l2norm, one launch each, as
    # HF's fla path calls it; a float32 model, the checking mode, keeps the exact chunked form: repeat, float32,
    # l2norm, scale, in gdn.py's order).
    g, beta = gdn_gate_from_terms(proj[:, C + Z + NV:], proj[:, C + Z: C + Z + NV], w.gate_decay,
                                  w.gate_bias)                                         # [T, NV] each
    states = kv.fixed_states(index, RECURRENT)                                         # [slots, NV, DK, DV]
    out, final = chunk_gated_delta(q.reshape(T, c.k_heads, c.k_dim), k.reshape(T, c.k_heads, c.k_dim),
                                   v.reshape(T, NV, c.v_dim), g, beta,
                                   states.index_select(0, rows.longer_slots), cu_seqlens=bounds,
                                   starts=[rows.starts[i] for i in rows.longer], scale=c.k_dim ** -0.5,
                                   qk_l2norm=True, backend="naive" if h.dtype == torch.float32 else None)
    states.index_copy_(0, rows.longer_slots, final)
    out = gated_rms_norm(out.to(h.dtype), proj[:, C: C + Z].reshape(T, NV, c.v_dim), w.norm, c.rms_norm_eps)
    return F.linear(out.reshape(T, Z), w.out_proj)


def attention(w: AttentionWeights, c, h: torch.Tensor, rows: Rows, index: int, kv: KvStore,
              inv_freq: torch.Tensor) -> torch.Tensor:
    """Gated attention over the step's rows, keys in pages: [N, E] -> [N, E]; one-row streams exactly as the
    decode step runs."""
    keys = key_rows(rows, kv, kv.row_pages(index, KEYS).shape[1])
    if only_longer(rows):
        return attention_chunks(w, c, h, rows.positions, keys.longer_tables, rows, index, kv, inv_freq,
                                keys.longer_dest)
    out = torch.empty_like(h)
    if rows.single:
        r = rows.single_rows
        out[r] = decode.attention(w, c, h[r], rows.positions[r], keys.single_tables, keys.single_dest,
                                  keys.single_lengths, index, kv, inv_freq)
    if rows.longer:
        r = rows.longer_rows
        out[r] = attention_chunks(w, c, h[r], rows.positions[r], keys.longer_tables, rows, index, kv, inv_freq,
                                  keys.longer_dest)
    return out


def attention_chunks(w: AttentionWeights, c, h: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                     rows: Rows, index: int, kv: KvStore, inv_freq: torch.Tensor, dest: torch.Tensor
                     ) -> torch.Tensor:
    """The prefilling streams' chunks through an attention layer, packed: [T, E] -> [T, E]; `tables` theirs,
    `dest` their rows' flat key rows (KeyRows)."""
    q, gate, k, v = decode.attention_inputs(w, c, h, positions, inv_freq)
    k_pages, v_pages = kv.row_pages(index, KEYS), kv.row_pages(index, VALUES)
    write_rows(k_pages, k, dest)
    write_rows(v_pages, v, dest)
    longest = max(b - a for a, b in zip(rows.packed[:-1], rows.packed[1:], strict=True))
    out = paged_prefill_varlen(q, k_pages, v_pages, tables, rows.packed_offsets, rows.longer_starts, longest,
                               c.head_dim ** -0.5)
    return decode.attention_output(w, out, gate)
