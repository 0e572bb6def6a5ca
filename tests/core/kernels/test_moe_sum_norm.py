"""moe.routed_experts_norm: the experts' sum, the residual add and the next RMSNorm in one launch
(triton_sum_norm) give the bits of `routed_experts` then `rms_norm(..., residual=...)` (the two Triton launches
there, bit for bit, in the interpreter and on the GPU), batch invariant; the naive path is the two calls; the
arguments are checked by name."""

from __future__ import annotations

import pytest
import torch
from test_moe import DTYPES, case, on

from tensorfold.kernels import moe
from tensorfold.kernels.rmsnorm import rms_norm

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs


def inputs(T: int, k: int, N: int, dtype: torch.dtype, seed: int, hidden: int = 32, inner: int = 16):
    x, chosen, weights, gate_up, down = case(T, k, N, dtype, seed, hidden, inner)
    g = torch.Generator().manual_seed(seed + 1)
    residual = torch.randn(T, hidden, generator=g).to(dtype)
    norm_weight = (torch.randn(hidden, generator=g) * 0.1).to(dtype)
    return x, chosen, weights, gate_up, down, residual, norm_weight


def fused(device: str, *args: torch.Tensor, zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from tensorfold.kernels.moe import triton_moe, triton_sum_norm
    x, chosen, weights, gate_up, down, residual, norm_weight = on(device, *args)
    contrib, plan = triton_moe.contributions(x, chosen, weights, gate_up, down)
    return triton_sum_norm.sum_then_norm(contrib, plan.expert, gate_up.shape[0], chosen.shape[1], residual,
                                         norm_weight, 1e-6, zero_centred)


def two_launches(device: str, *args: torch.Tensor, zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from tensorfold.kernels.moe import triton_moe
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    x, chosen, weights, gate_up, down, residual, norm_weight = on(device, *args)
    out = triton_moe.routed_experts(x, chosen, weights, gate_up, down)
    return triton_rmsnorm.rms_norm(out, norm_weight, 1e-6, zero_centred=zero_centred, residual=residual)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,k,N", [(1, 3, 6), (5, 2, 4), (3, 4, 4)])
@pytest.mark.parametrize("zero_centred", [True, False])
def test_one_launch_gives_the_two_launches_bits(T, k, N, dtype, zero_centred, device):
    args = inputs(T, k, N, dtype, seed=T + 10 * k)
    for a, b in zip(fused(device, *args, zero_centred=zero_centred),
                    two_launches(device, *args, zero_centred=zero_centred), strict=True):
        assert torch.equal(a, b)


@pytest.mark.triton
def test_an_out_of_range_expert_adds_nothing_as_in_the_sum(device):
    x, chosen, weights, gate_up, down, residual, norm_weight = inputs(3, 3, 5, torch.bfloat16, seed=4)
    chosen[1, 2] = 5                                                     # N: the sort maps it past the experts
    args = (x, chosen, weights, gate_up, down, residual, norm_weight)
    for a, b in zip(fused(device, *args, zero_centred=True), two_launches(device, *args, zero_centred=True),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.triton
def test_a_row_alone_is_the_row_in_a_batch(device):
    args = inputs(6, 3, 5, torch.bfloat16, seed=7)
    whole = fused(device, *args, zero_centred=True)
    for t in (0, 3, 5):
        alone = fused(device, *(a[t:t + 1] if a.shape[0] == 6 and a.dim() == 2 else a for a in args),
                      zero_centred=True)
        assert all(torch.equal(one[0], many[t]) for one, many in zip(alone, whole, strict=True))


def test_the_naive_path_is_the_two_calls():
    x, chosen, weights, gate_up, down, residual, norm_weight = inputs(4, 2, 5, torch.float32, seed=2)
    got = moe.routed_experts_norm(x, chosen, weights, gate_up, down, residual, norm_weight, 1e-6, zero_centred=True)
    want = rms_norm(moe.routed_experts(x, chosen, weights, gate_up, down), norm_weight, 1e-6, zero_centred=True,
                    residual=residual)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_residual_of_another_shape_is_named():
    x, chosen, weights, gate_up, down, residual, norm_weight = inputs(4, 2, 5, torch.float32, seed=2)
    with pytest.raises(ValueError, match="residual"):
        moe.routed_experts_norm(x, chosen, weights, gate_up, down, residual[:3], norm_weight, 1e-6,
                                zero_centred=True)
    with pytest.raises(ValueError, match="kind"):
        moe.routed_experts_norm(x, chosen, weights, gate_up, down, residual, norm_weight, 1e-6,
                                zero_centred=True, kind="bulk")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_one_launch_at_the_35b_shape(dtype):
    """35B-A3B's widths (hidden 2048, experts 512 wide, 257 with the shared one, 9 a row), 1 and 64 rows."""
    for T in (1, 64):
        args = inputs(T, 9, 257, dtype, seed=T, hidden=2048, inner=512)
        for a, b in zip(fused("cuda", *args, zero_centred=True), two_launches("cuda", *args, zero_centred=True),
                        strict=True):
            assert torch.equal(a, b)
