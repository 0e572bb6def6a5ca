"""sigmoid_bias_top_k (GLM-5's router after its GEMM): the naive twin against the router as HF writes it
(Glm5NextTopkRouter: sigmoid, + bias, group-limited topk, unbiased weights renormalised, × scale), the Triton kernel
against the twin (interpreter on the CPU, the device with CUDA), ties among experts and among groups, NaN, the
shared pair, batch invariance, no host sync, and the pairs through the grouped experts as they come (ordered).

Bounds: the kernel chooses the twin's ids, ties included (the lower index wins, among groups as among experts);
its float32 weights are within 8 ulps of the twin's (relative 2^-20: another order of the k-term sum, and under the
interpreter numpy's exp where torch's CPU sigmoid has its own; measured up to 3.3 · 2^-23 relative on these
shapes). HF's torch.topk leaves its tie order unspecified: against it the chosen sets are compared on random
float32 logits, where a tie does not occur.
"""

from __future__ import annotations

import pytest
import torch
from test_moe import HostSync, no_host_sync

from tensorfold.kernels.moe import naive as naive_experts
from tensorfold.kernels.moe import routing, sigmoid_bias_top_k
from tensorfold.testing.cuda_graphs import captured, without_host_sync

CUDA = torch.cuda.is_available()
RTOL = 2**-20
SCALE = 2.5
# (N, k, n_group, topk_group): plain top-k, DeepSeek-V3-like groups, GLM-5's 288 experts, odd group sizes
SHAPES = [(8, 2, 1, 1), (64, 4, 8, 3), (256, 8, 8, 4), (288, 8, 1, 1), (12, 5, 3, 2), (40, 6, 4, 2), (20, 20, 2, 2)]
# groups of 2: group 1 sums highest, groups 0, 2 and 3 tie for the second place (group 0 wins): with k = 3 the
# experts 1, 2, 3 (of 0..3: expert 0 scores lowest); a later group would bring in expert 4 or 7
GROUP_TIE = torch.tensor([0.0, 3.0, 3.0, 3.0, 3.0, 0.0, 0.0, 3.0])

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs


def case(T: int, N: int, seed: int, scale: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits [T, N] and a correction bias [N] (a tenth of their spread)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, N, generator=g) * scale, 0.1 * torch.randn(N, generator=g)


def hf_router(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int, norm: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Glm5NextTopkRouter after its GEMM, ids sorted ascending (weights with them)."""
    T, N = logits.shape
    scores = logits.float().sigmoid()
    choice = scores + bias
    group_scores = choice.view(T, n_group, N // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(T, n_group, N // n_group).reshape(T, N)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    chosen = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    chosen, order = chosen.sort(dim=-1)
    return (weights * scale).gather(1, order), chosen


def kernel_call(device: str, logits: torch.Tensor, bias: torch.Tensor, *args, **kwargs):
    from tensorfold.kernels.moe import triton_routing
    weights, chosen = triton_routing.sigmoid_bias_top_k(logits.to(device), bias.to(device), *args, **kwargs)
    return weights.cpu(), chosen.cpu()


def assert_weights_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=0.0)


# ---- the naive twin (no triton needed) ----------------------------------------------------------------------

@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("N, k, n_group, topk_group", SHAPES)
def test_naive_is_hfs_router_with_ids_ascending(N, k, n_group, topk_group, norm):
    logits, bias = case(200, N, seed=N + k)
    weights, chosen = routing.sigmoid_naive(logits, bias, k, n_group, topk_group, norm, SCALE)
    assert weights.dtype == torch.float32 and chosen.dtype == torch.long and chosen.shape == (200, k)
    assert bool((chosen[:, 1:] > chosen[:, :-1]).all())
    expected_weights, expected = hf_router(logits, bias, k, n_group, topk_group, norm, SCALE)
    assert torch.equal(chosen, expected)
    assert_weights_close(weights, expected_weights)


def test_naive_breaks_ties_toward_the_lower_index():
    """Among experts (three tie for two places) and among groups (two groups' sums tie for one place)."""
    logits = torch.zeros(3, 8)
    logits[0, [6, 2, 5]] = 1.0                       # three tie for two places: 2 and 5
    logits[2] = GROUP_TIE
    bias = torch.zeros(8)
    _, chosen = routing.sigmoid_naive(logits, bias, 2)
    assert chosen[:2].tolist() == [[2, 5], [0, 1]]
    _, chosen = routing.sigmoid_naive(logits, bias, 3, n_group=4, topk_group=2)
    assert chosen[2].tolist() == [1, 2, 3]
    weights, chosen = routing.sigmoid_naive(logits, bias, 2, norm=False, scale=1.0)
    assert torch.equal(weights[1], torch.sigmoid(torch.zeros(2)))


def test_the_bias_chooses_and_the_scores_weigh():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, chosen = routing.sigmoid_naive(logits, bias, 2, norm=False, scale=SCALE)
    assert chosen.tolist() == [[0, 3]]
    assert torch.equal(weights, torch.sigmoid(logits[:, [0, 3]]) * SCALE)


def test_the_shared_pair_comes_last():
    logits, bias = case(5, 16, seed=1)
    weights, chosen = routing.sigmoid_naive(logits, bias, 3, 4, 2, True, SCALE, shared=True)
    plain_weights, plain = routing.sigmoid_naive(logits, bias, 3, 4, 2, True, SCALE)
    assert torch.equal(chosen[:, :3], plain) and torch.equal(weights[:, :3], plain_weights)
    assert chosen[:, 3].tolist() == [16] * 5 and weights[:, 3].tolist() == [1.0] * 5


def test_cpu_dispatch_is_naive():
    logits, bias = case(7, 16, seed=2)
    got = sigmoid_bias_top_k(logits, bias, 4, 4, 2, True, SCALE, shared=True)
    for a, b in zip(got, routing.sigmoid_naive(logits, bias, 4, 4, 2, True, SCALE, shared=True), strict=True):
        assert torch.equal(a, b)


def test_rejects_bad_arguments():
    logits, bias = case(3, 8, seed=0)
    with pytest.raises(ValueError, match="logits must be a floating"):
        sigmoid_bias_top_k(logits.long(), bias, 2)
    with pytest.raises(ValueError, match=r"bias must be \[8\] float32"):
        sigmoid_bias_top_k(logits, bias[:4], 2)
    with pytest.raises(ValueError, match="bias must be"):
        sigmoid_bias_top_k(logits, bias.bfloat16(), 2)
    with pytest.raises(ValueError, match="n_group must divide N = 8"):
        sigmoid_bias_top_k(logits, bias, 2, n_group=3)
    with pytest.raises(ValueError, match="groups of at least 2"):
        sigmoid_bias_top_k(logits, bias, 2, n_group=8)
    with pytest.raises(ValueError, match="topk_group must be between 1 and n_group = 4"):
        sigmoid_bias_top_k(logits, bias, 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="k must be between 1 and N = 8"):
        sigmoid_bias_top_k(logits, bias, 9)


# ---- triton (GPU, or the interpreter on the CPU) ------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("N, k, n_group, topk_group", SHAPES)
def test_triton_matches_naive_and_hf(N, k, n_group, topk_group, norm, device):
    logits, bias = case(64 if device == "cuda" else 16, N, seed=10 * N + k)    # the interpreter runs a row a program
    weights, chosen = kernel_call(device, logits, bias, k, n_group, topk_group, norm, SCALE)
    naive_weights, naive_chosen = routing.sigmoid_naive(logits, bias, k, n_group, topk_group, norm, SCALE)
    assert torch.equal(chosen, naive_chosen)
    assert_weights_close(weights, naive_weights)
    expected_weights, expected = hf_router(logits, bias, k, n_group, topk_group, norm, SCALE)
    assert torch.equal(chosen, expected)
    assert_weights_close(weights, expected_weights)


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")     # the NaN rows' weights, by design
def test_triton_ties_nan_and_strided_rows(device):
    """Ties go to the lower index among experts and among groups; a NaN never beats a number and every row still
    names k distinct ids in range; the logits may be a column slice of a wider matrix."""
    wide = torch.zeros(5, 12)
    wide[0, [6, 2, 5, 3]] = 1.0                                         # four tie for three places: 2, 3, 5
    wide[1, :8] = float("nan")
    wide[2, [1, 4]] = float("nan")
    wide[3, :8] = GROUP_TIE
    wide[4, :8] = torch.randn(8, generator=torch.Generator().manual_seed(4))
    bias = torch.zeros(8)
    weights, chosen = kernel_call(device, wide[:, :8], bias, 3)
    assert chosen[0].tolist() == [2, 3, 5] and chosen[1].tolist() == [0, 1, 2]
    assert 1 not in chosen[2].tolist() and 4 not in chosen[2].tolist()
    assert all(len(set(row)) == 3 and max(row) < 8 for row in chosen.tolist())
    naive_weights, naive_chosen = routing.sigmoid_naive(wide[:, :8], bias, 3)
    assert torch.equal(chosen, naive_chosen)
    keep = [0, 2, 3, 4]                                                 # row 1's weights are NaN on both paths
    assert_weights_close(weights[keep], naive_weights[keep])
    grouped = kernel_call(device, wide[:, :8], bias, 3, 4, 2, True, SCALE, True)
    assert grouped[1][3].tolist() == [1, 2, 3, 8]                       # groups 1, then 0 of 0, 2, 3 tied
    assert torch.equal(grouped[1], routing.sigmoid_naive(wide[:, :8], bias, 3, 4, 2, True, SCALE, True)[1])


@pytest.mark.triton
def test_triton_shared_pair(device):
    logits, bias = case(9, 64, seed=4)
    weights, chosen = kernel_call(device, logits, bias, 8, 8, 4, True, SCALE, True)
    naive_weights, naive_chosen = routing.sigmoid_naive(logits, bias, 8, 8, 4, True, SCALE, True)
    assert torch.equal(chosen, naive_chosen) and chosen[:, 8].tolist() == [64] * 9
    assert weights[:, 8].tolist() == [1.0] * 9
    assert_weights_close(weights, naive_weights)


@pytest.mark.triton
def test_triton_is_batch_invariant_and_deterministic(device):
    logits, bias = case(40, 64, seed=5)
    whole = kernel_call(device, logits, bias, 6, 8, 3, True, SCALE, True)
    again = kernel_call(device, logits, bias, 6, 8, 3, True, SCALE, True)
    assert all(torch.equal(a, b) for a, b in zip(whole, again, strict=True))
    for t in (0, 17, 39):
        alone = kernel_call(device, logits[t:t + 1], bias, 6, 8, 3, True, SCALE, True)
        assert torch.equal(alone[0][0], whole[0][t]) and torch.equal(alone[1][0], whole[1][t]), t


@pytest.mark.triton
def test_triton_routing_reads_nothing_back(device):
    from tensorfold.kernels.moe import triton_routing
    logits, bias = (t.to(device) for t in case(5, 16, seed=6))
    patches = no_host_sync()
    for patch in patches:
        patch.start()
    try:
        triton_routing.sigmoid_bias_top_k(logits, bias, 4, 4, 2, True, SCALE, True)
        with pytest.raises(HostSync):                   # the guard is on
            logits.sum().item()
    finally:
        for patch in patches:
            patch.stop()


@pytest.mark.triton
@pytest.mark.parametrize("T, kind", [(1, "decode"), (8, "decode"), (24, "prefill")])
def test_the_pairs_through_the_experts_with_the_float32_sum(T, kind, device):
    """The kernel's pairs (shared expert as expert N, weight 1) through the Triton experts' float32 sum with
    ordered=True equal the same pairs sorted and range-checked (ordered=False) bit for bit, and naive within the
    bf16 tolerance (bit-equal on these shapes)."""
    from tensorfold.kernels.moe import triton_moe
    N, k, E, F = 8, 2, 32, 16
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, E, generator=g).bfloat16()
    logits, bias = case(T, N, seed=T)
    gate_up = (torch.randn(N + 1, 2 * F, E, generator=g) * E**-0.5).bfloat16()
    down = (torch.randn(N + 1, E, F, generator=g) * F**-0.5).bfloat16()
    weights, chosen = kernel_call(device, logits, bias, k, 2, 1, True, SCALE, True)
    args = [t.to(device) for t in (x, chosen, weights, gate_up, down)]
    modes = dict(kind=kind, limit=0.5, float32_sum=True, shared_last=True)
    fast = triton_moe.routed_experts(*args, ordered=True, **modes).cpu()
    assert torch.equal(fast, triton_moe.routed_experts(*args, **modes).cpu())
    expected = naive_experts.routed_experts(x, chosen, weights, gate_up, down, limit=0.5, float32_sum=True,
                                            shared_last=True)
    torch.testing.assert_close(fast, expected, rtol=2**-6, atol=2**-6)


# ---- the GPU at GLM-5's router (N 288, k 8) and a grouped one (N 256 in 8 groups, 4 kept) ---------------------

@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N, k, n_group, topk_group", [(288, 8, 1, 1), (256, 8, 8, 4)])
def test_gpu_routing_at_glm_shapes(N, k, n_group, topk_group):
    """Against the twin on the device (the ids equal; weights within 8 ulps: the sigmoid is torch's CUDA formula),
    HF's set on the device, no sync in eager mode, and a CUDA graph replay equal to an eager call."""
    from tensorfold.kernels.moe import triton_routing
    for T in (1, 8, 64):
        logits, bias = (t.cuda() for t in case(T, N, seed=T))
        weights, chosen = sigmoid_bias_top_k(logits, bias, k, n_group, topk_group, True, SCALE, shared=True)
        naive_weights, naive_chosen = routing.sigmoid_naive(logits, bias, k, n_group, topk_group, True, SCALE, True)
        assert torch.equal(chosen, naive_chosen)
        assert_weights_close(weights, naive_weights)
        assert torch.equal(chosen[:, :k], hf_router(logits, bias, k, n_group, topk_group, True, SCALE)[1])
    static, bias = (t.cuda() for t in case(8, N, seed=20))
    call = lambda: triton_routing.sigmoid_bias_top_k(static, bias, k, n_group, topk_group, True, SCALE, True)  # noqa: E731
    call()                                                                  # compile first
    without_host_sync(call)
    graph, out = captured(call)
    for seed in (21, 22):
        static.copy_(case(8, N, seed=seed)[0].cuda())
        graph.replay()
        torch.cuda.synchronize()
        eager = call()
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1]), seed
