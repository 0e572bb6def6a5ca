"""The routed experts on the GPU at Qwen3.5-35B-A3B's expert shapes (E 2048, F 512, N 256, k 8): Triton vs naive
on the device, a row alone vs inside the batch, no sync in eager mode, and a CUDA graph capture replayed on new
inputs. Skipped without CUDA. Tests print `MOE {json}` lines: run with -s.

Tolerances (relative to the output's largest magnitude, both paths on the GPU): float32 2e-5 (IEEE dots, another
summation order over 2048 / 512 terms); bfloat16 2^-6 (bf16 intermediates one ulp apart, k = 8 of them summed).
"""

from __future__ import annotations

import json

import pytest
import torch

from tensorfold.kernels.moe import naive, routed_experts

CUDA = torch.cuda.is_available()
E, FF, N, K = 2048, 512, 256, 8
LIMIT = {torch.float32: 2e-5, torch.bfloat16: 2**-6}

pytestmark = [pytest.mark.gpu, pytest.mark.triton, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


def experts(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [N, 2F, E], down [N, E, F] on the GPU, N(0, 1/fan_in)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (torch.randn(N, 2 * FF, E, device="cuda", generator=g) * E**-0.5).to(dtype)
    down = (torch.randn(N, E, FF, device="cuda", generator=g) * FF**-0.5).to(dtype)
    return gate_up, down


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
def test_gpu_triton_against_naive(weights, T):
    dtype, gate_up, down = weights
    x, chosen, w = rows(T, dtype, seed=T)
    got = routed_experts(x, chosen, w, gate_up, down)
    ref = naive.routed_experts(x, chosen, w, gate_up, down)
    scale = float(ref.float().abs().max())
    diff = float((got.float() - ref.float()).abs().max())
    print("MOE " + json.dumps(dict(test="against_naive", dtype=str(dtype), T=T, max_abs=diff, scale=scale,
                                   relative=diff / scale)))
    assert got.dtype == dtype and got.shape == (T, E)
    assert diff <= LIMIT[dtype] * scale


def test_gpu_batch_invariant_and_deterministic(weights):
    dtype, gate_up, down = weights
    x, chosen, w = rows(64, dtype, seed=5)
    whole = routed_experts(x, chosen, w, gate_up, down)
    assert torch.equal(whole, routed_experts(x, chosen, w, gate_up, down))
    for t in (0, 31, 63):
        alone = routed_experts(x[t:t + 1], chosen[t:t + 1], w[t:t + 1], gate_up, down)
        assert torch.equal(alone[0], whole[t]), t
    assert torch.equal(routed_experts(x[3:11], chosen[3:11], w[3:11], gate_up, down), whole[3:11])


@pytest.mark.parametrize("tiles", [{"PAIR_BLOCK_F": 16}, {"PAIR_BLOCK_E": 128, "PAIR_STEP_F": 128},
                                   {"PAIR_STEP_E": 256, "PAIR_WARPS": 8}, {"PAIR_BLOCK_E": 64, "PAIR_STAGES": 4}],
                         ids=["f16", "e128-kf128", "ke256-w8", "e64-s4"])
def test_gpu_lone_pairs_under_other_tiles_keep_the_grouped_bits(weights, tiles, monkeypatch):
    """bf16 decode calls of lone pairs (1 and 8 rows: 8 and 64 pairs) take the PAIR_* tiles; set apart
    from the grouped decode tiles (K steps, warps and stages too) a row's bits must stay those of the same row
    inside 64 rows (512 pairs, grouped): what lets bench/decode_sweep.py tune the lone pairs' tiles freely."""
    from tensorfold.kernels.moe import triton_moe
    dtype, gate_up, down = weights
    if dtype == torch.float32:
        pytest.skip("float32 keeps the decode tiles")
    x, chosen, w = rows(64, dtype, seed=7)
    whole = routed_experts(x, chosen, w, gate_up, down)
    for name, value in tiles.items():
        monkeypatch.setattr(triton_moe, name, value)
    for t in (0, 45):
        alone = routed_experts(x[t:t + 1], chosen[t:t + 1], w[t:t + 1], gate_up, down)
        assert torch.equal(alone[0], whole[t]), t
    assert torch.equal(routed_experts(x[8:16], chosen[8:16], w[8:16], gate_up, down), whole[8:16])


def test_gpu_eager_call_never_syncs(weights):
    dtype, gate_up, down = weights
    x, chosen, w = rows(8, dtype, seed=6)
    routed_experts(x, chosen, w, gate_up, down)                       # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routed_experts(x, chosen, w, gate_up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("T", [1, 64])
def test_gpu_cuda_graph_replays_new_inputs(weights, T):
    """Captured once on static buffers; new rows and routes copied in and replayed equal an eager call."""
    dtype, gate_up, down = weights
    static = [t.clone() for t in rows(T, dtype, seed=10)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            routed_experts(*static, gate_up, down)                     # compile and warm the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(*static, gate_up, down)
    for seed in (11, 12):
        fresh = rows(T, dtype, seed=seed)
        for buffer, value in zip(static, fresh, strict=True):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, routed_experts(*fresh, gate_up, down)), seed
