"""kernels.linear_norm: the few-row split-K GEMV equals F.linear within the dtype's tolerance; the projection fused
with the residual add and the next RMSNorm gives the bits of the GEMV then triton_rmsnorm's rms_norm (interpreter
and GPU); a row's bits are the same alone and among up to 16 rows; past 16 rows, off a Triton device or switched
off, the calls are torch's; bad arguments are named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tensorfold.kernels import linear_norm
from tensorfold.kernels.rmsnorm import rms_norm

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


def inputs(M: int, K: int, D: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    weight = (torch.randn(D, K, generator=g) * K ** -0.5).to(dtype)
    residual = torch.randn(M, D, generator=g).to(dtype)
    norm_weight = (torch.randn(D, generator=g) * 0.1).to(dtype)
    return [t.to(device) for t in (x, weight, residual, norm_weight)]


def fused(x, weight, residual, norm_weight, zero_centred: bool = True):
    from tensorfold.kernels.linear_norm import triton_linear_norm
    return triton_linear_norm.linear_then_norm(x, weight, residual, norm_weight, 1e-6, zero_centred)


def two_launches(x, weight, residual, norm_weight, zero_centred: bool = True):
    from tensorfold.kernels.linear_norm import triton_linear_norm
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    y = triton_linear_norm.linear(x, weight)
    return triton_rmsnorm.rms_norm(y, norm_weight, 1e-6, zero_centred=zero_centred, residual=residual)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,D", [(1, 300, 40), (5, 64, 33), (16, 520, 64)])
def test_the_gemv_is_f_linear(M, K, D, dtype, device):
    from tensorfold.kernels.linear_norm import triton_linear_norm
    x, weight, _, _ = inputs(M, K, D, dtype, seed=M + K, device=device)
    got = triton_linear_norm.linear(x, weight).float()
    want = F.linear(x.double(), weight.double()).float()
    assert got.shape == (M, D)
    assert (got - want).abs().max().item() <= TOLERANCE[dtype] * max(1.0, want.abs().max().item())


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,D", [(1, 300, 40), (3, 64, 2048), (16, 520, 64)])
@pytest.mark.parametrize("zero_centred", [True, False])
def test_the_fused_norm_gives_the_gemv_then_norm_bits(M, K, D, dtype, zero_centred, device):
    args = inputs(M, K, D, dtype, seed=3 * M + D, device=device)
    for a, b in zip(fused(*args, zero_centred=zero_centred), two_launches(*args, zero_centred=zero_centred),
                    strict=True):
        assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.triton
def test_a_row_alone_is_the_row_among_sixteen(device):
    from tensorfold.kernels.linear_norm import triton_linear_norm
    x, weight, residual, norm_weight = inputs(16, 300, 40, torch.bfloat16, seed=5, device=device)
    whole = fused(x, weight, residual, norm_weight)
    projected = triton_linear_norm.linear(x, weight)
    for m in (0, 7, 15):
        alone = fused(x[m:m + 1], weight, residual[m:m + 1], norm_weight)
        assert all(torch.equal(one[0], many[m]) for one, many in zip(alone, whole, strict=True))
        assert torch.equal(triton_linear_norm.linear(x[m:m + 1], weight)[0], projected[m])


@pytest.mark.triton
def test_more_than_sixteen_rows_are_refused_by_the_kernel(device):
    from tensorfold.kernels.linear_norm import triton_linear_norm
    x, weight, _, _ = inputs(17, 64, 32, torch.float32, seed=1, device=device)
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        triton_linear_norm.linear(x, weight)


def test_off_a_triton_device_the_calls_are_torchs():
    x, weight, residual, norm_weight = inputs(4, 48, 24, torch.float32, seed=2)
    assert not linear_norm.applies(x)
    assert torch.equal(linear_norm.linear(x, weight), F.linear(x, weight))
    got = linear_norm.linear_then_norm(x, weight, residual, norm_weight, 1e-6, zero_centred=True)
    want = rms_norm(F.linear(x, weight), norm_weight, 1e-6, zero_centred=True, residual=residual)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_rows_bound_and_the_switch_pick_torch(monkeypatch):
    x = torch.zeros(17, 8, device="cuda")
    assert not linear_norm.applies(x) and linear_norm.applies(x[:16])
    monkeypatch.setattr(linear_norm, "ENABLED", False)
    assert not linear_norm.applies(x[:1])


def test_bad_arguments_are_named():
    x, weight, residual, norm_weight = inputs(2, 16, 8, torch.float32, seed=3)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        linear_norm.linear(x, weight[:, :15])
    with pytest.raises(ValueError, match="residual must be"):
        linear_norm.linear_then_norm(x, weight, residual[:1], norm_weight, 1e-6, zero_centred=True)
    with pytest.raises(ValueError, match="norm_weight must be"):
        linear_norm.linear_then_norm(x, weight, residual, norm_weight[:7], 1e-6, zero_centred=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,D", [(4096, 2048), (4096, 4096)], ids=["35b-out_proj", "9b-out_proj"])
def test_gpu_fused_bits_and_batch_invariance_at_the_out_projections(K, D, dtype):
    from tensorfold.kernels.linear_norm import triton_linear_norm
    x, weight, residual, norm_weight = inputs(16, K, D, dtype, seed=K + D, device="cuda")
    whole = fused(x, weight, residual, norm_weight)
    for a, b in zip(whole, two_launches(x, weight, residual, norm_weight), strict=True):
        assert torch.equal(a, b)
    alone = fused(x[:1], weight, residual[:1], norm_weight)
    assert all(torch.equal(one[0], many[0]) for one, many in zip(alone, whole, strict=True))
    got = triton_linear_norm.linear(x, weight).float()
    want = F.linear(x.double(), weight.double()).float()
    assert (got - want).abs().max().item() <= TOLERANCE[dtype] * max(1.0, want.abs().max().item())



class Counted:
    """A kernel whose launches are named in `launches` as they run."""

    def __init__(self, kernel, name: str, launches: list[str]) -> None:
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches.append(self.name)
        return self.kernel[grid]


def one_slice_both_ways(x, weight):
    """The one-launch GEMV, and the same single K slice through the partial-sums and sum launches."""
    from tensorfold.kernels.linear_norm import triton_linear_norm
    one = triton_linear_norm.linear(x, weight)
    p = triton_linear_norm.parts(x, weight, 1)
    two = torch.empty_like(one)
    triton_linear_norm._sum_kernel[(x.shape[0],)](p, two, x.shape[0], weight.shape[0], p.stride(0), p.stride(1),
                                                  two.stride(0), SPLITS=1,
                                                  BLOCK_D=triton_linear_norm.triton.next_power_of_2(weight.shape[0]))
    return one, two


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_wide_projection_is_one_launch_with_the_sum_launchs_bits(dtype, device, monkeypatch):
    from tensorfold.kernels.linear_norm import triton_linear_norm
    monkeypatch.setattr(linear_norm, "ONE_SLICE_FROM", 64)
    x, weight, _, _ = inputs(16, 300, 72, dtype, seed=11, device=device)
    assert triton_linear_norm.splits_for(72) == 1 and triton_linear_norm.splits_for(63) == 2
    launches: list[str] = []
    for name in ("_parts_kernel", "_sum_kernel"):
        monkeypatch.setattr(triton_linear_norm, name, Counted(getattr(triton_linear_norm, name), name, launches))
    one = triton_linear_norm.linear(x, weight)
    assert launches == ["_parts_kernel"]
    two = one_slice_both_ways(x, weight)[1]
    assert one.dtype == dtype and torch.equal(one, two)
    want = F.linear(x.double(), weight.double()).float()
    assert (one.float() - want).abs().max().item() <= TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    for m in (0, 9, 15):
        assert torch.equal(triton_linear_norm.linear(x[m:m + 1], weight)[0], one[m])


def test_one_launch_needs_the_gemv_and_a_wide_weight(monkeypatch):
    x = torch.zeros(2, 8)
    assert not linear_norm.one_launch(x, torch.zeros(linear_norm.ONE_SLICE_FROM, 8))   # the CPU: torch's
    monkeypatch.setattr(linear_norm, "applies", lambda t: True)
    assert linear_norm.one_launch(x, torch.zeros(linear_norm.ONE_SLICE_FROM, 8))
    assert not linear_norm.one_launch(x, torch.zeros(linear_norm.ONE_SLICE_FROM - 1, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,N", [(2048, 12352), (2048, 9216), (4096, 12352), (4096, 10240)],
                         ids=["35b-in_proj", "35b-qkv", "9b-in_proj", "9b-qkv"])
def test_gpu_the_input_projections_are_one_launch_with_the_sum_launchs_bits(K, N, dtype):
    from tensorfold.kernels.linear_norm import triton_linear_norm
    assert linear_norm.one_launch(torch.zeros(1, K, device="cuda"), torch.zeros(N, 1))
    x, weight, _, _ = inputs(16, K, N, dtype, seed=K + N, device="cuda")
    one, two = one_slice_both_ways(x, weight)
    assert torch.equal(one, two)
    assert torch.equal(triton_linear_norm.linear(x[3:4], weight)[0], one[3])
    want = F.linear(x.double(), weight.double()).float()
    assert (one.float() - want).abs().max().item() <= TOLERANCE[dtype] * max(1.0, want.abs().max().item())
