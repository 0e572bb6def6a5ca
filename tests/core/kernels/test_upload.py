"""Host ints onto the device without a wait (kernels/upload.py), and the varlen keywords fla gets for a step's
stream bounds (kernels/fla_varlen.uploaded_bounds): the same tensor objects for the same bounds, so fla's
identity-keyed cache derives its chunk indices once per step, and the chunk indices fla would derive."""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels import fla_varlen
from tensorfold.kernels.upload import ints

CUDA = torch.cuda.is_available()


def expected_chunks(bounds: list[int], grid: int) -> list[list[int]]:
    """(stream, chunk) for every `grid`-row chunk counted from each stream's first row; an empty stream has none."""
    pairs = []
    for n in range(len(bounds) - 1):
        rows = bounds[n + 1] - bounds[n]
        pairs += [[n, i] for i in range((rows + grid - 1) // grid)]
    return pairs


def test_ints_on_the_cpu():
    out = ints([3, 0, 7], torch.int32, "cpu")
    assert out.dtype == torch.int32 and out.tolist() == [3, 0, 7] and out.device.type == "cpu"
    assert ints([], torch.long, torch.device("cpu")).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_ints_on_the_gpu_arrive_in_stream_order():
    """Enqueued behind work already on the stream: a kernel queued after the copy reads the values."""
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 64                                      # work ahead of the copy on the stream
    values = list(range(100_000))
    out = ints(values, torch.long, "cuda")
    assert out.device.type == "cuda" and int(out.sum()) == sum(values) and out.tolist()[:3] == [0, 1, 2]


def test_uploaded_bounds_are_the_same_objects_for_the_same_bounds():
    fla_varlen._uploaded.clear()
    first = fla_varlen.uploaded_bounds([0, 300, 301, 301, 1000], torch.device("cpu"), 64)
    again = fla_varlen.uploaded_bounds([0, 300, 301, 301, 1000], torch.device("cpu"), 64)
    assert all(first[key] is again[key] for key in first) and set(first) == {"cu_seqlens", "cu_seqlens_cpu",
                                                                           "chunk_indices"}
    assert first["cu_seqlens"].tolist() == first["cu_seqlens_cpu"].tolist() == [0, 300, 301, 301, 1000]
    assert first["cu_seqlens"].dtype == first["chunk_indices"].dtype == torch.long
    without = fla_varlen.uploaded_bounds([0, 300, 301, 301, 1000], torch.device("cpu"), 0)
    assert set(without) == {"cu_seqlens", "cu_seqlens_cpu"} and without["cu_seqlens"] is not first["cu_seqlens"]


@pytest.mark.parametrize("bounds", [[0, 1], [0, 64], [0, 65], [0, 2048], [0, 300, 301, 301, 1000], [0, 0, 130]])
def test_chunk_indices_are_each_streams_chunks(bounds):
    fla_varlen._uploaded.clear()
    got = fla_varlen.uploaded_bounds(bounds, torch.device("cpu"), 64)["chunk_indices"]
    assert got.shape == (len(expected_chunks(bounds, 64)), 2) and got.tolist() == expected_chunks(bounds, 64)


def test_uploaded_bounds_keep_only_the_latest():
    fla_varlen._uploaded.clear()
    first = fla_varlen.uploaded_bounds([0, 10], torch.device("cpu"), 64)
    for n in range(fla_varlen._KEPT_BOUNDS):
        fla_varlen.uploaded_bounds([0, 11 + n], torch.device("cpu"), 64)
    assert len(fla_varlen._uploaded) == fla_varlen._KEPT_BOUNDS
    assert fla_varlen.uploaded_bounds([0, 10], torch.device("cpu"), 64)["cu_seqlens"] is not first["cu_seqlens"]
