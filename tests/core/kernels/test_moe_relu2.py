"""moe with activation="relu2" (Nemotron-H's experts: down @ relu(up @ x)², no gate; gate_up holds the up weights
[N, F, E]): naive against a per-row loop and against HF nemotron_h's experts module (bitwise on the CPU), Triton
against naive in the interpreter with test_moe.py's tolerances, batch invariance, no host sync, argument checks.
"""

from __future__ import annotations

import pytest
import test_moe as base
import torch

from tensorfold.kernels.moe import naive, routed_experts

E, FF = base.E, base.FF
RELU2 = dict(activation="relu2")

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs


def case(T: int, k: int, N: int, dtype: torch.dtype, seed: int, hidden: int = E, inner: int = FF):
    """x, chosen, weights, up [N, F, E], down [N, E, F] on the CPU, routed as the model routes."""
    x, chosen, weights, gate_up, down = base.case(T, k, N, dtype, seed, hidden, inner)
    return x, chosen, weights, gate_up[:, inner:].contiguous(), down


def per_row(x, chosen, weights, up, down) -> torch.Tensor:
    """The definition, one row and one expert at a time, summed in ascending expert order."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(chosen.shape[1]), key=lambda j: int(chosen[t, j])):
            hidden = torch.relu(up[int(chosen[t, j])] @ x[t]) ** 2
            out[t] += (down[int(chosen[t, j])] @ hidden) * weights[t, j]
    return out


def triton_call(device: str, *args: torch.Tensor) -> torch.Tensor:
    from tensorfold.kernels.moe import triton_moe
    return triton_moe.routed_experts(*base.on(device, *args), **RELU2).cpu()


# ---- naive (no triton needed) -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", base.DTYPES)
@pytest.mark.parametrize("T, k, N", [(1, 1, 4), (5, 2, 8), (33, 4, 8)])
def test_naive_relu2_matches_the_per_row_definition(T, k, N, dtype):
    args = case(T, k, N, dtype, seed=T + k)
    got = naive.routed_experts(*args, **RELU2)
    assert got.dtype == dtype and got.shape == (T, E)
    torch.testing.assert_close(got, per_row(*args), **base.TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", base.DTYPES)
def test_naive_relu2_is_hf_nemotron_h_experts(dtype):
    """HF's NemotronHExperts (its eager loop; up_proj [N, F, E], down_proj [N, E, F], relu2) computes the same sum
    bit for bit (same per-expert ops, index_add in ascending expert order in the routing weights' dtype, here x's)."""
    hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    N, k, T = 8, 2, 9
    x, chosen, weights, up, down = case(T, k, N, dtype, seed=5)
    config = hf.NemotronHConfig(hidden_size=E, moe_intermediate_size=FF, n_routed_experts=N)
    assert config.mlp_hidden_act == "relu2"
    module = hf.NemotronHExperts(config).to(dtype)
    assert module.up_proj.shape == up.shape and module.down_proj.shape == down.shape
    with torch.no_grad():
        module.up_proj.copy_(up)
        module.down_proj.copy_(down)
        theirs = module(x, chosen, weights)
    assert torch.equal(naive.routed_experts(x, chosen, weights, up, down, **RELU2), theirs)


def test_silu_default_is_unchanged():
    """No activation and activation="silu_gate" are the same call (the SwiGLU path's own tests are test_moe.py's)."""
    args = base.case(7, 2, 8, torch.float32, seed=1)
    assert torch.equal(routed_experts(*args), routed_experts(*args, activation="silu_gate"))


def test_cpu_dispatch_is_naive_and_checks():
    x, chosen, weights, up, down = case(7, 2, 8, torch.float32, seed=1)
    assert torch.equal(routed_experts(x, chosen, weights, up, down, **RELU2),
                       naive.routed_experts(x, chosen, weights, up, down, **RELU2))
    assert routed_experts(x[:0], chosen[:0], weights[:0], up, down, **RELU2).shape == (0, E)
    with pytest.raises(ValueError, match="activation must be one of"):
        routed_experts(x, chosen, weights, up, down, activation="gelu")
    with pytest.raises(ValueError, match="gate_up must be"):
        routed_experts(x, chosen, weights, up[:, :, 1:], down, **RELU2)
    with pytest.raises(ValueError, match="gate_up must be"):
        routed_experts(x, chosen, weights, up[0], down, **RELU2)
    with pytest.raises(ValueError, match="down must be"):
        routed_experts(x, chosen, weights, torch.cat([up, up], 1), down, **RELU2)   # a SwiGLU gate_up
    with pytest.raises(ValueError, match=r"outside \[0, 8\)"):
        routed_experts(x, chosen + 7, weights, up, down, **RELU2)


# ---- triton (GPU, or the interpreter on the CPU) ------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize("dtype", base.DTYPES)
@pytest.mark.parametrize("T, k, N", [(1, 1, 4), (5, 2, 8), (33, 4, 8), (70, 2, 4)])
def test_triton_relu2_matches_naive(T, k, N, dtype, device):
    """Within test_moe.py's TOLERANCE; T·k = 140 takes the grouped (sorted and padded) path."""
    args = case(T, k, N, dtype, seed=100 * T + 10 * k + N)
    got = triton_call(device, *args)
    assert got.dtype == dtype and got.shape == (T, E)
    torch.testing.assert_close(got, naive.routed_experts(*args, **RELU2), **base.TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", base.DTYPES)
def test_triton_relu2_odd_sizes_and_repeated_experts(dtype, device):
    """E, F not multiples of the tiles; a row naming one expert twice gets it twice."""
    x, chosen, weights, up, down = case(6, 3, 5, dtype, seed=7, hidden=40, inner=24)
    chosen[1] = torch.tensor([2, 2, 4])
    chosen[4] = torch.tensor([0, 0, 0])
    got = triton_call(device, x, chosen, weights, up, down)
    torch.testing.assert_close(got, naive.routed_experts(x, chosen, weights, up, down, **RELU2),
                               **base.TOLERANCE[dtype])


@pytest.mark.triton
def test_triton_relu2_is_batch_invariant_and_reads_nothing_back(device):
    """A row's bits are the same alone and in the batch, twice; no host read-back (CUDA-graph capturable)."""
    from tensorfold.kernels.moe import triton_moe
    args = case(40, 4, 8, torch.bfloat16, seed=3)
    whole = triton_call(device, *args)
    assert torch.equal(whole, triton_call(device, *args))
    for t in (0, 17, 39):
        assert torch.equal(triton_call(device, *(a[t:t + 1] for a in args[:3]), *args[3:])[0], whole[t]), t
    on_device = base.on(device, *args[:3], *args[3:])
    patches = base.no_host_sync()
    for patch in patches:
        patch.start()
    try:
        out = triton_moe.routed_experts(*on_device, **RELU2)
    finally:
        for patch in patches:
            patch.stop()
    assert torch.equal(out.cpu(), whole)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", base.DTYPES)
def test_triton_prefill_kind_matches_naive_and_is_invariant_among_prefills(dtype, device):
    """kind="prefill" (128-row expert blocks; bf16 takes larger tiles): within TOLERANCE of naive, and a row's bits
    are the same in any prefill call, a lone row included (its one expert block is then mostly padding)."""
    from tensorfold.kernels.moe import triton_moe
    args = case(70, 2, 4, dtype, seed=11)
    on_device = base.on(device, *args)
    whole = triton_moe.routed_experts(*on_device, activation="relu2", kind="prefill").cpu()
    torch.testing.assert_close(whole, naive.routed_experts(*args, **RELU2), **base.TOLERANCE[dtype])
    for t in (0, 33, 69):
        one = [a[t:t + 1] for a in on_device[:3]]
        got = triton_moe.routed_experts(*one, *on_device[3:], activation="relu2", kind="prefill").cpu()
        assert torch.equal(got[0], whole[t]), t
    part = triton_moe.routed_experts(*(a[20:45] for a in on_device[:3]), *on_device[3:], activation="relu2",
                                     kind="prefill").cpu()
    assert torch.equal(part, whole[20:45])


def test_prefill_tiles_are_a_function_of_the_shape_not_the_rows():
    """The prefill kind's tiles: 128-row blocks, always grouped; the decode kind's are unchanged."""
    from tensorfold.kernels.moe import triton_moe
    decode = triton_moe.config_for(2688, 1856, torch.bfloat16)
    prefill = triton_moe.config_for(2688, 1856, torch.bfloat16, "prefill")
    assert (decode.block_m, decode.grouped_only) == (triton_moe.BLOCK_M, False)
    assert (prefill.block_m, prefill.grouped_only) == (triton_moe.PREFILL_BLOCK_M, True)
    assert prefill.block_f > decode.block_f
    x, chosen, weights, up, down = case(3, 2, 4, torch.float32, seed=1)
    with pytest.raises(ValueError, match="kind must be one of"):
        routed_experts(x, chosen, weights, up, down, activation="relu2", kind="chunk")
