"""triton_align.align_grouped against triton_moe.align's grouped torch form, bit for bit: every field of the
Alignment (dtype, shape, values, weights compared as raw bits), over row counts, k, N and block sizes, with ties
inside a row, experts shared across rows, out-of-range ids, one expert for every pair, nothing in range, and
small chunk sizes that make many programs. Runs in triton's interpreter without CUDA (the reference always runs
its torch ops on the CPU)."""

from __future__ import annotations

import pytest
import torch
import triton

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpreter_fixes")]  # conftest: interpreter bugs

FIELDS = ("expert", "weight", "row_pair", "block_expert")
BITS = {2: torch.int16, 4: torch.int32}


def draw(T: int, k: int, N: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """chosen [T, k] long and weights [T, k]: half the ids from a few hot experts (ties in a row, repeats across
    rows), one in ten -1 or N + 3; weights distinct enough that a misplaced one changes the bits."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.randint(0, N, (max(1, N // 8),), generator=g)
    chosen = torch.randint(0, N, (T, k), generator=g)
    pick = torch.rand(T, k, generator=g) < 0.5
    chosen = torch.where(pick, hot[torch.randint(0, hot.numel(), (T, k), generator=g)], chosen)
    odd = torch.rand(T, k, generator=g)
    chosen = torch.where(odd < 0.05, -1, torch.where(odd < 0.1, N + 3, chosen))
    return chosen, torch.randn(T, k, generator=g).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's raw bits (an integer one as it is), so equal means bitwise equal."""
    return t.view(BITS[t.element_size()]) if t.dtype.is_floating_point else t


def assert_same(chosen: torch.Tensor, weights: torch.Tensor, N: int, block_m: int, device: str) -> None:
    from tensorfold.kernels.moe import triton_align, triton_moe
    want = triton_moe.align(chosen, weights, N, block_m, grouped_only=True)
    got = triton_align.align_grouped(chosen.to(device), weights.to(device), N, block_m)
    for name in FIELDS:
        a, b = getattr(want, name), getattr(got, name).cpu()
        assert (b.dtype, b.shape) == (a.dtype, a.shape), name
        assert torch.equal(bits(b), bits(a)), name


@pytest.mark.parametrize("block_m", [16, 128])
@pytest.mark.parametrize("N", [4, 64, 256])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("T", [1, 3, 64, 300])
def test_matches_the_torch_alignment(T, k, N, block_m, device):
    chosen, weights = draw(T, k, N, seed=1000 * T + 100 * k + N + block_m)
    assert_same(chosen, weights, N, block_m, device)


@pytest.mark.parametrize("T, k, N, block_m", [(37, 3, 5, 16), (20, 16, 64, 128), (9, 6, 4, 16), (50, 5, 512, 16)])
def test_odd_k_and_sizes(T, k, N, block_m, device):
    chosen, weights = draw(T, k, N, seed=T + k, dtype=torch.float32)
    assert_same(chosen, weights, N, block_m, device)


@pytest.mark.parametrize("block_m", [16, 128])
def test_every_pair_on_one_expert(block_m, device):
    """All 300 · 8 pairs in one group: its stable order is the pair order, its padding one partial block."""
    chosen = torch.full((300, 8), 3)
    weights = torch.randn(300, 8).to(torch.bfloat16)
    assert_same(chosen, weights, 64, block_m, device)
    assert_same(torch.tensor([5, 1, 3, 0]).repeat(300, 2), weights, 64, block_m, device)   # one set, twice a row


def test_nothing_in_range(device):
    """Every pair dropped: expert N everywhere, every block unused, every row empty."""
    from tensorfold.kernels.moe import triton_align
    chosen = torch.where(torch.rand(40, 4) < 0.5, -1, 67)
    weights = torch.randn(40, 4)
    assert_same(chosen, weights, 64, 16, device)
    plan = triton_align.align_grouped(chosen.to(device), weights.to(device), 64, 16)
    assert plan.expert.cpu().tolist() == [64] * 160
    assert plan.block_expert.cpu().tolist() == [64] * plan.block_expert.numel()
    assert plan.row_pair.cpu().tolist() == [160] * plan.row_pair.numel()


def test_no_rows(device):
    assert_same(torch.zeros((0, 8), dtype=torch.long), torch.zeros((0, 8)), 256, 128, device)


def test_strided_inputs(device):
    """chosen and weights as column slices of wider tensors: the kernels read them through their strides."""
    chosen, weights = draw(70, 8, 64, seed=3, dtype=torch.float32)
    assert_same(chosen[:, ::2], weights[:, 1::2], 64, 16, device)


@pytest.mark.parametrize("T, k, N, block_m", [(64, 9, 257, 16), (16, 9, 257, 16), (128, 8, 256, 16)])
def test_decode_step_shapes(T, k, N, block_m, device):
    """A decode step's routing at the 35B-A3B (k 8 of 256 and the shared expert as a ninth of 257): rows cut into
    chunks of a few, and at 64 rows more programs than chunks, the last only filling blocks."""
    from tensorfold.kernels.moe import triton_align
    from tensorfold.kernels.moe.alignment import blocks_bound
    chunks = triton.cdiv(T, triton_align.chunk_rows(T, k))
    assert chunks >= triton_align.MIN_CHUNKS // 2
    if T == 64:
        assert triton.cdiv(blocks_bound(T * k, N, block_m), triton_align.FILL_BLOCKS) > chunks
    chosen, weights = draw(T, k, N, seed=7 * T + k)
    assert_same(chosen, weights, N, block_m, device)


def test_chunk_rows():
    """A small T's rows make about MIN_CHUNKS chunks (a power of two rows each); a large T's chunks hold
    CHUNK_PAIRS pairs (k padded), as before."""
    from tensorfold.kernels.moe import triton_align
    assert [triton_align.chunk_rows(T, 9) for T in (1, 16, 17, 64, 128, 1024, 8192)] == [1, 1, 2, 4, 8, 64, 64]
    assert [triton_align.chunk_rows(T, 8) for T in (2048, 8192)] == [128, 128]


@pytest.mark.parametrize("T, k, N, block_m", [(64, 8, 64, 16), (45, 3, 4, 16), (31, 1, 256, 128)])
def test_many_small_chunks(T, k, N, block_m, device, monkeypatch):
    """Chunks of a few rows (many programs, the prefix over chunks in several steps) and steps of 8 pairs that
    end inside a chunk."""
    from tensorfold.kernels.moe import triton_align
    monkeypatch.setattr(triton_align, "CHUNK_PAIRS", 16)
    monkeypatch.setattr(triton_align, "SUB_PAIRS", 8)
    chosen, weights = draw(T, k, N, seed=T * k)
    assert_same(chosen, weights, N, block_m, device)


def test_launch_sizes_depend_on_shapes_only(device):
    """Two routings of one shape give the same shapes: every launch and buffer is sized by T, k, N, block_m."""
    from tensorfold.kernels.moe import triton_align, triton_moe
    a, wa = draw(100, 8, 256, seed=1)
    b = torch.zeros_like(a)
    plans = [triton_align.align_grouped(c.to(device), wa.to(device), 256, 128) for c in (a, b)]
    for name in FIELDS:
        assert getattr(plans[0], name).shape == getattr(plans[1], name).shape, name
    assert plans[0].block_expert.shape == (triton_moe.blocks_bound(800, 256, 128),)
