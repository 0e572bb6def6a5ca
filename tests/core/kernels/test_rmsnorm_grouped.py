"""grouped_gated_rms_norm: Mamba2's output norm (Nemotron-H's `norms.gated_rms_norm`).

CPU: naive is bitwise the family's expression (copied below), y float32 or bf16, weight fp32 or bf16; the public
function dispatches and validates. triton (the interpreter on the CPU): against naive within rtol = atol = 1e-5 in
float32 (rsqrt and the mean of squares in another order: measured <= 4e-7 relative, 1e-6 absolute) and one bf16 ulp
(2^-7) in bf16 (measured: bitwise on these draws; the kernel rounds where torch rounds). GPU (marked gpu): I 8192,
G 8 (Nemotron-H 8B), N 1 and 8.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tensorfold.kernels.rmsnorm import grouped_gated_rms_norm, naive

CUDA = torch.cuda.is_available()
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 2**-7}}
EPS = 1e-5


def family(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """tensorfold_nemotron.norms.gated_rms_norm as written there."""
    gated = y.float() * F.silu(z.float())
    grouped = gated.view(*gated.shape[:-1], groups, -1)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.view(gated.shape).to(weight.dtype)


def inputs(N: int, W: int, dtype: torch.dtype, y_dtype: torch.dtype = torch.float32, seed: int = 0,
           device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y [N, W] (the D-skipped SSD output, float32 in the family), z [N, W] and weight [W] in the model dtype."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(N, W, generator=gen) * 3
    z = torch.randn(N, W, generator=gen) * 2
    w = 1 + 0.1 * torch.randn(W, generator=gen)
    return y.to(device, y_dtype), z.to(device, dtype), w.to(device, dtype)


@pytest.mark.parametrize("y_dtype", [pytest.param(torch.float32, id="y-fp32"), pytest.param(torch.bfloat16,
                                                                                            id="y-bf16")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, W, G", [(1, 64, 8), (5, 96, 4), (3, 60, 3)], ids=str)
def test_naive_is_the_family_code_bitwise(N, W, G, dtype, y_dtype):
    y, z, w = inputs(N, W, dtype, y_dtype, seed=N)
    ref = family(y, z, w, G, EPS)
    for out in (naive.grouped_gated_rms_norm(y, z, w, G, EPS), grouped_gated_rms_norm(y, z, w, G, EPS)):
        assert out.dtype == dtype and torch.equal(out, ref)


def test_naive_is_nemotrons_own_norm():
    """Against the family's function itself, where it imports."""
    norms = pytest.importorskip("tensorfold_nemotron.norms")
    y, z, w = inputs(4, 128, torch.bfloat16, seed=7)
    assert torch.equal(naive.grouped_gated_rms_norm(y, z, w, 8, EPS), norms.gated_rms_norm(y, z, w, 8, EPS))


@pytest.mark.parametrize("mistake", ["groups", "zero_groups", "z_shape", "w_shape", "y_dim"])
def test_refuses_bad_inputs(mistake):
    y, z, w = inputs(2, 64, torch.float32)
    args = {"groups": (y, z, w, 6), "zero_groups": (y, z, w, 0), "z_shape": (y, z[:, :32], w, 8),
            "w_shape": (y, z, w[:32], 8), "y_dim": (y[None], z, w, 8)}[mistake]
    with pytest.raises(ValueError):
        grouped_gated_rms_norm(*args, EPS)


@pytest.mark.triton
@pytest.mark.parametrize("y_dtype", [pytest.param(torch.float32, id="y-fp32"), pytest.param(torch.bfloat16,
                                                                                            id="y-bf16")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, W, G", [(1, 64, 8), (5, 96, 4), (3, 60, 3), (2, 512, 8)], ids=str)
def test_triton_matches_naive(device, N, W, G, dtype, y_dtype):
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    y, z, w = inputs(N, W, dtype, y_dtype, seed=N + W, device=device)
    ref = naive.grouped_gated_rms_norm(y.cpu(), z.cpu(), w.cpu(), G, EPS)
    out = triton_rmsnorm.grouped_gated_rms_norm(y, z, w, G, EPS)
    assert out.dtype == dtype and out.shape == (N, W)
    torch.testing.assert_close(out.cpu(), ref, **TOLERANCE[dtype])


@pytest.mark.triton
def test_triton_strided_rows(device):
    """y and z as column slices of wider rows (z is a split of in_proj's output in the family)."""
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    y, z, w = inputs(3, 64, torch.float32, seed=3, device=device)
    wide = torch.cat([z, torch.randn(3, 40, device=device)], dim=1)[:, :64]
    ref = naive.grouped_gated_rms_norm(y.cpu(), wide.cpu(), w.cpu(), 4, EPS)
    torch.testing.assert_close(triton_rmsnorm.grouped_gated_rms_norm(y, wide, w, 4, EPS).cpu(), ref,
                               **TOLERANCE[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N", [1, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_nemotron_8b_shape(N, dtype):
    """I 8192, G 8: the public function (triton) against naive on the GPU and on the CPU."""
    y, z, w = inputs(N, 8192, dtype, seed=11, device="cuda")
    out = grouped_gated_rms_norm(y, z, w, 8, EPS)
    for ref in (naive.grouped_gated_rms_norm(y, z, w, 8, EPS).cpu(),
                naive.grouped_gated_rms_norm(y.cpu(), z.cpu(), w.cpu(), 8, EPS)):
        torch.testing.assert_close(out.cpu(), ref, **TOLERANCE[dtype])
    diff = (out.cpu().float() - ref.float()).abs().max().item()
    print(f"RMS-GROUPED N={N} {dtype}: max |triton - naive(cpu)| {diff:.3g}, bitwise {torch.equal(out.cpu(), ref)}")
