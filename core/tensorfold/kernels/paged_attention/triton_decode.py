"""Paged decode attention in Triton: one query token per stream, split-K over the stream's own keys, then a
fixed-order combine, so a stream's bits never depend on the batch around it.

    pass 1, program (b, kv head, split j):  keys [j·S_b, min((j+1)·S_b, len_b)) of stream b, for the
        kv head's GROUP query heads at once (one K/V read serves the group); online softmax in fp32, base 2
        -> m_j (running max), l_j (sum of exp), acc_j (unnormalised output)                     [B, H, splits]
    pass 2, program (b, head):  M = max_j m_j;  out = Σ_j 2^(m_j - M) acc_j / Σ_j 2^(m_j - M) l_j, j in order
                                (with a gate: out rounded, then silu_gate.sigmoid_mul's round(out · round(σ(g))))

A stream's split size S_b is a function of its own length alone: its keys spread over SPREAD splits, each a whole
number of key blocks, at least one block and at most SPLIT_KEYS keys (so a short stream still occupies SPREAD
programs a kv head, and a long one splits every SPLIT_KEYS keys). A stream's splits, block order and reductions
thus depend only on its own length: the same stream gives the same bits alone or in any batch. Keys past a
stream's length (unused rows, padded table entries, NaN-poisoned pages) are never loaded: loads are masked and
scores set to -inf before exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl
from tensorfold.kernels.triton_rounding import round_to

SPLIT_KEYS = 512      # keys per split at most: a stream of n keys runs at least cdiv(n, SPLIT_KEYS) splits
SPREAD = 32           # splits a stream's keys spread over while a split stays under SPLIT_KEYS keys
LOG2E = 1.4426950408889634


@triton.jit
def _split_size(length, SPLIT: tl.constexpr, SPREAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of a stream of `length` keys: SPREAD splits of whole key blocks, within [BLOCK_N, SPLIT]."""
    blocks = tl.cdiv(tl.cdiv(length, SPREAD), BLOCK_N)
    return tl.minimum(tl.maximum(blocks, 1) * BLOCK_N, SPLIT)


@triton.jit
def _split_kernel(q, k_pages, v_pages, tables, lengths, part_m, part_l, part_acc, qk_scale, heads, splits,
                  s_qb, s_qh, s_qd, s_kp, s_kr, s_kh, s_kd, s_vp, s_vr, s_vh, s_vd, s_tb,
                  GROUP: tl.constexpr, PAGE_ROWS: tl.constexpr, SPLIT: tl.constexpr, SPREAD: tl.constexpr,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """One split of one stream's keys for the query heads of one kv head."""
    pdl.ordered(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lengths + b)
    size = _split_size(length, SPLIT, SPREAD, BLOCK_N)
    lo = split * size
    hi = tl.minimum(lo + size, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + g                                                          # [BLOCK_G] query heads
    g_ok = g < GROUP
    q_tile = tl.load(q + b.to(tl.int64) * s_qb + head[:, None] * s_qh + d[None, :] * s_qd,
                     mask=g_ok[:, None] & (d < D)[None, :], other=0.0)              # [BLOCK_G, BLOCK_D]
    table = tables + b.to(tl.int64) * s_tb
    k_head = k_pages + kvh * s_kh
    v_head = v_pages + kvh * s_vh

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        pos = first + n                                                             # [BLOCK_N] key positions
        ok = pos < hi
        page = tl.load(table + pos // PAGE_ROWS, mask=ok, other=0).to(tl.int64)
        row = pos % PAGE_ROWS
        k = tl.load(k_head + page[:, None] * s_kp + row[:, None] * s_kr + d[None, :] * s_kd,
                    mask=ok[:, None] & (d < D)[None, :], other=0.0)                 # [BLOCK_N, BLOCK_D]
        s = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * qk_scale       # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(ok[None, :], s, float("-inf"))                                 # mask before the exp
        m_new = tl.maximum(m, tl.max(s, 1))                                         # finite: each block has a key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        v = tl.load(v_head + page[:, None] * s_vp + row[:, None] * s_vr + dv[None, :] * s_vd,
                    mask=ok[:, None] & (dv < DV)[None, :], other=0.0)               # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    slot = (b.to(tl.int64) * heads + head) * splits + split                         # [BLOCK_G] into [B, H, splits]
    written = g_ok & (lo < hi)
    tl.store(part_m + slot, m, mask=written)
    tl.store(part_l + slot, den, mask=written)
    tl.store(part_acc + slot[:, None] * DV + dv[None, :], acc, mask=written[:, None] & (dv < DV)[None, :])


@triton.jit
def _combine_kernel(part_m, part_l, part_acc, lengths, out, gate, heads, splits, s_ob, s_oh, s_od, s_gb, s_gh,
                    SPLIT: tl.constexpr, SPREAD: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr,
                    BLOCK_DV: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False):
    """Merge one (stream, head)'s splits in split order; a stream with no keys reads zeros. GATED: the result
    times sigmoid(gate[b, h]), each rounded as triton_gate's sigmoid_mul rounds."""
    pdl.ordered(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(lengths + b)
    used = tl.cdiv(length, _split_size(length, SPLIT, SPREAD, BLOCK_N))
    base = (b.to(tl.int64) * heads + h) * splits
    dv = tl.arange(0, BLOCK_DV)
    top = tl.full([], float("-inf"), tl.float32)
    for j in range(0, used):
        top = tl.maximum(top, tl.load(part_m + base + j))
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for j in range(0, used):
        w = tl.exp2(tl.load(part_m + base + j) - top)
        total += w * tl.load(part_l + base + j)
        acc += w * tl.load(part_acc + (base + j) * DV + dv, mask=dv < DV, other=0.0)
    ty = out.dtype.element_ty
    o = round_to(acc / tl.where(total > 0, total, 1.0), ty)
    if GATED:
        g = tl.load(gate + b.to(tl.int64) * s_gb + h * s_gh + dv, mask=dv < DV, other=0.0).to(tl.float32)
        o = round_to(o * round_to(1.0 / (1.0 + tl.exp(-g)), ty), ty)
    tl.store(out + b.to(tl.int64) * s_ob + h * s_oh + dv * s_od, o, mask=dv < DV)


def _block_n(D: int, Dv: int, itemsize: int, block_g: int) -> tuple[int, int, int]:
    """Keys per block, warps, stages from head shape and dtype alone (never the batch); spill-free on sm_90."""
    tile = block_g * max(D, Dv)             # the q / acc tile the program holds
    if itemsize == 4:                       # fp32 runs the exact (non-tensor-core) dot: registers bind
        return (32, 4, 2) if tile <= 2048 else (16, 8, 2)
    if tile <= 16 * 128:
        return 64, 4, 2
    return (32, 4, 2) if tile <= 16 * 256 else (32, 8, 2)


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor, scale: float, split_keys: int = SPLIT_KEYS, spread: int = SPREAD,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention through page tables (inputs validated by the caller): [B, H, D] -> [B, H, Dv]; a stream's
    keys spread over `spread` splits of at most `split_keys` keys (module docstring); gate [B, H, Dv] (unit last
    stride): the output gated in the combine launch."""
    B, H, D = q.shape
    _, R, KVH, Dv = v_pages.shape
    if max(D, Dv) > 256:
        raise ValueError(f"head dims {D}/{Dv}: the Triton path takes at most 256")
    group = H // KVH
    out = torch.empty((B, H, Dv), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    block_g = max(16, triton.next_power_of_2(group))
    block_n, warps, stages = _block_n(D, Dv, q.element_size(), block_g)
    if split_keys % block_n:
        raise ValueError(f"split_keys {split_keys} is not a multiple of the key block {block_n}")
    widest = tables.shape[1] * R
    splits = max(1, min(spread, triton.cdiv(widest, block_n)), triton.cdiv(widest, split_keys))  # the most used
    part_m = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((B, H, splits, Dv), dtype=torch.float32, device=q.device)
    _split_kernel[(B, KVH, splits)](
        q, k_pages, v_pages, tables, lengths, part_m, part_l, part_acc, scale * LOG2E, H, splits,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), tables.stride(0),
        GROUP=group, PAGE_ROWS=R, SPLIT=split_keys, SPREAD=spread, D=D, DV=Dv, BLOCK_G=block_g,
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=max(16, triton.next_power_of_2(Dv)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages, **pdl.options(q))
    _combine_kernel[(B, H)](
        part_m, part_l, part_acc, lengths, out, out if gate is None else gate, H, splits, *out.stride(),
        *((0, 0) if gate is None else gate.stride()[:2]),
        SPLIT=split_keys, SPREAD=spread, BLOCK_N=block_n, DV=Dv, BLOCK_DV=triton.next_power_of_2(Dv),
        GATED=gate is not None, num_warps=1 if Dv <= 128 else 2, **pdl.options(part_m))
    return out
