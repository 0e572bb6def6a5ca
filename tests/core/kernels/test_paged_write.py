"""Writing one row per stream into pages: the rows land at their flat ids, padded rows (id -1) write nothing."""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels.paged_write import row_ids, write_rows


def test_row_ids_follow_the_tables():
    tables = torch.tensor([[4, 1, 0], [2, 3, 0]], dtype=torch.int32)
    ids = row_ids(tables, torch.tensor([17, 3]), torch.tensor([True, False]), page_rows=16)
    assert ids.tolist() == [1 * 16 + 1, -1]


@pytest.mark.parametrize("path", ["naive", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_land_and_pads_write_nothing(path, dtype, device, monkeypatch):
    dev = device if path == "triton" else "cpu"
    if path == "triton" and dev == "cpu":
        from tensorfold.kernels import paged_write
        monkeypatch.setattr(paged_write, "use_triton", lambda t: True)
    pages = torch.randn(5, 4, 2, 3).to(dtype).to(dev)
    before = pages.clone()
    values = torch.randn(3, 2, 3).to(dtype).to(dev)
    write_rows(pages, values, torch.tensor([9, -1, 0]).to(dev))
    expected = before.clone().view(20, 2, 3)
    expected[9], expected[0] = values[0], values[2]
    assert torch.equal(pages.view(20, 2, 3).cpu(), expected.cpu())


def test_bad_arguments_are_named():
    pages = torch.zeros(5, 4, 2, 3)
    with pytest.raises(ValueError, match="values"):
        write_rows(pages, torch.zeros(3, 2, 4), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="dest must be int64"):
        write_rows(pages, torch.zeros(3, 2, 3), torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype|float"):
        write_rows(pages, torch.zeros(3, 2, 3, dtype=torch.float64), torch.tensor([0, 1, 2]))
