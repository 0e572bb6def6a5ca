"""triton_align.align_grouped on the GPU at Qwen3.5-35B-A3B's prefill routing (k 8 of N 256, 128-row blocks) and its
decode steps' (k 9 of 257, 16-row blocks):
bitwise equal to triton_moe.align's torch form (run on the CPU, so the reference stays torch whatever align
dispatches to on CUDA), deterministic, and free of host syncs in eager mode. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels.moe import triton_align, triton_moe

CUDA = torch.cuda.is_available()
N, K, BLOCK_M = 256, 8, triton_moe.PREFILL_BLOCK_M
FIELDS = ("expert", "weight", "row_pair", "block_expert")

pytestmark = [pytest.mark.gpu, pytest.mark.triton, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


def routes(T: int, seed: int, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """chosen [T, k] long and bf16 weights [T, k] on the GPU, routed as the model routes (softmax, top-k,
    renormalised); `skew` sends most rows to the same few experts."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, N, device="cuda", generator=g)
    if skew:
        logits[:, :12] += 6.0
    weights, chosen = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return chosen, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)


def assert_same(chosen: torch.Tensor, weights: torch.Tensor, experts: int = N,
                block_m: int = BLOCK_M) -> triton_moe.Alignment:
    want = triton_moe.align(chosen.cpu(), weights.cpu(), experts, block_m, grouped_only=True)
    got = triton_align.align_grouped(chosen, weights, experts, block_m)
    for name in FIELDS:
        a, b = getattr(want, name), getattr(got, name).cpu()
        assert (b.dtype, b.shape) == (a.dtype, a.shape), name
        if a.dtype.is_floating_point:
            a, b = a.view(torch.int16), b.view(torch.int16)
        assert torch.equal(b, a), name
    return got


@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
@pytest.mark.parametrize("T", [2048, 8192])
def test_gpu_matches_the_torch_alignment(T, skew):
    chosen, weights = routes(T, seed=T, skew=skew)
    chosen[::97, 3] = -1                                            # dropped pairs, as align drops them
    chosen[5::89, 6] = N + 3
    first = assert_same(chosen, weights)
    again = triton_align.align_grouped(chosen, weights, N, BLOCK_M)
    for name in FIELDS:
        assert torch.equal(getattr(again, name), getattr(first, name)), name


@pytest.mark.parametrize("T", [2048, 8192])
def test_gpu_eager_call_never_syncs(T):
    chosen, weights = routes(T, seed=T + 1)
    triton_align.align_grouped(chosen, weights, N, BLOCK_M)          # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_align.align_grouped(chosen, weights, N, BLOCK_M)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("T", [16, 64, 128])
def test_gpu_decode_step_alignment(T):
    """A decode step's routing at the 35B-A3B (k 8 of 256, the shared expert a ninth pair of 257, 16-row blocks):
    the few-row chunks and the programs that only fill blocks, against the torch form."""
    experts, k, block_m = 257, 9, triton_moe.BLOCK_M
    g = torch.Generator(device="cuda").manual_seed(T)
    routed = torch.randn(T, experts - 1, device="cuda", generator=g).topk(k - 1, dim=-1).indices
    chosen = torch.cat([routed, torch.full((T, 1), experts - 1, device="cuda")], dim=1)
    weights = torch.rand(T, k, device="cuda", generator=g).to(torch.bfloat16)
    assert_same(chosen, weights, experts, block_m)
