"""Paged attention in plain torch, the reference and the CPU path: gather a stream's keys through its page table,
then the families' dense causal GQA formula, so the CPU path stays bit-identical to the model code.

Shapes: B streams, T query rows, H query heads, KVH kv heads (H a multiple), D query/key dim, Dv value dim,
P pages of R rows, S keys visible.
"""

from __future__ import annotations

import torch


def gather(pages: torch.Tensor, table: torch.Tensor, end: int) -> torch.Tensor:
    """A stream's rows [0, end) read through its page table: [P, R, KVH, X] -> [end, KVH, X]."""
    rows = pages.shape[1]
    used = -(-end // rows)
    if used > table.numel():
        raise ValueError(f"table has {table.numel()} pages ({table.numel() * rows} rows); {end} rows are visible")
    ids = table[:used].long()
    if used and (int(ids.min()) < 0 or int(ids.max()) >= pages.shape[0]):
        raise ValueError(f"table names a page outside [0, {pages.shape[0]})")
    return pages[ids].reshape(used * rows, *pages.shape[2:])[:end]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Dense causal GQA, row i at absolute position start + i: q [T, H, D], keys [S, KVH, D], values [S, KVH, Dv]."""
    T, H = q.shape[0], q.shape[1]
    S = keys.shape[0]
    groups = H // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)                                    # [S, H, D]
    values = values.repeat_interleave(groups, dim=1)                                # [S, H, Dv]
    scores = torch.einsum("thd,shd->hts", q, keys) * scale                          # [H, T, S]
    key_positions = torch.arange(S, device=q.device)                                # [S]
    query_positions = torch.arange(start, start + T, device=q.device)               # [T]
    visible = key_positions[None, :] <= query_positions[:, None]                    # [T, S]: causal
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)                       # [H, T, S]
    return torch.einsum("hts,shd->thd", probs, values)                              # [T, H, Dv]


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per stream over its keys [0, lengths[b]), each stream alone: q [B, H, D] -> [B, H, Dv]."""
    B, H = q.shape[0], q.shape[1]
    out = torch.zeros((B, H, v_pages.shape[-1]), dtype=q.dtype, device=q.device)   # a length-0 stream reads zeros
    for b, end in enumerate(lengths.tolist()):
        if end > 0:
            keys = gather(k_pages, tables[b], end)                                  # [S, KVH, D]
            values = gather(v_pages, tables[b], end)                                # [S, KVH, Dv]
            out[b] = attend(q[b : b + 1], keys, values, end - 1, scale)[0]
    return out


def paged_prefill(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, start: int,
                  scale: float) -> torch.Tensor:
    """One stream's rows at positions start..start+T-1 over its keys [0, start+T): q [T, H, D] -> [T, H, Dv]."""
    end = start + q.shape[0]
    return attend(q, gather(k_pages, table, end), gather(v_pages, table, end), start, scale)


def paged_prefill_varlen(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, tables: torch.Tensor,
                         cu_seqlens: torch.Tensor, starts: torch.Tensor, scale: float) -> torch.Tensor:
    """Several streams' chunks packed along rows (stream s owns rows cu_seqlens[s]..cu_seqlens[s+1]): [N, H, D]."""
    out = torch.empty((q.shape[0], q.shape[1], v_pages.shape[-1]), dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    for s, start in enumerate(starts.tolist()):
        lo, hi = bounds[s], bounds[s + 1]
        if hi > lo:
            out[lo:hi] = paged_prefill(q[lo:hi], k_pages, v_pages, tables[s], start, scale)
    return out
