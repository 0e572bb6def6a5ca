"""Paged prefill attention in Triton: flash attention over a stream's pages, causal on absolute positions.

    program (row block, head, stream):  query rows i of the block sit at positions start + i; keys [0, start + T)
        are read through the page table in blocks of BLOCK_N; blocks every row sees run unmasked, the diagonal
        blocks mask key > query; online softmax in fp32, base 2; out = acc / den

The single-stream form takes `start` and T as scalars (no host-to-device copy); the varlen form reads each
stream's rows from cu_seqlens and its start from `starts`. Keys past start + T are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _blocks(q_tile, m, den, acc, k_head, v_head, table, qpos, lo, hi, end, qk_scale, s_kp, s_kr, s_kd, s_vp,
            s_vr, s_vd, PAGE_ROWS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Fold key blocks [lo, hi) into the running (m, den, acc); CAUSAL masks keys past each row and past `end`."""
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    n = tl.arange(0, BLOCK_N)
    for first in range(lo, hi, BLOCK_N):
        pos = first + n                                                             # [BLOCK_N] key positions
        ok = pos < end
        page = tl.load(table + pos // PAGE_ROWS, mask=ok, other=0).to(tl.int64)
        row = pos % PAGE_ROWS
        k = tl.load(k_head + page[:, None] * s_kp + row[:, None] * s_kr + d[None, :] * s_kd,
                    mask=ok[:, None] & (d < D)[None, :], other=0.0)                 # [BLOCK_N, BLOCK_D]
        s = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * qk_scale       # [BLOCK_M, BLOCK_N]
        if CAUSAL:
            s = tl.where((pos[None, :] <= qpos[:, None]) & ok[None, :], s, float("-inf"))   # mask before the exp
        m_new = tl.maximum(m, tl.max(s, 1))                                         # finite: key 0 came first
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        v = tl.load(v_head + page[:, None] * s_vp + row[:, None] * s_vr + dv[None, :] * s_vd,
                    mask=ok[:, None] & (dv < DV)[None, :], other=0.0)               # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, den, acc


@triton.jit
def _prefill_kernel(q, k_pages, v_pages, tables, cu_seqlens, starts, out, qk_scale, rows_arg, start_arg,
                    s_qt, s_qh, s_qd, s_kp, s_kr, s_kh, s_kd, s_vp, s_vr, s_vh, s_vd, s_tb, s_ot, s_oh, s_od,
                    GROUP: tl.constexpr, PAGE_ROWS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    VARLEN: tl.constexpr, PRECISION: tl.constexpr):
    """BLOCK_M query rows of one head of one stream."""
    block = tl.program_id(0)
    h = tl.program_id(1)
    stream = tl.program_id(2)
    if VARLEN:
        row0 = tl.load(cu_seqlens + stream)
        rows = tl.load(cu_seqlens + stream + 1) - row0
        start = tl.load(starts + stream)
    else:
        row0 = 0
        rows = rows_arg
        start = start_arg
    kvh = h // GROUP
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)                                     # [BLOCK_M] rows of the chunk
    i_ok = i < rows
    qpos = start + i                                                                # absolute positions
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = (row0 + i).to(tl.int64)
    q_tile = tl.load(q + q_rows[:, None] * s_qt + h * s_qh + d[None, :] * s_qd,
                     mask=i_ok[:, None] & (d < D)[None, :], other=0.0)              # [BLOCK_M, BLOCK_D]
    table = tables + stream.to(tl.int64) * s_tb
    k_head = k_pages + kvh * s_kh
    v_head = v_pages + kvh * s_vh

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    first_row = start + block * BLOCK_M                                             # every row sees keys <= this
    end = tl.minimum(start + rows, first_row + BLOCK_M)                             # no row sees keys >= end
    end = tl.where(block * BLOCK_M < rows, end, 0)                                  # a block past the chunk: idle
    full = tl.minimum((first_row + 1) // BLOCK_N * BLOCK_N, end)                    # blocks seen whole by all rows
    m, den, acc = _blocks(q_tile, m, den, acc, k_head, v_head, table, qpos, 0, full, end, qk_scale, s_kp, s_kr,
                          s_kd, s_vp, s_vr, s_vd, PAGE_ROWS, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, PRECISION)
    m, den, acc = _blocks(q_tile, m, den, acc, k_head, v_head, table, qpos, full, end, end, qk_scale, s_kp, s_kr,
                          s_kd, s_vp, s_vr, s_vd, PAGE_ROWS, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, PRECISION)
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out + q_rows[:, None] * s_ot + h * s_oh + dv[None, :] * s_od, o.to(out.dtype.element_ty),
             mask=i_ok[:, None] & (dv < DV)[None, :])


def _config(D: int, Dv: int, itemsize: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages): the fastest of six timed on an H200; no spills (varlen: <= 48 B)."""
    width = max(D, Dv)
    if itemsize == 4:                       # fp32 runs the exact (non-tensor-core) dot: registers bind
        return (32, 32, 4, 2) if width <= 64 else (32, 16, 4, 2) if width <= 128 else (16, 16, 4, 2)
    if width <= 128:                        # 16-bit, D <= 128: ~290 TFLOP/s at D = 128 (H 32, KVH 8)
        return 128, 128, 8, 2
    return 128, 64, 8, 2                    # 16-bit, D = 256: ~310 TFLOP/s (H 16, KVH 2, 4k causal)


def _launch(q, k_pages, v_pages, tables, cu_seqlens, starts, scale, streams, max_rows, rows, start):
    """Both forms share one kernel; the varlen one reads rows and starts from device tensors."""
    T, H, D = q.shape
    _, R, KVH, Dv = v_pages.shape
    if max(D, Dv) > 256:
        raise ValueError(f"head dims {D}/{Dv}: the Triton path takes at most 256")
    out = torch.empty((T, H, Dv), dtype=q.dtype, device=q.device)
    if T == 0 or streams == 0 or max_rows == 0:
        return out
    block_m, block_n, warps, stages = _config(D, Dv, q.element_size())
    _prefill_kernel[(triton.cdiv(max_rows, block_m), H, streams)](
        q, k_pages, v_pages, tables, cu_seqlens, starts, out, scale * LOG2E, rows, start,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), tables.stride(0), *out.stride(),
        GROUP=H // KVH, PAGE_ROWS=R, D=D, DV=Dv, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=max(16, triton.next_power_of_2(Dv)),
        VARLEN=cu_seqlens is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    return out


def paged_prefill(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, start: int,
                  scale: float) -> torch.Tensor:
    """One stream's chunk at positions start.. (inputs validated by the caller): [T, H, D] -> [T, H, Dv]."""
    return _launch(q, k_pages, v_pages, table[None, :], None, None, scale, 1, q.shape[0], q.shape[0], start)


def paged_prefill_varlen(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, tables: torch.Tensor,
                         cu_seqlens: torch.Tensor, starts: torch.Tensor, max_rows: int,
                         scale: float) -> torch.Tensor:
    """Several streams' chunks packed along rows (validated by the caller): [N, H, D] -> [N, H, Dv]."""
    return _launch(q, k_pages, v_pages, tables, cu_seqlens, starts, scale, starts.shape[0], max_rows, 0, 0)
