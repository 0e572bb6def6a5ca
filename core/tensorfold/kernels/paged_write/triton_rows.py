"""A decode step's row ids and key counts in one launch: the dozen small torch ops they take apart are a dozen
launches at the head of every step's graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl

BLOCK = 128


@triton.jit
def _rows_kernel(tables, positions, slots, dest, lengths, N, W, stride_t, PAGE_ROWS: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.ordered(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < N
    live = inside & (tl.load(slots + i, mask=inside, other=-1) >= 0)
    position = tl.load(positions + i, mask=live, other=0)
    column = tl.minimum(position // PAGE_ROWS, W - 1)
    page = tl.load(tables + i.to(tl.int64) * stride_t + column, mask=live, other=0).to(tl.int64)
    tl.store(dest + i, tl.where(live, page * PAGE_ROWS + position % PAGE_ROWS, -1), mask=inside)
    tl.store(lengths + i, tl.where(live, position + 1, 0).to(tl.int32), mask=inside)


def decode_rows(tables: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """tables [N, W] int32, positions [N] int64 (>= 0 where live), slots [N] int64 (validated by the package) ->
    dest [N] int64, lengths [N] int32."""
    N = positions.shape[0]
    dest = torch.empty(N, dtype=torch.int64, device=positions.device)
    lengths = torch.empty(N, dtype=torch.int32, device=positions.device)
    if N:
        _rows_kernel[(triton.cdiv(N, BLOCK),)](tables, positions, slots, dest, lengths, N, tables.shape[1],
                                               tables.stride(0), PAGE_ROWS=page_rows, BLOCK=BLOCK, num_warps=4,
                                               **pdl.options(positions))
    return dest, lengths
