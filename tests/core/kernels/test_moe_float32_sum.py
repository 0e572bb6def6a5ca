"""routed_experts' float32 sum (GLM-5's numerics: float32 weights, each pair's output rounded to x's dtype, times
its weight in float32, summed in float32 in ascending expert order, rounded once) and `shared_last` (the row's
last pair, a shared expert folded in as expert N, added after that rounding): naive against a per-row definition,
the Triton kernels against naive (interpreter on the CPU, the device with CUDA), batch invariance, no host sync, a
CUDA graph replay. Tolerances, Triton vs naive: test_moe.py's (float32 1e-5, bfloat16 2^-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_moe import LIMIT, TOLERANCE, HostSync, case, no_host_sync, on

from tensorfold.kernels.moe import naive, routed_experts
from tensorfold.testing.cuda_graphs import captured, without_host_sync

CUDA = torch.cuda.is_available()
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs


def glm_case(T: int, k: int, N: int, dtype: torch.dtype, seed: int, shared: bool = False):
    """test_moe's case with float32 weights × 2.5 (GLM's routed scaling); with `shared`, one more expert (N) and a
    last pair (N, 1.0) in every row."""
    x, chosen, weights, gate_up, down = case(T, k, N + shared, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    chosen = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g) * 2.5
    if shared:
        chosen = torch.cat([chosen, torch.full((T, 1), N)], dim=1)
        weights = torch.cat([weights, torch.ones(T, 1)], dim=1)
    return x, chosen, weights, gate_up, down


def per_row(x, chosen, weights, gate_up, down, limit: float | None, shared_last: bool = False) -> torch.Tensor:
    """The definition, one row and one expert at a time, ascending ids: Σ float32(y) · w in float32, rounded once;
    with shared_last the largest id's round(float32(y) · w) added after."""
    def expert(row: torch.Tensor, e: int) -> torch.Tensor:
        g, u = F.linear(row, gate_up[e]).chunk(2, dim=-1)
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        return F.linear(F.silu(g) * u, down[e])[0]

    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        row = x[t:t + 1]
        pairs = sorted(zip(chosen[t].tolist(), weights[t].tolist(), strict=True))
        last = pairs.pop() if shared_last else None
        total = torch.zeros(x.shape[1])
        for e, w in pairs:
            total = total + expert(row, e).float() * torch.tensor(w)
        out[t] = total.to(x.dtype)
        if last is not None:
            out[t] = out[t] + (expert(row, last[0]).float() * torch.tensor(last[1])).to(x.dtype)
    return out


def triton_call(device: str, *args: torch.Tensor, **kwargs) -> torch.Tensor:
    from tensorfold.kernels.moe import triton_moe
    return triton_moe.routed_experts(*on(device, *args), **kwargs).cpu()


# ---- naive (no triton needed) -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared_last", [False, True], ids=["routed", "shared"])
def test_naive_float32_sum_is_the_per_row_definition(dtype, shared_last):
    args = glm_case(9, 3, 8, dtype, seed=1, shared=shared_last)
    got = naive.routed_experts(*args, limit=LIMIT, float32_sum=True, shared_last=shared_last)
    assert got.dtype == dtype
    torch.testing.assert_close(got, per_row(*args, LIMIT, shared_last), **TOLERANCE[dtype])


def test_shared_last_takes_the_largest_id_wherever_it_stands():
    x, chosen, weights, gate_up, down = glm_case(6, 3, 8, torch.bfloat16, seed=2, shared=True)
    order = torch.tensor([3, 0, 2, 1])                                  # the shared pair first
    front = naive.routed_experts(x, chosen[:, order], weights[:, order], gate_up, down, float32_sum=True,
                                 shared_last=True)
    assert torch.equal(front, naive.routed_experts(x, chosen, weights, gate_up, down, float32_sum=True,
                                                   shared_last=True))


def test_rejects_the_modes_misused():
    x, chosen, weights, gate_up, down = glm_case(3, 2, 4, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="weights must be .* torch.float32"):
        routed_experts(x, chosen, weights.bfloat16(), gate_up, down, float32_sum=True)
    with pytest.raises(ValueError, match="weights must be .* torch.bfloat16"):
        routed_experts(x, chosen, weights, gate_up, down)
    with pytest.raises(ValueError, match="shared_last applies to the float32 sum only"):
        routed_experts(x, chosen, weights.bfloat16(), gate_up, down, shared_last=True)


# ---- triton (GPU, or the interpreter on the CPU) ------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared_last", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("T, k, kind", [(1, 1, "decode"), (5, 3, "decode"), (33, 4, "decode"), (33, 4, "prefill")])
def test_triton_matches_naive(T, k, kind, shared_last, dtype, device):
    args = glm_case(T, k, 8, dtype, seed=10 * T + k, shared=shared_last)
    modes = dict(limit=LIMIT, float32_sum=True, shared_last=shared_last)
    got = triton_call(device, *args, kind=kind, **modes)
    assert got.dtype == dtype and got.shape == (T, args[0].shape[1])
    torch.testing.assert_close(got, naive.routed_experts(*args, **modes), **TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_triton_is_batch_invariant_and_deterministic(kind, device):
    """A row's bits are the same alone, in a slice and in the whole batch, and twice in a row (bf16, shared)."""
    args = glm_case(40, 4, 8, torch.bfloat16, seed=3, shared=True)
    modes = dict(kind=kind, float32_sum=True, shared_last=True)
    whole = triton_call(device, *args, **modes)
    assert torch.equal(whole, triton_call(device, *args, **modes))
    for t in (0, 17, 39):
        alone = triton_call(device, *(a[t:t + 1] for a in args[:3]), *args[3:], **modes)
        assert torch.equal(alone[0], whole[t]), t
    assert torch.equal(triton_call(device, *(a[5:14] for a in args[:3]), *args[3:], **modes), whole[5:14])


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")     # 0 · inf for the dropped pairs, then masked
def test_triton_out_of_range_ids_contribute_nothing(device):
    """Even with a weight that would poison the float32 sum (inf)."""
    x, chosen, weights, gate_up, down = glm_case(4, 2, 4, torch.float32, seed=9)
    chosen[0, 1], chosen[2, 0] = 4, -1
    weights[0, 1] = weights[2, 0] = float("inf")
    got = triton_call(device, x, chosen, weights, gate_up, down, float32_sum=True)
    kept = weights.clone()
    kept[0, 1] = kept[2, 0] = 0.0
    expected = naive.routed_experts(x, chosen.clamp(0, 3), kept, gate_up, down, float32_sum=True)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.triton
def test_triton_float32_sum_reads_nothing_back(device):
    from tensorfold.kernels.moe import triton_moe
    args = on(device, *glm_case(5, 2, 8, torch.bfloat16, seed=2, shared=True))
    patches = no_host_sync()
    for patch in patches:
        patch.start()
    try:
        triton_moe.routed_experts(*args, ordered=True, float32_sum=True, shared_last=True)
        with pytest.raises(HostSync):                   # the guard is on
            args[0].sum().item()
    finally:
        for patch in patches:
            patch.stop()


# ---- the GPU at GLM-5's expert shapes (E 4096, F 2048; 64 experts, k 8, plus the shared one) -----------------

@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_float32_sum_at_glm_shapes(dtype):
    """Against naive on the device (relative to the output's largest magnitude: float32 2e-5, bf16 2^-6, as
    test_moe_gpu.py), a row alone equal to it in the batch, no sync, a CUDA graph replay equal to eager."""
    E, FF, N, K = 4096, 2048, 64, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(N + 1, 2 * FF, E, device="cuda", generator=g) * E**-0.5).to(dtype)
    down = (torch.randn(N + 1, E, FF, device="cuda", generator=g) * FF**-0.5).to(dtype)
    limit = {torch.float32: 2e-5, torch.bfloat16: 2**-6}[dtype]

    def rows(T: int, seed: int):
        r = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(T, E, device="cuda", generator=r).to(dtype)
        chosen = torch.rand(T, N, device="cuda", generator=r).topk(K, dim=-1).indices.sort(dim=-1).values
        weights = torch.rand(T, K, device="cuda", generator=r) * 2.5
        return (x, torch.cat([chosen, torch.full((T, 1), N, device="cuda")], 1),
                torch.cat([weights, torch.ones(T, 1, device="cuda")], 1))

    modes = dict(limit=10.0, ordered=True, float32_sum=True, shared_last=True)
    for T, kind in ((1, "decode"), (8, "decode"), (64, "prefill")):
        x, chosen, weights = rows(T, seed=T)
        got = routed_experts(x, chosen, weights, gate_up, down, kind=kind, **modes)
        ref = naive.routed_experts(x, chosen, weights, gate_up, down, limit=10.0, float32_sum=True,
                                   shared_last=True)
        assert float((got.float() - ref.float()).abs().max()) <= limit * float(ref.float().abs().max())
        for t in (0, T - 1):
            alone = routed_experts(x[t:t + 1], chosen[t:t + 1], weights[t:t + 1], gate_up, down, kind=kind, **modes)
            assert torch.equal(alone[0], got[t]), (T, kind, t)
    x, chosen, weights = rows(8, seed=30)
    call = lambda: routed_experts(x, chosen, weights, gate_up, down, **modes)  # noqa: E731
    call()
    without_host_sync(call)
    graph, out = captured(call)
    for seed in (31, 32):
        new = rows(8, seed=seed)
        for static, value in zip((x, chosen, weights), new, strict=True):
            static.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call()), seed
