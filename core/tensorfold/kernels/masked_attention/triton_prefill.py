"""Masked attention in Triton: flash attention whose mask is a per-row key selection, bit-stable per row.

    program (row block, head):  BLOCK_M query rows; keys in blocks of BLOCK_N on the absolute grid (block j holds
        keys [j·BLOCK_N, (j+1)·BLOCK_N)), in increasing order, from the block of the first key any of the rows
        selects to that of the last (SKIP_EMPTY: a block none of them selects is skipped); online softmax in fp32,
        base 2; out = acc / den (0 for a row that selects nothing)

Why a row's bits depend only on its q, its mask row and its keys: the tiles are fixed per head dim and dtype (no
autotuning, nothing by T or S); a row's scores, max, sum and dot products are its own (no reduction across rows);
and a block that selects none of the row's keys is an exact no-op for it, computed or skipped: its max stays (so
alpha is set to exactly 1), its probabilities are set to exactly 0, and den + 0, acc · 1 + 0 change nothing. So a
row sees the same sequence of effective updates whatever rows share its program and wherever the call's keys end.

The mask travels as bits (int32 words [T, ceil(S / 32)], key s is bit s % 32 of word s // 32), packed by two
cheap torch ops: every head's program reads its rows' words, 1/8 of the bool mask's bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
WORD = 32                                   # mask keys per int32 word
SKIP_EMPTY = False                          # test each key block's selection before its dots (slower)


@triton.jit
def _update(q_tile, k_head, v_head, key, key_ok, sel, m, den, acc, qk_scale, s_ks, s_kd, s_vs, s_vd, d, dv,
            DQ: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr):
    """One key block's online-softmax step; exactly a no-op for a row that selects none of its keys."""
    keys = key.to(tl.int64)
    kt = tl.load(k_head + keys[:, None] * s_ks + d[None, :] * s_kd,
                 mask=key_ok[:, None] & (d < DQ)[None, :], other=0.0)               # [BLOCK_N, BLOCK_D]
    s = tl.dot(q_tile, tl.trans(kt), input_precision=PRECISION) * qk_scale          # [BLOCK_M, BLOCK_N]
    s = tl.where(sel, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                            # no key yet: exp2 of -inf
    alpha = tl.where(m == m_new, 1.0, tl.exp2(m - m_use))                           # exactly 1 when the max stays
    p = tl.where(sel, tl.exp2(s - m_use[:, None]), 0.0)                             # exactly 0 off the selection
    den = den * alpha + tl.sum(p, 1)
    vt = tl.load(v_head + keys[:, None] * s_vs + dv[None, :] * s_vd,
                 mask=key_ok[:, None] & (dv < DV)[None, :], other=0.0)              # [BLOCK_N, BLOCK_DV]
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
    return m_new, den, acc


@triton.jit(do_not_specialize=["T", "S"])
def _masked_kernel(q, k, v, bits, out, qk_scale, T, S, s_qt, s_qh, s_qd, s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, s_bt,
                   s_ot, s_oh, s_od, DQ: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
                   SKIP_EMPTY: tl.constexpr, BLOCK_W: tl.constexpr):
    """BLOCK_M query rows of one head over the key blocks between the first and last its rows select (SKIP_EMPTY:
    skipping a block none of them selects)."""
    block = tl.program_id(0)
    h = tl.program_id(1)
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)                                     # [BLOCK_M] query rows
    i_ok = i < T
    rows = i.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    n = tl.arange(0, BLOCK_N)
    q_tile = tl.load(q + rows[:, None] * s_qt + h * s_qh + d[None, :] * s_qd,
                     mask=i_ok[:, None] & (d < DQ)[None, :], other=0.0)             # [BLOCK_M, BLOCK_D]
    k_head = k + h * s_kh
    v_head = v + h * s_vh
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    n_words = tl.cdiv(S, 32)
    lo_word = n_words
    hi_word = 0
    for w0 in range(0, n_words, BLOCK_W):                                           # the program's selected span
        w = w0 + tl.arange(0, BLOCK_W)
        ws = tl.load(bits + rows[:, None] * s_bt + w[None, :], mask=i_ok[:, None] & (w < n_words)[None, :], other=0)
        lo_word = tl.minimum(lo_word, tl.min(tl.min(tl.where(ws != 0, w[None, :], n_words), 1), 0))
        hi_word = tl.maximum(hi_word, tl.max(tl.max(tl.where(ws != 0, w[None, :] + 1, 0), 1), 0))
    lo = (lo_word * 32) // BLOCK_N * BLOCK_N                                        # on the absolute key grid
    hi = tl.minimum(hi_word * 32, S)
    for first in range(lo, hi, BLOCK_N):
        key = first + n                                                             # [BLOCK_N] absolute keys
        key_ok = key < S
        words = tl.load(bits + rows[:, None] * s_bt + (key // 32)[None, :],
                        mask=i_ok[:, None] & key_ok[None, :], other=0)             # [BLOCK_M, BLOCK_N]
        sel = ((words >> (key % 32)[None, :]) & 1) != 0
        if SKIP_EMPTY:
            if tl.max(tl.max(sel.to(tl.int32), 1), 0) > 0:                          # else: a no-op for every row
                m, den, acc = _update(q_tile, k_head, v_head, key, key_ok, sel, m, den, acc, qk_scale, s_ks, s_kd,
                                      s_vs, s_vd, d, dv, DQ, DV, PRECISION)
        else:
            m, den, acc = _update(q_tile, k_head, v_head, key, key_ok, sel, m, den, acc, qk_scale, s_ks, s_kd, s_vs,
                                  s_vd, d, dv, DQ, DV, PRECISION)
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out + rows[:, None] * s_ot + h * s_oh + dv[None, :] * s_od, o.to(out.dtype.element_ty),
             mask=i_ok[:, None] & (dv < DV)[None, :])


def config(DQ: int, DV: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) by head dims and dtype only: BLOCK_N fixes the key grid, so a row's bits.
    The 16-bit tiles are the fastest without spills at GLM's widths on the H200 (bench/masked_attention_tiles.py)."""
    width = max(DQ, DV)
    if dtype == torch.float32:              # the exact (non-tensor-core) dot: registers bind
        return (32, 32, 4, 2) if width <= 64 else (32, 16, 4, 2) if width <= 128 else (16, 16, 4, 2)
    if width <= 128:
        return 128, 128, 8, 2
    return 128, 64, 8, 2


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [T, S] -> int32 words [T, ceil(S / 32)], key s at bit s % 32 of word s // 32 (bytes little-endian)."""
    T, S = mask.shape
    words = -(-S // WORD)
    padded = torch.zeros((T, words * WORD), dtype=torch.uint8, device=mask.device)
    padded[:, :S] = mask
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    packed = (padded.view(T, words * 4, 8) << shifts).sum(-1, dtype=torch.uint8)    # one byte per 8 keys
    return packed.view(torch.int32)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     tiles: tuple[int, int, int, int] | None = None, skip_empty: bool = SKIP_EMPTY) -> torch.Tensor:
    """The kernel over validated inputs: [T, H, DQ] -> [T, H, DV]; `tiles` overrides config() (tests only)."""
    T, H, DQ = q.shape
    S, DV = k.shape[0], v.shape[2]
    if max(DQ, DV) > 256:
        raise ValueError(f"head dims {DQ}/{DV}: the Triton path takes at most 256")
    out = torch.zeros((T, H, DV), dtype=q.dtype, device=q.device)
    if T == 0 or S == 0 or H == 0:
        return out
    launch(q, k, v, pack_mask(mask), out, scale, tiles or config(DQ, DV, q.dtype), skip_empty)
    return out


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bits: torch.Tensor, out: torch.Tensor, scale: float,
           tiles: tuple[int, int, int, int], skip_empty: bool = SKIP_EMPTY):
    """One launch over a packed mask; returns Triton's compiled kernel (bench/masked_attention_tiles.py reads its
    registers and spills)."""
    T, H, DQ = q.shape
    S, DV = k.shape[0], v.shape[2]
    block_m, block_n, warps, stages = tiles
    return _masked_kernel[(triton.cdiv(T, block_m), H)](
        q, k, v, bits, out, scale * LOG2E, T, S, *q.stride(), *k.stride(), *v.stride(), bits.stride(0),
        *out.stride(), DQ=DQ, DV=DV, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(DQ)), BLOCK_DV=max(16, triton.next_power_of_2(DV)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SKIP_EMPTY=skip_empty, BLOCK_W=64,
        num_warps=warps, num_stages=stages)
