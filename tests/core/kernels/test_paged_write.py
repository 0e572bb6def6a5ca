"""Writing one row per stream into pages: the rows land at their flat ids, padded rows (id -1) write nothing."""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels import paged_write
from tensorfold.kernels.paged_write import decode_rows, row_ids, write_rows


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


def batch_rows(N: int, W: int, R: int, device: str, seed: int):
    """A decode batch's tables, positions and slots: every third row a pad (slot -1, any position), some live rows
    past their table's last column (its last page is read, as row_ids clamps)."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.randint(0, 1 << 20, (N, W), generator=g, dtype=torch.int32)
    positions = torch.randint(0, W * R + 3 * R, (N,), generator=g)
    slots = torch.where(torch.arange(N) % 3 == 1, -1, torch.randint(0, 64, (N,), generator=g))
    return tables.to(device), positions.to(device), slots.to(device)


@pytest.mark.parametrize("path", ["naive", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("N,W,R", [(1, 1, 16), (5, 3, 16), (300, 9, 64)], ids=["one", "five", "three-programs"])
def test_decode_rows_are_row_ids_and_the_keys_seen(path, N, W, R, device, monkeypatch):
    dev = device if path == "triton" else "cpu"
    if path == "triton" and dev == "cpu":
        monkeypatch.setattr(paged_write, "use_triton", lambda t: True)
    tables, positions, slots = batch_rows(N, W, R, dev, seed=N)
    dest, lengths = decode_rows(tables, positions, slots, R)
    live = slots >= 0
    assert dest.dtype == torch.int64 and lengths.dtype == torch.int32
    assert torch.equal(dest.cpu(), row_ids(tables, positions, live, R).cpu())
    assert torch.equal(lengths.cpu(), torch.where(live, positions + 1, 0).to(torch.int32).cpu())
    if N > 1:
        assert (dest[~live] == -1).all() and (lengths[~live] == 0).all()


@pytest.mark.triton
def test_decode_rows_are_one_launch(monkeypatch):
    from tensorfold.kernels.paged_write import triton_rows
    from tensorfold.testing.launches import counting_triton
    tables, positions, slots = batch_rows(6, 2, 16, "cpu", seed=3)
    with counting_triton(monkeypatch, {triton_rows: ("_rows_kernel",)}, (paged_write,)) as mode:
        decode_rows(tables, positions, slots, 16)
    assert mode.ops == {"triton:_rows_kernel": 1}
    monkeypatch.setattr(paged_write, "ONE_LAUNCH", False)
    with counting_triton(monkeypatch, {triton_rows: ("_rows_kernel",)}, (paged_write,)) as mode:
        decode_rows(tables, positions, slots, 16)
    assert "triton:_rows_kernel" not in mode.ops and sum(mode.ops.values()) > 1


def test_decode_rows_bad_arguments_are_named():
    tables, positions, slots = batch_rows(4, 2, 16, "cpu", seed=1)
    with pytest.raises(ValueError, match="tables must be int32"):
        decode_rows(tables.long(), positions, slots, 16)
    with pytest.raises(ValueError, match="positions must be int64"):
        decode_rows(tables, positions.int(), slots, 16)
    with pytest.raises(ValueError, match=r"slots must be int64 \[4\]"):
        decode_rows(tables, positions, slots[:3], 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_rows_in_a_graph_are_the_torch_ops():
    """The one launch, eager and replayed from a CUDA graph, against the torch ops on the same device."""
    tables, positions, slots = batch_rows(200, 40, 16, "cuda", seed=5)
    dest, lengths = decode_rows(tables, positions, slots, 16)
    live = slots >= 0
    assert torch.equal(dest, row_ids(tables, positions, live, 16))
    assert torch.equal(lengths, torch.where(live, positions + 1, 0).to(torch.int32))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_rows(tables, positions, slots, 16)
    positions.add_(7)
    graph.replay()
    assert torch.equal(captured[0], row_ids(tables, positions, live, 16))
    assert torch.equal(captured[1], torch.where(live, positions + 1, 0).to(torch.int32))
