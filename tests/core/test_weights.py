"""tensorfold.weights.stacked: one new matrix, each part a row view of it holding the part's values."""

from __future__ import annotations

import torch

from tensorfold.weights import stacked


def test_the_parts_become_row_views_of_one_matrix():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(rows, 8, generator=g) for rows in (3, 1, 5)]
    whole, views = stacked(parts)
    assert whole.shape == (9, 8) and torch.equal(whole, torch.cat(parts))
    for part, view in zip(parts, views, strict=True):
        assert torch.equal(view, part) and view.is_contiguous()
        assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    x = torch.randn(4, 8, generator=g)
    assert torch.equal(x @ views[2].T, x @ parts[2].T)
