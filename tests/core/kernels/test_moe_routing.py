"""softmax_top_k: the naive twin against the router as HF writes it (torch softmax, topk, renormalise), the Triton
kernel against the twin (interpreter on the CPU, the device with CUDA), ties, the shared pair, batch invariance, no
host sync, and routed_experts taking the ordered pairs as they are.

Bounds, against torch's router on rows without a tie at the k-th place (where torch.topk's choice is its own): the
same chosen set; weights within 8 float32 ulps (relative 2^-20; measured within 3.3 in the interpreter) or one
bfloat16 ulp (relative 2^-7: the float32 values a few ulps apart may round to neighbouring bf16 values). The
Triton kernel and the twin choose the same ids, ties included, and their weights meet the same bounds. On the GPU
the kernel's exp is triton's (not libm's): float32 within 16 ulps there.
"""

from __future__ import annotations

import pytest
import torch
from test_moe import HostSync, no_host_sync

from tensorfold.kernels.moe import naive as naive_experts
from tensorfold.kernels.moe import routed_experts, routing, softmax_top_k
from tensorfold.testing.cuda_graphs import captured, without_host_sync

CUDA = torch.cuda.is_available()
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
RTOL = {torch.float32: 2**-20, torch.bfloat16: 2**-7}

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs


def logits_of(T: int, N: int, dtype: torch.dtype, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, N, generator=g) * scale).to(dtype)


def torch_router(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's Qwen3.5-MoE router after its GEMM (tensorfold_qwen.mlp.route): float32 softmax, topk, renormalised."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = probs.topk(k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), chosen


def ascending(weights: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, order = chosen.sort(dim=-1)
    return weights.gather(1, order), chosen


def untied(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[T] bool: rows whose k-th and (k+1)-th largest logits differ (the chosen set does not hang on a tie)."""
    top = logits.float().sort(dim=-1, descending=True).values
    return top[:, k - 1] != top[:, k] if k < logits.shape[1] else torch.ones(len(logits), dtype=torch.bool)


def assert_weights_close(got: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=0.0)


def kernel_call(device: str, logits: torch.Tensor, k: int, shared: torch.Tensor | None = None):
    from tensorfold.kernels.moe import triton_routing
    weights, chosen = triton_routing.softmax_top_k(logits.to(device), k,
                                                   None if shared is None else shared.to(device))
    return weights.cpu(), chosen.cpu()


# ---- the naive twin (no triton needed) ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, k", [(8, 2), (64, 4), (256, 8)])
def test_naive_is_the_torch_router_with_ids_ascending(N, k, dtype):
    logits = logits_of(300, N, dtype, seed=N + k)
    weights, chosen = routing.naive(logits, k)
    assert weights.dtype == dtype and chosen.dtype == torch.long and chosen.shape == (300, k)
    assert bool((chosen[:, 1:] > chosen[:, :-1]).all())
    expected_weights, expected = ascending(*torch_router(logits, k))
    rows = untied(logits, k)
    assert torch.equal(chosen[rows], expected[rows])
    assert_weights_close(weights[rows], expected_weights[rows], RTOL[dtype])


def test_naive_breaks_ties_toward_the_lowest_index():
    logits = torch.zeros(3, 8)
    logits[0, [6, 2, 5]] = 1.0                       # three tie for two places: 2 and 5
    logits[1] = 0.5                                  # all tie: 0, 1, 2
    logits[2, 7] = 2.0                               # 7, then the lowest of the rest
    weights, chosen = routing.naive(logits[:, :8], 2)
    assert chosen.tolist() == [[2, 5], [0, 1], [0, 7]]
    assert torch.equal(weights[0], torch.tensor([0.5, 0.5]))


def test_the_shared_pair_comes_last():
    logits = logits_of(5, 9, torch.bfloat16, seed=1)
    weights, chosen = routing.naive(logits[:, :8], 3, logits[:, 8:])
    plain_weights, plain = routing.naive(logits[:, :8], 3)
    assert torch.equal(chosen[:, :3], plain) and torch.equal(weights[:, :3], plain_weights)
    assert chosen[:, 3].tolist() == [8] * 5
    assert torch.equal(weights[:, 3:], torch.sigmoid(logits[:, 8:]))


def test_cpu_dispatch_is_naive():
    logits = logits_of(7, 16, torch.float32, seed=2)
    for got, expected in zip(softmax_top_k(logits, 4), routing.naive(logits, 4), strict=True):
        assert torch.equal(got, expected)


def test_rejects_bad_arguments():
    logits = logits_of(3, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="logits must be a floating"):
        softmax_top_k(logits.long(), 2)
    with pytest.raises(ValueError, match="k must be between 1 and N = 8"):
        softmax_top_k(logits, 9)
    with pytest.raises(ValueError, match="k must be between"):
        softmax_top_k(logits, 0)
    with pytest.raises(ValueError, match=r"shared must be \[3, 1\]"):
        softmax_top_k(logits, 2, logits[:, :2])
    with pytest.raises(ValueError, match="shared must be"):
        softmax_top_k(logits, 2, logits[:, :1].double())


# ---- triton (GPU, or the interpreter on the CPU) ------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, k", [(8, 2), (5, 5), (64, 4), (256, 8), (100, 7)])
def test_triton_matches_naive_and_torch(N, k, dtype, device):
    """Same ids as the twin (ties included), weights within the bounds; the torch router's set where no tie."""
    logits = logits_of(96, N, dtype, seed=10 * N + k)
    weights, chosen = kernel_call(device, logits, k)
    naive_weights, naive_chosen = routing.naive(logits, k)
    assert torch.equal(chosen, naive_chosen)
    assert_weights_close(weights, naive_weights, RTOL[dtype])
    expected_weights, expected = ascending(*torch_router(logits, k))
    rows = untied(logits, k)
    assert torch.equal(chosen[rows], expected[rows])
    assert_weights_close(weights[rows], expected_weights[rows], RTOL[dtype])


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")     # the all-NaN row's weights, by design
def test_triton_ties_nan_and_strided_rows(device):
    """Ties go to the lowest index; a NaN logit never gets chosen over a number and every row still names k
    distinct ids in range; the logits may be a column slice of a wider matrix, the shared gate another."""
    wide = logits_of(4, 12, torch.float32, seed=3)
    wide[0, :8] = 0.0
    wide[0, [6, 2, 5, 3]] = 1.0                        # four tie for three places: 2, 3, 5
    wide[1, :8] = float("nan")
    wide[2, [1, 4]] = float("nan")
    weights, chosen = kernel_call(device, wide[:, :8], 3, wide[:, 10:11])
    assert chosen[0].tolist() == [2, 3, 5, 8] and chosen[1].tolist() == [0, 1, 2, 8]
    assert 1 not in chosen[2].tolist() and 4 not in chosen[2].tolist()
    assert all(len(set(row)) == 4 and max(row) == 8 for row in chosen.tolist())
    naive_weights, naive_chosen = routing.naive(wide[:, :8], 3, wide[:, 10:11])
    assert torch.equal(chosen, naive_chosen)
    keep = [0, 2, 3]                                   # row 1's weights are NaN on both paths
    assert_weights_close(weights[keep], naive_weights[keep], RTOL[torch.float32])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_shared_pair(dtype, device):
    logits = logits_of(9, 33, dtype, seed=4)
    weights, chosen = kernel_call(device, logits[:, :32], 8, logits[:, 32:])
    naive_weights, naive_chosen = routing.naive(logits[:, :32], 8, logits[:, 32:])
    assert torch.equal(chosen, naive_chosen) and chosen[:, 8].tolist() == [32] * 9
    assert_weights_close(weights, naive_weights, RTOL[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_is_batch_invariant_and_deterministic(dtype, device):
    logits = logits_of(40, 64, dtype, seed=5)
    whole = kernel_call(device, logits, 6, logits[:, :1])
    again = kernel_call(device, logits, 6, logits[:, :1])
    assert all(torch.equal(a, b) for a, b in zip(whole, again, strict=True))
    for t in (0, 17, 39):
        alone = kernel_call(device, logits[t:t + 1], 6, logits[t:t + 1, :1])
        assert torch.equal(alone[0][0], whole[0][t]) and torch.equal(alone[1][0], whole[1][t]), t


@pytest.mark.triton
def test_triton_routing_reads_nothing_back(device):
    from tensorfold.kernels.moe import triton_routing
    logits = logits_of(5, 16, torch.float32, seed=6).to(device)
    patches = no_host_sync()
    for patch in patches:
        patch.start()
    try:
        triton_routing.softmax_top_k(logits, 4, logits[:, :1])
        with pytest.raises(HostSync):                   # the guard is on
            logits.sum().item()
    finally:
        for patch in patches:
            patch.stop()


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, kind", [(1, "decode"), (8, "decode"), (24, "prefill")])
def test_ordered_pairs_with_a_shared_expert_through_the_experts(T, kind, dtype, device):
    """The routing kernel's pairs (shared expert as expert N) through the Triton experts with ordered=True equal
    the same pairs sorted and range-checked (ordered=False) bit for bit, and the naive experts within tolerance."""
    from tensorfold.kernels.moe import triton_moe
    N, k, E, F = 8, 2, 32, 16
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, E, generator=g).to(dtype)
    logits = torch.randn(T, N + 1, generator=g).to(dtype)
    gate_up = (torch.randn(N + 1, 2 * F, E, generator=g) * E**-0.5).to(dtype)
    down = (torch.randn(N + 1, E, F, generator=g) * F**-0.5).to(dtype)
    weights, chosen = kernel_call(device, logits[:, :N], k, logits[:, N:])
    args = [t.to(device) for t in (x, chosen, weights, gate_up, down)]
    fast = triton_moe.routed_experts(*args, kind=kind, ordered=True).cpu()
    assert torch.equal(fast, triton_moe.routed_experts(*args, kind=kind).cpu())
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(fast, naive_experts.routed_experts(x, chosen, weights, gate_up, down),
                               rtol=tolerance, atol=tolerance)
    assert torch.equal(routed_experts(x, chosen, weights, gate_up, down, ordered=True),
                       routed_experts(x, chosen, weights, gate_up, down))          # CPU: naive either way


@pytest.mark.triton
def test_ordered_decode_alignment_issues_no_op():
    """Ordered pairs, few of them: the alignment is views of the caller's tensors (no sort, no cast)."""
    from tensorfold.kernels.moe import triton_moe
    chosen = torch.tensor([[1, 3, 8], [0, 5, 8]])
    weights = torch.rand(2, 3)
    plan = triton_moe.align(chosen, weights, N=9, ordered=True)
    assert plan.expert.data_ptr() == chosen.data_ptr() and plan.block_expert is plan.expert
    assert plan.weight.data_ptr() == weights.data_ptr()
    assert triton_moe.PAIR_BLOCKS_UP_TO >= 8 * (8 + 1)           # 8 decode streams at k = 8 plus a shared expert


# ---- bfloat16 logits: the top-k on packed keys (triton_routing.PACKED_KEYS) ------------------------------------

SUBNORMAL_ROW = 6   # the interpreter's kernels read its subnormals as zeros (both top-k forms), the twin does not


def crafted_bf16_rows(N: int) -> torch.Tensor:
    """bfloat16 rows that test a top-k's order: ties, -0 beside +0, both infinities, NaN, subnormals, all-NaN
    and all -inf rows, and values one bfloat16 ulp apart."""
    tiny = torch.finfo(torch.bfloat16).smallest_normal
    rows = torch.zeros(12, N)
    rows[0, ::2] = 1.0                                          # ties everywhere
    rows[1] = -0.0
    rows[1, 1::3] = 0.0                                         # -0 and +0 are equal: the lowest index first
    rows[2] = float("-inf")
    rows[2, N // 2] = float("inf")
    rows[2, -1] = float("inf")
    rows[3] = float("nan")
    rows[4] = float("-inf")
    rows[5, ::3] = float("nan")
    rows[5, 1::3] = float("-inf")
    rows[6] = tiny / 4                                          # subnormal, beside zeros and a negative subnormal
    rows[6, ::4] = 0.0
    rows[6, 1::5] = -tiny / 4
    rows[7] = torch.arange(N, dtype=torch.float32) % 3 - 1.0
    one = torch.tensor(1.0, dtype=torch.bfloat16)
    rows[8] = 1.0
    rows[8, 1::2] = torch.nextafter(one, torch.tensor(2.0, dtype=torch.bfloat16)).float()   # one ulp up
    rows[9] = -1.0
    rows[9, ::3] = torch.nextafter(-one, torch.tensor(0.0, dtype=torch.bfloat16)).float()   # one ulp toward 0
    rows[10] = -torch.arange(N, dtype=torch.float32) * 1e30                  # huge negatives
    rows[11] = torch.arange(N, dtype=torch.float32).flip(0) * 1e-3
    return rows.to(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN weights included)."""
    if a.dtype.is_floating_point:
        return torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32))
    return torch.equal(a, b)


def with_packed(packed: bool, device: str, logits: torch.Tensor, k: int, shared: torch.Tensor | None):
    from tensorfold.kernels.moe import triton_routing
    before = triton_routing.PACKED_KEYS
    triton_routing.PACKED_KEYS = packed
    try:
        return kernel_call(device, logits, k, shared)
    finally:
        triton_routing.PACKED_KEYS = before


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")     # the all-NaN row's weights, by design
@pytest.mark.parametrize("N, k", [(8, 3), (5, 5), (100, 7), (256, 8)])
def test_packed_keys_choose_what_the_two_reductions_choose(N, k, device):
    """bfloat16 logits: the packed top-k gives the same ids and the same weight bits as the max-then-min rounds
    and the twin's ids, on crafted rows and random ones (some with many ties: few distinct values)."""
    from tensorfold.kernels.moe import triton_routing
    assert triton_routing.route_config(N, k, torch.bfloat16)["PACKED"] is triton_routing.PACKED_KEYS
    assert not triton_routing.route_config(N, k, torch.float32)["PACKED"]
    assert not triton_routing.route_config(N, k, torch.float16)["PACKED"]
    coarse = (logits_of(24, N, torch.float32, seed=N) * 2).round() / 2
    logits = torch.cat([crafted_bf16_rows(N), logits_of(24, N, torch.bfloat16, seed=k), coarse.to(torch.bfloat16)])
    shared = logits_of(len(logits), 1, torch.bfloat16, seed=7)
    packed = with_packed(True, device, logits, k, shared)
    plain = with_packed(False, device, logits, k, shared)
    assert all(same_bits(a, b) for a, b in zip(packed, plain, strict=True))
    twin = routing.naive(logits, k, shared)[1]
    rows = torch.arange(len(logits)) != SUBNORMAL_ROW
    assert torch.equal(packed[1][rows], twin[rows])


# ---- the GPU at Qwen3.5-35B-A3B's router (N 256, k 8, plus the shared expert) ---------------------------------

@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_routing_at_the_35b_shape(dtype):
    """Against the twin and torch's router on the device (the ids equal, torch's where no tie; weights within
    16 float32 ulps or one bf16 ulp), no sync in eager mode, and a CUDA graph replay equal to an eager call."""
    from tensorfold.kernels.moe import triton_routing
    N, k = 256, 8
    rtol = {torch.float32: 2**-19, torch.bfloat16: 2**-7}[dtype]
    for T in (1, 8, 64):
        logits = logits_of(T, N + 1, dtype, seed=T).cuda()
        weights, chosen = softmax_top_k(logits[:, :N], k, logits[:, N:])
        naive_weights, naive_chosen = routing.naive(logits[:, :N], k, logits[:, N:])
        assert torch.equal(chosen, naive_chosen)
        assert_weights_close(weights, naive_weights, rtol)
        expected_weights, expected = ascending(*torch_router(logits[:, :N], k))
        rows = untied(logits[:, :N], k)
        assert torch.equal(chosen[rows, :k], expected[rows])
        assert_weights_close(weights[rows, :k], expected_weights[rows], rtol)
        if dtype == torch.bfloat16:                  # the packed top-k against the max-then-min rounds
            plain = with_packed(False, "cuda", logits[:, :N], k, logits[:, N:])
            assert same_bits(weights.cpu(), plain[0]) and torch.equal(chosen.cpu(), plain[1])
    crafted = crafted_bf16_rows(N).cuda()
    if dtype == torch.bfloat16:
        packed = with_packed(True, "cuda", crafted, k, None)
        plain = with_packed(False, "cuda", crafted, k, None)
        assert all(same_bits(a, b) for a, b in zip(packed, plain, strict=True))
        rows = torch.arange(len(crafted)) != SUBNORMAL_ROW
        assert torch.equal(packed[1][rows], routing.naive(crafted.cpu(), k)[1][rows])
    static = logits_of(8, N + 1, dtype, seed=20).cuda()
    triton_routing.softmax_top_k(static[:, :N], k, static[:, N:])                 # compile first
    call = lambda: triton_routing.softmax_top_k(static[:, :N], k, static[:, N:])  # noqa: E731
    without_host_sync(call)
    graph, out = captured(call)
    for seed in (21, 22):
        static.copy_(logits_of(8, N + 1, dtype, seed=seed).cuda())
        graph.replay()
        torch.cuda.synchronize()
        eager = triton_routing.softmax_top_k(static[:, :N], k, static[:, N:])
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1]), seed
