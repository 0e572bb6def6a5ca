"""moe: the naive routed experts against a per-row loop and against tensorfold_qwen's `moe` (bitwise); the Triton
grouped GEMM against naive (reference always computed on the CPU), bitwise batch invariance, no host sync.

Tolerances, Triton vs naive: float32 rtol = atol = 1e-5 (IEEE float32 dots in another order); bfloat16
rtol = atol = 2^-6 (intermediates are bf16: a gate or up one ulp apart moves the output by about one ulp).
"""

from __future__ import annotations

import unittest.mock

import pytest
import torch
import torch.nn.functional as F

from tensorfold.kernels.moe import naive, routed_experts

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-6, "atol": 2**-6}}
E, FF = 32, 16          # hidden and expert intermediate sizes of the interpreter tests

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs


def case(T: int, k: int, N: int, dtype: torch.dtype, seed: int, hidden: int = E, inner: int = FF):
    """x, chosen, weights, gate_up, down on the CPU, routed as the model routes (softmax, top-k, renormalised)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(T, N, generator=g), dim=-1)
    weights, chosen = probs.topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    gate_up = (torch.randn(N, 2 * inner, hidden, generator=g) * hidden**-0.5).to(dtype)
    down = (torch.randn(N, hidden, inner, generator=g) * inner**-0.5).to(dtype)
    return x, chosen, weights, gate_up, down


def per_row(x, chosen, weights, gate_up, down, limit: float | None = None) -> torch.Tensor:
    """The definition, one row and one expert at a time, summed in ascending expert order; with `limit`, the
    clamped SwiGLU silu(min(g, limit)) · clamp(u, -limit, limit)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(chosen.shape[1]), key=lambda j: int(chosen[t, j])):
            gate, up = gate_up[int(chosen[t, j])].chunk(2)
            g, u = gate @ x[t], up @ x[t]
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
            hidden = F.silu(g) * u
            out[t] += (down[int(chosen[t, j])] @ hidden) * weights[t, j]
    return out


def on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def triton_call(device: str, *args: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    from tensorfold.kernels.moe import triton_moe
    return triton_moe.routed_experts(*on(device, *args), limit=limit).cpu()


LIMIT = 0.5   # the clamp tests' swiglu limit: below many of the unit-scale gate and up values, so it binds


# ---- naive (no triton needed) -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, k, N", [(1, 1, 4), (5, 2, 8), (33, 4, 8)])
def test_naive_matches_the_per_row_definition(T, k, N, dtype):
    args = case(T, k, N, dtype, seed=T + k)
    got = naive.routed_experts(*args)
    assert got.dtype == dtype and got.shape == (T, E)
    torch.testing.assert_close(got, per_row(*args), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_is_the_routed_part_of_qwen_moe(dtype):
    """naive + the shared expert == tensorfold_qwen's `moe` bit for bit, and so is `moe_routed` on the CPU."""
    mlp = pytest.importorskip("tensorfold_qwen.mlp")
    N, k, T = 8, 2, 9
    x, _, _, gate_up, down = case(T, k, N, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    draw = lambda *shape: (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)  # noqa: E731
    w = mlp.MoeWeights(router=draw(N, E), gate_up=gate_up, down=down,
                       shared=mlp.MlpWeights(gate_proj=draw(24, E), up_proj=draw(24, E), down_proj=draw(E, 24)),
                       shared_gate=draw(1, E), top_k=k)
    probs = torch.softmax(F.linear(x, w.router).float(), dim=-1)
    weights, chosen = probs.topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    shared = mlp.swiglu(w.shared, x) * torch.sigmoid(F.linear(x, w.shared_gate))
    reference = mlp.moe(w, x)
    assert torch.equal(naive.routed_experts(x, chosen, weights, gate_up, down) + shared, reference)
    assert torch.equal(mlp.moe_routed(w, x), reference)


@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_clamps_the_swiglu_with_a_limit(dtype):
    """limit: silu(min(g, L)) · clamp(u, -L, L); the case's gate and up values pass L both ways, so the clamp
    changes the result; a limit above every value changes nothing."""
    args = case(9, 2, 8, dtype, seed=21)
    got = routed_experts(*args, limit=LIMIT)
    torch.testing.assert_close(got, per_row(*args, limit=LIMIT), **TOLERANCE[dtype])
    assert not torch.allclose(got.float(), routed_experts(*args).float(), atol=1e-2)
    assert torch.equal(routed_experts(*args, limit=1e6), routed_experts(*args))


def test_cpu_dispatch_is_naive():
    args = case(7, 2, 8, torch.float32, seed=1)
    assert torch.equal(routed_experts(*args), naive.routed_experts(*args))


def test_empty_rows():
    x, chosen, weights, gate_up, down = case(3, 2, 4, torch.float32, seed=0)
    assert routed_experts(x[:0], chosen[:0], weights[:0], gate_up, down).shape == (0, E)


def test_rejects_bad_arguments():
    x, chosen, weights, gate_up, down = case(3, 2, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="x must be a floating"):
        routed_experts(x[0], chosen, weights, gate_up, down)
    with pytest.raises(ValueError, match="chosen must be"):
        routed_experts(x, chosen[:2], weights, gate_up, down)
    with pytest.raises(ValueError, match="k >= 1"):
        routed_experts(x, chosen[:, :0], weights[:, :0], gate_up, down)
    with pytest.raises(ValueError, match="chosen must be .* torch.int64"):
        routed_experts(x, chosen.int(), weights, gate_up, down)
    with pytest.raises(ValueError, match="weights must be"):
        routed_experts(x, chosen, weights.double(), gate_up, down)
    with pytest.raises(ValueError, match="gate_up must be"):
        routed_experts(x, chosen, weights, gate_up[:, 1:], down)
    with pytest.raises(ValueError, match="gate_up must be"):
        routed_experts(x, chosen, weights, gate_up[:, :, 1:], down)
    with pytest.raises(ValueError, match="down must be"):
        routed_experts(x, chosen, weights, gate_up, down[:, :, 1:])
    with pytest.raises(ValueError, match="down must be"):
        routed_experts(x, chosen, weights, gate_up, down[:3])
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        routed_experts(x, chosen + 3, weights, gate_up, down)
    with pytest.raises(ValueError, match="limit clamps the silu_gate activation only"):
        routed_experts(x, chosen, weights, gate_up[:, :FF], down, activation="relu2", limit=1.0)


# ---- triton (GPU, or the interpreter on the CPU) ------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_triton_matches_naive(T, k, N, dtype, device):
    args = case(T, k, N, dtype, seed=100 * T + 10 * k + N)
    got = triton_call(device, *args)
    assert got.dtype == dtype and got.shape == (T, E)
    torch.testing.assert_close(got, naive.routed_experts(*args), **TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, k", [(1, 2), (33, 4)])
def test_triton_clamps_like_naive(T, k, dtype, device):
    """The clamped SwiGLU (limit), one block per pair (T·k <= 64) and grouped by expert."""
    args = case(T, k, 8, dtype, seed=31 + T)
    got = triton_call(device, *args, limit=LIMIT)
    torch.testing.assert_close(got, naive.routed_experts(*args, limit=LIMIT), **TOLERANCE[dtype])
    assert not torch.allclose(got.float(), naive.routed_experts(*args).float(), atol=1e-2)   # the clamp binds


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_odd_sizes_and_repeated_experts(dtype, device):
    """E, F not multiples of the tiles; a row naming one expert twice gets it twice."""
    x, chosen, weights, gate_up, down = case(6, 3, 5, dtype, seed=7, hidden=40, inner=24)
    chosen[1] = torch.tensor([2, 2, 4])
    chosen[4] = torch.tensor([0, 0, 0])
    got = triton_call(device, x, chosen, weights, gate_up, down)
    torch.testing.assert_close(got, naive.routed_experts(x, chosen, weights, gate_up, down), **TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_is_batch_invariant_and_deterministic(dtype, device):
    """A row's bits are the same alone, in a slice of the batch and in the whole batch, and twice in a row."""
    args = case(40, 4, 8, dtype, seed=3)
    whole = triton_call(device, *args)
    assert torch.equal(whole, triton_call(device, *args))
    for t in (0, 17, 39):
        alone = triton_call(device, *(a[t:t + 1] for a in args[:3]), *args[3:])
        assert torch.equal(alone[0], whole[t]), t
    assert torch.equal(triton_call(device, *(a[5:14] for a in args[:3]), *args[3:]), whole[5:14])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_lone_pairs_take_their_own_tiles_and_the_grouped_rows_bits(dtype, device, monkeypatch):
    """A decode call of lone pairs (at most PAIR_BLOCKS_UP_TO) under PAIR_* F and E tiles unlike the grouped decode
    tiles: a row's bits alone, among 8 (lone pairs) and inside 40 rows (160 pairs, grouped) are the same. (The
    interpreter's dot sums a K step at once, so the K steps stay the decode tiles' here; test_moe_gpu.py varies
    those too on the device.)"""
    from tensorfold.kernels.moe import triton_moe
    monkeypatch.setattr(triton_moe, "PAIR_BLOCK_F", 16)
    monkeypatch.setattr(triton_moe, "PAIR_BLOCK_E", 64)
    monkeypatch.setattr(triton_moe, "PAIR_WARPS", 2)
    args = case(40, 4, 8, dtype, seed=13, hidden=128, inner=64)
    whole = triton_call(device, *args)
    for t in (0, 21):
        alone = triton_call(device, *(a[t:t + 1] for a in args[:3]), *args[3:])
        assert torch.equal(alone[0], whole[t]), t
    assert torch.equal(triton_call(device, *(a[30:38] for a in args[:3]), *args[3:]), whole[30:38])


def test_the_lone_pair_tiles_are_the_decode_tiles_unless_set_apart():
    """As shipped, PAIR_* equal DECODE_* (so a lone pair's launch is the grouped decode's); float32 and the
    grouped-only prefill kind never take them."""
    from tensorfold.kernels.moe import triton_moe
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        decode = triton_moe.config_for(2048, 512, dtype, "decode")
        assert triton_moe.pair_config(decode, 2048, 512, dtype) == decode
    assert triton_moe.lone_pairs(72, triton_moe.config_for(2048, 512, torch.bfloat16, "decode").grouped_only)
    assert not triton_moe.lone_pairs(73, triton_moe.config_for(2048, 512, torch.bfloat16, "decode").grouped_only)
    assert not triton_moe.lone_pairs(8, triton_moe.config_for(2048, 512, torch.bfloat16, "prefill").grouped_only)
    apart = triton_moe.pair_config(triton_moe.config_for(2048, 512, torch.bfloat16), 2048, 512, torch.bfloat16)
    assert (apart.block_f, apart.block_k_e, apart.block_e, apart.block_k_f) == (
        triton_moe.PAIR_BLOCK_F, triton_moe.PAIR_STEP_E, triton_moe.PAIR_BLOCK_E, triton_moe.PAIR_STEP_F)
    fp32 = triton_moe.config_for(2048, 512, torch.float32)
    assert triton_moe.pair_config(fp32, 2048, 512, torch.float32) is fp32


@pytest.mark.triton
def test_triton_out_of_range_ids_contribute_nothing(device):
    x, chosen, weights, gate_up, down = case(4, 2, 4, torch.float32, seed=9)
    chosen[0, 1], chosen[2, 0] = 4, -1
    got = triton_call(device, x, chosen, weights, gate_up, down)
    kept = weights.clone()
    kept[0, 1] = kept[2, 0] = 0.0
    expected = naive.routed_experts(x, chosen.clamp(0, 3), kept, gate_up, down)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


class HostSync(AssertionError):
    """A forbidden host read-back was called."""


def no_host_sync():
    """Patches that raise on every torch call that reads device data back to the host (or sizes a result by it)."""
    def forbid(name):
        def raising(*args, **kwargs):
            raise HostSync(name)
        return raising

    getitem = torch.Tensor.__getitem__

    def checked_getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise HostSync("boolean mask indexing")
        return getitem(self, index)

    methods = ("item", "tolist", "nonzero", "unique", "bincount", "masked_select", "__bool__", "__int__",
               "__float__", "__index__")
    patches = [unittest.mock.patch.object(torch.Tensor, name, forbid(name)) for name in methods]
    patches += [unittest.mock.patch.object(torch, name, forbid(name))
                for name in ("nonzero", "unique", "bincount", "masked_select", "repeat_interleave", "argwhere")]
    patches.append(unittest.mock.patch.object(torch.Tensor, "__getitem__", checked_getitem))
    return patches


@pytest.mark.triton
def test_triton_path_reads_nothing_back(device):
    """No .item(), .tolist(), nonzero, unique, bincount, boolean mask: what a CUDA graph capture needs. The guard
    itself is shown to catch the naive loop."""
    from tensorfold.kernels.moe import triton_moe
    args = on(device, *case(5, 2, 8, torch.float32, seed=2))
    patches = no_host_sync()
    for patch in patches:
        patch.start()
    try:
        out = triton_moe.routed_experts(*args)
        with pytest.raises(HostSync):
            naive.routed_experts(*args)
    finally:
        for patch in patches:
            patch.stop()
    torch.testing.assert_close(out.cpu(), naive.routed_experts(*(a.cpu() for a in args)), rtol=1e-5, atol=1e-5)


@pytest.mark.triton
def test_grid_is_a_static_bound():
    """The block count depends on T·k and N only, and covers the worst routing (every pair its own expert)."""
    from tensorfold.kernels.moe import triton_moe
    M = triton_moe.BLOCK_M
    assert triton_moe.blocks_bound(1, 256, M) == 1
    assert triton_moe.blocks_bound(8, 256, M) == 8                         # decode, k = 8: one block per pair
    assert triton_moe.blocks_bound(64 * 8, 256, M) == -(-(512 + 256 * (M - 1)) // M)
    chosen = torch.arange(8).reshape(1, 8)
    plan = triton_moe.align(chosen, torch.ones(1, 8), N=256)
    assert plan.block_expert.tolist() == list(range(8))
    assert plan.row_pair.reshape(8, M)[:, 0].tolist() == list(range(8))
    assert bool((plan.row_pair.reshape(8, M)[:, 1:] == 8).all())            # padding rows name no pair
