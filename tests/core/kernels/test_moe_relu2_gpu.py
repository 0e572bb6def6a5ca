"""The relu2 routed experts on the GPU at Nemotron-H 30B-A3B's expert shapes (E 2688, F 1856, N 128, k 6): Triton vs
naive on the device, a row alone vs inside the batch, no sync in eager mode, a CUDA graph capture replayed on new
inputs. Skipped without CUDA. Tests print `MOE {json}` lines: run with -s.

Tolerances (relative to the output's largest magnitude, both paths on the GPU): those of test_moe_gpu.py, float32
2e-5 and bfloat16 2^-6.
"""

from __future__ import annotations

import json

import pytest
import torch

from tensorfold.kernels.moe import naive, routed_experts

CUDA = torch.cuda.is_available()
E, FF, N, K = 2688, 1856, 128, 6
LIMIT = {torch.float32: 2e-5, torch.bfloat16: 2**-6}
RELU2 = dict(activation="relu2")

pytestmark = [pytest.mark.gpu, pytest.mark.triton, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


def experts(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """up [N, F, E], down [N, E, F] on the GPU, N(0, 1/fan_in)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    up = (torch.randn(N, FF, E, device="cuda", generator=g) * E**-0.5).to(dtype)
    down = (torch.randn(N, E, FF, device="cuda", generator=g) * FF**-0.5).to(dtype)
    return up, down


def rows(T: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, E], chosen [T, k], weights [T, k], routed as the model routes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, E, device="cuda", generator=g).to(dtype)
    probs = torch.softmax(torch.randn(T, N, device="cuda", generator=g), dim=-1)
    weights, chosen = probs.topk(K, dim=-1)
    return x, chosen, (weights / weights.sum(-1, keepdim=True)).to(dtype)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def weights(request):
    return request.param, *experts(request.param)


@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_relu2_triton_against_naive(weights, T):
    dtype, up, down = weights
    x, chosen, w = rows(T, dtype, seed=T)
    got = routed_experts(x, chosen, w, up, down, **RELU2)
    ref = naive.routed_experts(x, chosen, w, up, down, **RELU2)
    scale = float(ref.float().abs().max())
    diff = float((got.float() - ref.float()).abs().max())
    print("MOE " + json.dumps(dict(test="relu2_against_naive", dtype=str(dtype), T=T, max_abs=diff, scale=scale,
                                   relative=diff / scale)))
    assert got.dtype == dtype and got.shape == (T, E)
    assert diff <= LIMIT[dtype] * scale


def test_gpu_relu2_batch_invariant_and_never_syncs(weights):
    dtype, up, down = weights
    x, chosen, w = rows(64, dtype, seed=5)
    whole = routed_experts(x, chosen, w, up, down, **RELU2)
    assert torch.equal(whole, routed_experts(x, chosen, w, up, down, **RELU2))
    for t in (0, 31, 63):
        alone = routed_experts(x[t:t + 1], chosen[t:t + 1], w[t:t + 1], up, down, **RELU2)
        assert torch.equal(alone[0], whole[t]), t
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routed_experts(x[:8], chosen[:8], w[:8], up, down, **RELU2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("T", [1, 64])
def test_gpu_relu2_cuda_graph_replays_new_inputs(weights, T):
    """Captured once on static buffers; new rows and routes copied in and replayed equal an eager call."""
    dtype, up, down = weights
    static = [t.clone() for t in rows(T, dtype, seed=10)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            routed_experts(*static, up, down, **RELU2)                 # compile and warm the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(*static, up, down, **RELU2)
    for seed in (11, 12):
        fresh = rows(T, dtype, seed=seed)
        for buffer, value in zip(static, fresh, strict=True):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, routed_experts(*fresh, up, down, **RELU2)), seed
