"""Weight layouts a family builds at load: matrices stacked so one GEMM does the work of several."""

from __future__ import annotations

import torch


def stacked(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The parts [Ri, E] stacked along rows into one new matrix, and each part as a view of it: once the caller
    drops the originals nothing is held twice, and a product with a part reads the same values."""
    whole = torch.cat(parts)
    views, row = [], 0
    for part in parts:
        views.append(whole[row: row + part.shape[0]])
        row += part.shape[0]
    return whole, views
