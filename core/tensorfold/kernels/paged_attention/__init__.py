"""Causal GQA attention that reads keys and values through page tables (the PagedStore layout), for decode and
prefill. Triton on CUDA, plain torch (`naive`) elsewhere; both take the same arguments.

Shapes: B streams, T query rows, H query heads, KVH kv heads (H a multiple of KVH: query head h reads kv head
h // (H / KVH)), D query/key dim, Dv value dim, P pages of R rows. One layer's pages, as `KvStore.row_pages` gives
them: k_pages [P, R, KVH, D], v_pages [P, R, KVH, Dv]; a stream's row r lives in page table[r // R], offset
r % R. Keys are stored as the model attends to them (after norm and RoPE); `scale` defaults to D ** -0.5.
Softmax runs in float32; the output has q's dtype. Rows past a stream's visible keys (unused rows, padded table
entries, NaN-poisoned pages) are never read.

Values the checks cannot see without a device sync are the caller's promise: table entries in [0, P), lengths
and start + T within each table's pages.
"""

from __future__ import annotations

import torch

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.paged_attention import naive
from tensorfold.kernels.silu_gate import sigmoid_mul
from tensorfold.kernels.strides import row_major

__all__ = ["paged_decode", "paged_prefill", "paged_prefill_varlen"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_heads(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
    """q [*, H, D] against the pages [P, R, KVH, D] / [P, R, KVH, Dv]."""
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [rows, heads, head_dim]; got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of float16, bfloat16, float32")
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if pages.dim() != 4:
            raise ValueError(f"{name} must be 4-D [pages, page_rows, kv_heads, dim]; got {tuple(pages.shape)}")
        if pages.dtype != q.dtype:
            raise ValueError(f"{name} dtype {pages.dtype} differs from q's {q.dtype}")
        if pages.device != q.device:
            raise ValueError(f"{name} is on {pages.device}, q on {q.device}")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} differ in pages, "
                         f"page_rows or kv_heads")
    if k_pages.shape[3] != q.shape[2]:
        raise ValueError(f"k_pages head dim {k_pages.shape[3]} differs from q's {q.shape[2]}")
    if k_pages.shape[2] == 0 or q.shape[1] % k_pages.shape[2]:
        raise ValueError(f"q heads {q.shape[1]} are not a multiple of k_pages kv heads {k_pages.shape[2]}")


def _check_index(name: str, t: torch.Tensor, dims: int, q: torch.Tensor, leading: int | None = None) -> None:
    """An int32 index tensor on q's device, of `dims` dims, whose first dim is `leading` when given."""
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32; got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D; got shape {tuple(t.shape)}")
    if leading is not None and t.shape[0] != leading:
        raise ValueError(f"{name} has {t.shape[0]} entries along dim 0; expected {leading}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor, scale: float | None = None, gate: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """One query token per stream over its keys [0, lengths[b]): q [B, H, D] -> [B, H, Dv].

    tables [B, max_pages] int32 (each stream's pages in row order, padded with any valid id); lengths [B] int32,
    the keys visible to the query (its position + 1; 0 gives zeros). Batch-invariant: a stream's result is the
    same bits alone or in any batch (the Triton path splits a stream's keys every SPLIT_KEYS = 512 keys of its
    own length, and merges the splits in order).

    gate [B, H, Dv] (q's dtype and device, any strides: e.g. gate halves read in place from a fused projection):
    the output gated, out · sigmoid(gate), the bits of silu_gate.sigmoid_mul on the ungated output; the Triton path
    gates in its combine launch (one launch fewer).
    """
    _check_heads(q, k_pages, v_pages)
    _check_index("tables", tables, 2, q, q.shape[0])
    _check_index("lengths", lengths, 1, q, q.shape[0])
    B, H, Dv = q.shape[0], q.shape[1], v_pages.shape[-1]
    if gate is not None and (tuple(gate.shape) != (B, H, Dv) or gate.dtype != q.dtype or gate.device != q.device):
        raise ValueError(f"gate must be [{B}, {H}, {Dv}] {q.dtype} on {q.device} (q's rows and heads, the value "
                         f"dim); got {list(gate.shape)} {gate.dtype} on {gate.device}")
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if use_triton(q):
        from tensorfold.kernels.paged_attention import triton_decode
        gate = None if gate is None else row_major(gate)
        return triton_decode.paged_decode(q, k_pages, v_pages, tables, lengths, scale, gate=gate)
    out = naive.paged_decode(q, k_pages, v_pages, tables, lengths, scale)
    return out if gate is None else sigmoid_mul(out.reshape(B, H * Dv), gate).view(B, H, Dv)


def paged_prefill(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, start: int,
                  scale: float | None = None) -> torch.Tensor:
    """One stream's chunk, rows at positions start..start+T-1, over keys [0, start+T): q [T, H, D] -> [T, H, Dv].

    table [n_pages] int32, the stream's pages in row order; the chunk's own keys must already be written. Causal:
    row i sees keys <= start + i.
    """
    _check_heads(q, k_pages, v_pages)
    _check_index("table", table, 1, q)
    if int(start) != start or start < 0:
        raise ValueError(f"start must be a non-negative int; got {start!r}")
    start = int(start)
    if start + q.shape[0] > table.shape[0] * k_pages.shape[1]:
        raise ValueError(f"table holds {table.shape[0]} pages of {k_pages.shape[1]} rows; start + T is "
                         f"{start + q.shape[0]}")
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if use_triton(q):
        from tensorfold.kernels.paged_attention import triton_prefill
        return triton_prefill.paged_prefill(q, k_pages, v_pages, table, start, scale)
    return naive.paged_prefill(q, k_pages, v_pages, table, start, scale)


def paged_prefill_varlen(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, tables: torch.Tensor,
                         cu_seqlens: torch.Tensor, starts: torch.Tensor, max_rows: int | None = None,
                         scale: float | None = None) -> torch.Tensor:
    """Several streams' chunks packed along rows: q [N, H, D] -> [N, H, Dv]; each stream as in `paged_prefill`.

    tables [S, max_pages] int32; cu_seqlens [S+1] int32 (stream s owns rows cu_seqlens[s]..cu_seqlens[s+1],
    cu_seqlens[S] = N); starts [S] int32 (absolute position of each stream's first row); max_rows >= the most
    rows of one stream (None reads it off cu_seqlens, a device sync).
    """
    _check_heads(q, k_pages, v_pages)
    _check_index("tables", tables, 2, q)
    _check_index("starts", starts, 1, q, tables.shape[0])
    _check_index("cu_seqlens", cu_seqlens, 1, q, tables.shape[0] + 1)
    if max_rows is None:
        max_rows = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if tables.shape[0] else 0
    if int(max_rows) != max_rows or max_rows < 0:
        raise ValueError(f"max_rows must be a non-negative int; got {max_rows!r}")
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if use_triton(q):
        from tensorfold.kernels.paged_attention import triton_prefill
        return triton_prefill.paged_prefill_varlen(q, k_pages, v_pages, tables, cu_seqlens, starts, int(max_rows),
                                                   scale)
    return naive.paged_prefill_varlen(q, k_pages, v_pages, tables, cu_seqlens, starts, scale)
