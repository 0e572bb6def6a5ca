"""Writing one row per stream into a paged row state (the decode step's keys and values), with padded rows skipped.

    write_rows(pages, values, dest):   pages [P, R, *X], values [N, *X], dest [N] int64 flat row ids
        pages.view(P·R, *X)[dest[i]] = values[i] for every dest[i] >= 0; a negative dest is a padded row of a
        captured batch and writes nothing
    decode_rows(tables, positions, slots, page_rows) -> (dest, lengths):   a decode batch's row ids and the keys
        each row sees, in one launch at the head of the step

One kernel and no host sync, so a CUDA graph can capture it; a plain index write (the naive path) elsewhere.
The caller promises distinct non-negative ids below P·R: a device check would sync.
"""

from __future__ import annotations

import torch

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.strides import row_major

__all__ = ["decode_rows", "row_ids", "write_rows"]

ONE_LAUNCH = True   # decode_rows in one Triton launch on a Triton device; False: the torch ops (an A/B on the device)


def row_ids(tables: torch.Tensor, positions: torch.Tensor, live: torch.Tensor, page_rows: int) -> torch.Tensor:
    """Flat row ids of each stream's row at `positions` through its page table; -1 where `live` is False.

    tables [N, W] int, positions [N] int64, live [N] bool -> [N] int64 (page · page_rows + offset)."""
    page = tables.gather(1, (positions // page_rows)[:, None].clamp(max=tables.shape[1] - 1))[:, 0].long()
    return torch.where(live, page * page_rows + positions % page_rows, -1)


def decode_rows(tables: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode batch's flat row ids (row_ids, live where slots >= 0) and the keys each row sees (position + 1,
    0 for a padded row): one launch on a Triton device, the same integers as the torch ops.

    tables [N, W] int32, positions [N] int64, slots [N] int64 -> dest [N] int64, lengths [N] int32."""
    N = positions.shape[0]
    if tables.dim() != 2 or tables.shape[0] != N or tables.dtype != torch.int32:
        raise ValueError(f"tables must be int32 [{N}, W]; got {tables.dtype} {tuple(tables.shape)}")
    for name, t in (("positions", positions), ("slots", slots)):
        if t.shape != (N,) or t.dtype != torch.int64 or t.device != tables.device:
            raise ValueError(f"{name} must be int64 [{N}] on {tables.device}; got {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}")
    if ONE_LAUNCH and use_triton(positions):
        from tensorfold.kernels.paged_write import triton_rows
        return triton_rows.decode_rows(row_major(tables), positions, slots, page_rows)
    live = slots >= 0
    return row_ids(tables, positions, live, page_rows), torch.where(live, positions + 1, 0).to(torch.int32)


def write_rows(pages: torch.Tensor, values: torch.Tensor, dest: torch.Tensor) -> None:
    """Store values[i] at flat row dest[i] of pages (skipping negative ids), in place."""
    if pages.dim() < 2 or values.dim() != pages.dim() - 1 or values.shape[1:] != pages.shape[2:]:
        raise ValueError(f"values {tuple(values.shape)} must be [N, *{tuple(pages.shape[2:])}] for pages "
                         f"{tuple(pages.shape)}")
    if values.dtype != pages.dtype or values.device != pages.device:
        raise ValueError(f"values are {values.dtype} on {values.device}; the pages {pages.dtype} on {pages.device}")
    if dest.shape != (values.shape[0],) or dest.dtype != torch.int64 or dest.device != pages.device:
        raise ValueError(f"dest must be int64 [{values.shape[0]}] on {pages.device}; got {dest.dtype} "
                         f"{tuple(dest.shape)} on {dest.device}")
    if not pages.is_contiguous():
        raise ValueError("pages must be contiguous")
    flat = pages.view(pages.shape[0] * pages.shape[1], -1)
    if use_triton(values):
        from tensorfold.kernels.paged_write import triton_write
        triton_write.write_rows(flat, values.reshape(values.shape[0], -1), dest)
        return
    live = dest >= 0
    flat[dest[live]] = values.reshape(values.shape[0], -1)[live]
