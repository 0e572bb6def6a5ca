"""The row write in Triton: one program per (row, block of columns); a negative row id stores nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.kernels import pdl

BLOCK = 1024


@triton.jit
def _write_kernel(flat, values, dest, width, stride_f, stride_v, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.ordered(PDL)
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(dest + i)
    ok = (cols < width) & (row >= 0)
    v = tl.load(values + i.to(tl.int64) * stride_v + cols, mask=ok)
    tl.store(flat + row * stride_f + cols, v, mask=ok)


def write_rows(flat: torch.Tensor, values: torch.Tensor, dest: torch.Tensor) -> None:
    """flat [P·R, X] (rows contiguous), values [N, X], dest [N] int64 (validated by the package)."""
    if values.stride(-1) != 1:
        values = values.contiguous()
    N, X = values.shape
    if N == 0 or X == 0:
        return
    _write_kernel[(N, triton.cdiv(X, BLOCK))](flat, values, dest, X, flat.stride(0), values.stride(0),
                                              BLOCK=BLOCK, num_warps=4, **pdl.options(flat))
