"""kernels.moe.router_top_k: the router's projection and softmax top-k as two launches of ours (triton_router).
Its pairs are the routing kernel's, bit for bit, on the logits summed from linear_norm's partial sums (and the
twin's ids, its weights within the routing kernel's bound); a row's pairs are the same alone and among 16; past 16
rows, off a Triton device or switched off, the GEMM then softmax_top_k; bad arguments named. On the GPU: the same
at Qwen3.5-35B-A3B's router, with CUDA-graph replays."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_moe_routing import assert_weights_close

from tensorfold.kernels.moe import router_top_k, routing, softmax_top_k
from tensorfold.testing.cuda_graphs import captured, without_host_sync

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs

CUDA = torch.cuda.is_available()
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
RTOL = {torch.float32: 2**-19, torch.bfloat16: 2**-7}     # the routing kernel's bound against its twin


def inputs(M: int, E: int, rows: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, E, generator=g).to(dtype)
    weight = (torch.randn(rows, E, generator=g) * 2 * E ** -0.5).to(dtype)
    return x.to(device), weight.to(device)


def split_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The logits the kernel routes: linear_norm's float32 partial sums at the router's splits, added in split
    order, rounded once to x's dtype."""
    from tensorfold.kernels.linear_norm import triton_linear_norm
    parts = triton_linear_norm.parts(x, weight, routing.ROUTER_SPLITS)
    total = parts[0].clone()
    for s in range(1, parts.shape[0]):
        total = total + parts[s]
    return total.to(x.dtype)


def check_against_the_twin(x: torch.Tensor, weight: torch.Tensor, k: int, shared: bool, rtol: float) -> None:
    from tensorfold.kernels.moe import triton_router, triton_routing
    weights, chosen = triton_router.router_top_k(x, weight, k, shared)
    N = weight.shape[0] - shared
    logits = split_logits(x, weight)
    gate = logits[:, N:] if shared else None
    kernel_weights, kernel_chosen = triton_routing.softmax_top_k(logits[:, :N], k, gate)
    assert torch.equal(chosen, kernel_chosen) and torch.equal(weights, kernel_weights)
    want_weights, want_chosen = routing.naive(logits[:, :N], k, gate)
    assert torch.equal(chosen, want_chosen)
    assert_weights_close(weights, want_weights, rtol)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, E, N, k, shared", [(1, 300, 20, 4, True), (5, 512, 64, 8, True), (16, 96, 10, 2, False),
                                                (3, 2100, 33, 3, True)])
def test_the_pairs_are_the_twins_on_the_summed_logits(M, E, N, k, shared, dtype, device):
    x, weight = inputs(M, E, N + shared, dtype, seed=M + E + N, device=device)
    check_against_the_twin(x, weight, k, shared, RTOL[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_pairs_are_the_same_alone_and_among_sixteen(dtype, device):
    from tensorfold.kernels.moe import triton_router
    x, weight = inputs(16, 256, 41, dtype, seed=7, device=device)
    weights, chosen = triton_router.router_top_k(x, weight, 6, True)
    for t in (0, 9, 15):
        one_weights, one_chosen = triton_router.router_top_k(x[t:t + 1], weight, 6, True)
        assert torch.equal(one_chosen[0], chosen[t]) and torch.equal(one_weights[0], weights[t])


@pytest.mark.triton
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "max-then-min"])
def test_either_top_k_form_gives_the_twins_pairs(packed, device, monkeypatch):
    """bfloat16: the route launch's top-k on packed keys or as a max and a min a round (triton_routing)."""
    from tensorfold.kernels.moe import triton_routing
    monkeypatch.setattr(triton_routing, "PACKED_KEYS", packed)
    x, weight = inputs(5, 512, 65, torch.bfloat16, seed=11, device=device)
    check_against_the_twin(x, weight, 8, True, RTOL[torch.bfloat16])


@pytest.mark.triton
def test_the_logits_are_the_projection_within_the_dtypes_tolerance(device):
    x, weight = inputs(4, 700, 50, torch.float32, seed=3, device=device)
    got = split_logits(x, weight).double()
    want = F.linear(x.double(), weight.double())
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_off_a_triton_device_it_is_the_gemm_then_softmax_top_k():
    x, weight = inputs(3, 64, 17, torch.float32, seed=4)
    assert not routing.router_applies(x)
    logits = F.linear(x, weight)
    for shared in (True, False):
        N = 17 - shared
        got = router_top_k(x, weight, 4, shared=shared)
        want = softmax_top_k(logits[:, :N], 4, logits[:, N:] if shared else None)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_bad_arguments_are_named():
    x, weight = inputs(2, 16, 9, torch.float32, seed=5)
    with pytest.raises(ValueError, match=r"router_top_k: x \[T, E\] and weight \[N, E\]"):
        router_top_k(x, weight[:, :15], 2)
    with pytest.raises(ValueError, match="k must be between 1 and N = 8"):
        router_top_k(x, weight, 9, shared=True)


@pytest.mark.triton
def test_more_than_sixteen_rows_are_refused_by_the_kernel(device):
    from tensorfold.kernels.moe import triton_router
    x, weight = inputs(17, 32, 8, torch.float32, seed=6, device=device)
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        triton_router.router_top_k(x, weight, 2, False)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_rows_bound_and_the_switch_pick_the_gemm(monkeypatch):
    x = torch.zeros(17, 8, device="cuda")
    assert not routing.router_applies(x) and routing.router_applies(x[:16])
    monkeypatch.setattr(routing, "FUSED_ROUTER", False)
    assert not routing.router_applies(x[:1])


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_router_at_the_35b_shape(dtype, monkeypatch):
    """E 2048, 256 experts and the shared gate, k 8: the routing kernel's pairs at 1, 8 and 16 rows over many
    draws (bfloat16: with either top-k form), no host sync, and graph replays equal to eager calls."""
    from tensorfold.kernels.moe import triton_router, triton_routing
    for packed in (False, True):
        monkeypatch.setattr(triton_routing, "PACKED_KEYS", packed)
        for seed in range(12):
            M = (1, 8, 16)[seed % 3]
            x, weight = inputs(M, 2048, 257, dtype, seed=seed, device="cuda")
            check_against_the_twin(x, weight, 8, True, RTOL[dtype])
    monkeypatch.undo()
    x, weight = inputs(8, 2048, 257, dtype, seed=100, device="cuda")
    call = lambda: triton_router.router_top_k(x, weight, 8, True)  # noqa: E731
    call()
    without_host_sync(call)
    graph, out = captured(call)
    for seed in range(101, 121):
        x.copy_(inputs(8, 2048, 257, dtype, seed=seed, device="cuda")[0])
        graph.replay()
        torch.cuda.synchronize()
        eager = call()
        assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True)), seed
