"""rmsnorm: the naive path against tensorfold_qwen's `layers.rms_norm` / `layers.gated_rms_norm` (bitwise), the
Triton kernels against the naive path (reference always computed on the CPU).

Tolerances, Triton vs naive: float32 rtol = atol = 1e-5 (the sum of squares in another order); bfloat16
rtol = atol = 2^-7, one bf16 ulp at unit scale (the kernels round where the reference rounds: the residual sum,
x̂ for the gated norm, w·x̂, the output). The fused residual sum is one rounding of the same two inputs: exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tensorfold.kernels.rmsnorm import gated_rms_norm, naive, rms_norm

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 2**-7}}
EPS = 1e-6


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded CPU normals in dtype (the same values whatever the device they go to)."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# ---- naive (no triton needed) -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, D", [(1, 7), (5, 64), (3, 300)], ids=["N1-D7", "N5-D64", "N3-D300"])
def test_naive_zero_centred_matches_qwen_reference(N, D, dtype):
    layers = pytest.importorskip("tensorfold_qwen.layers")
    x, w = randn(N, D, dtype=dtype, seed=0, scale=3.0), randn(D, dtype=dtype, seed=1, scale=0.1)
    out = naive.rms_norm(x, w, EPS, zero_centred=True)
    assert out.dtype == dtype and torch.equal(out, layers.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_residual_is_the_unfused_add_then_norm(dtype):
    layers = pytest.importorskip("tensorfold_qwen.layers")
    x, r, w = (randn(4, 96, dtype=dtype, seed=s) for s in (0, 1, 2))
    out, total = naive.rms_norm(x, w, EPS, zero_centred=True, residual=r)
    assert torch.equal(total, x + r)
    assert torch.equal(out, layers.rms_norm(x + r, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_plain_is_x_hat_times_w(dtype):
    x, w = randn(6, 48, dtype=dtype, seed=0), randn(48, dtype=dtype, seed=1)
    expected = F.rms_norm(x.double(), (48,), w.double(), EPS)
    out = naive.rms_norm(x, w, EPS, zero_centred=False)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("weight_dtype", [pytest.param(torch.float32, id="w-fp32"),
                                          pytest.param(torch.bfloat16, id="w-bf16")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_weight_after_cast_is_the_llama_order(dtype, weight_dtype):
    """w · x̂.to(dtype) as HF's Llama-style norms write it (GLM-5's), bit for bit."""
    x, w = randn(6, 48, dtype=dtype, seed=3, scale=2.0), randn(48, dtype=weight_dtype, seed=4)
    x32 = x.float()
    expected = (w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)).to(dtype)
    out = rms_norm(x, w, EPS, zero_centred=False, weight_after_cast=True)
    assert out.dtype == dtype and torch.equal(out, expected)
    with pytest.raises(ValueError, match="weight_after_cast"):
        rms_norm(x, w, EPS, zero_centred=True, weight_after_cast=True)


@pytest.mark.parametrize("weight_dtype", [pytest.param(torch.float32, id="w-fp32"),
                                          pytest.param(torch.bfloat16, id="w-bf16")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_gated_matches_qwen_reference(dtype, weight_dtype):
    layers = pytest.importorskip("tensorfold_qwen.layers")
    x, z = randn(5, 3, 24, dtype=dtype, seed=0), randn(5, 3, 24, dtype=dtype, seed=1)
    w = randn(24, dtype=weight_dtype, seed=2)
    out = naive.gated_rms_norm(x, z, w, EPS)
    assert out.dtype == dtype and torch.equal(out, layers.gated_rms_norm(x, z, w, EPS))


def test_empty_rows():
    w = torch.ones(8)
    assert rms_norm(torch.ones(0, 8), w, EPS, zero_centred=True).shape == (0, 8)
    out, total = rms_norm(torch.ones(0, 8), w, EPS, zero_centred=False, residual=torch.ones(0, 8))
    assert out.shape == total.shape == (0, 8)
    assert gated_rms_norm(torch.ones(0, 2, 8), torch.ones(0, 2, 8), w, EPS).shape == (0, 2, 8)


def test_rejects_bad_arguments():
    x, w = torch.ones(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(torch.ones(2, 3, 8), w, EPS, zero_centred=True)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7), EPS, zero_centred=True)
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm(x, w, EPS, zero_centred=True, residual=torch.ones(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="z must be"):
        gated_rms_norm(torch.ones(3, 2, 8), torch.ones(3, 8), w, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        gated_rms_norm(torch.ones(3, 2, 8), torch.ones(3, 2, 8), torch.ones(3), EPS)


# ---- triton (GPU, or the interpreter on the CPU) ------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize("residual", [False, True], ids=["plain-add", "fused-add"])
@pytest.mark.parametrize("zero_centred", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, D", [(1, 7), (37, 64), (3, 300), (2, 1000)], ids=["N1-D7", "N37-D64", "N3-D300",
                                                                            "N2-D1000"])
def test_triton_rms_norm_matches_naive(N, D, dtype, zero_centred, residual, device):
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    x, w = randn(N, D, dtype=dtype, seed=0, scale=3.0), randn(D, dtype=dtype, seed=1, scale=0.5)
    r = randn(N, D, dtype=dtype, seed=2) if residual else None
    expected = naive.rms_norm(x, w, EPS, zero_centred=zero_centred, residual=r)
    got = triton_rmsnorm.rms_norm(x.to(device), w.to(device), EPS, zero_centred=zero_centred,
                                  residual=None if r is None else r.to(device))
    if residual:
        (expected, expected_sum), (got, got_sum) = expected, got
        assert torch.equal(got_sum.cpu(), expected_sum)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("weight_dtype", [pytest.param(torch.float32, id="w-fp32"), pytest.param(None, id="w-x")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, D", [(1, 7), (37, 64), (3, 4096)], ids=["N1-D7", "N37-D64", "N3-D4096"])
def test_triton_weight_after_cast_matches_naive(N, D, dtype, weight_dtype, device):
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    x, w = randn(N, D, dtype=dtype, seed=5, scale=3.0), randn(D, dtype=weight_dtype or dtype, seed=6, scale=0.5)
    expected = naive.rms_norm(x, w, EPS, zero_centred=False, weight_after_cast=True)
    got = triton_rmsnorm.rms_norm(x.to(device), w.to(device), EPS, zero_centred=False, weight_after_cast=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])
    rows = triton_rmsnorm.rms_norm(x[N - 1:].to(device), w.to(device), EPS, zero_centred=False,
                                   weight_after_cast=True)
    assert torch.equal(rows.cpu(), got[N - 1:].cpu())                       # a row's bits, alone or in the batch


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rms_norm_strided_rows_and_fp32_weight(dtype, device):
    """Rows of a wider tensor (q heads cut from a [N, H, 2D] projection) and a float32 weight."""
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    wide = randn(6, 2 * 40, dtype=dtype, seed=0)
    w = randn(40, dtype=torch.float32, seed=1, scale=0.1)
    expected = naive.rms_norm(wide[:, :40], w, EPS, zero_centred=True)
    got = triton_rmsnorm.rms_norm(wide.to(device)[:, :40], w.to(device), EPS, zero_centred=True)
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("weight_dtype", [pytest.param(torch.float32, id="w-fp32"),
                                          pytest.param(torch.bfloat16, id="w-bf16")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, H, D", [(1, 1, 16), (7, 3, 24), (2, 4, 128)], ids=["N1-H1-D16", "N7-H3-D24",
                                                                              "N2-H4-D128"])
def test_triton_gated_matches_naive(N, H, D, dtype, weight_dtype, device):
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    x, z = randn(N, H, D, dtype=dtype, seed=0), randn(N, H, D, dtype=dtype, seed=1, scale=2.0)
    w = randn(D, dtype=weight_dtype, seed=2)
    expected = naive.gated_rms_norm(x, z, w, EPS)
    got = triton_rmsnorm.gated_rms_norm(x.to(device), z.to(device), w.to(device), EPS)
    assert got.dtype == dtype and got.shape == (N, H, D)
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.triton
def test_triton_empty(device):
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    w = torch.ones(8, device=device)
    assert triton_rmsnorm.rms_norm(torch.ones(0, 8, device=device), w, EPS, zero_centred=True).shape == (0, 8)
    empty = torch.ones(0, 2, 8, device=device)
    assert triton_rmsnorm.gated_rms_norm(empty, empty, w, EPS).shape == (0, 2, 8)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, D", [(37, 64), (4, 2048)], ids=["N37-D64", "N4-D2048"])
def test_triton_fused_residual_is_the_unfused_add_then_norm_bitwise(N, D, dtype, device):
    """The fused form returns the bits of `x + residual` (the add in torch) and of the plain kernel's norm of it
    (on the GPU, the compiled kernels' own bits): the batched step fuses its residual adds on this."""
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    x, r = randn(N, D, dtype=dtype, seed=0, scale=3.0).to(device), randn(N, D, dtype=dtype, seed=1).to(device)
    w = randn(D, dtype=dtype, seed=2, scale=0.1).to(device)
    out, total = triton_rmsnorm.rms_norm(x, w, EPS, zero_centred=True, residual=r)
    assert torch.equal(total, r + x)
    assert torch.equal(out, triton_rmsnorm.rms_norm(r + x, w, EPS, zero_centred=True))


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_gated_reads_a_head_view_of_z_in_place_bitwise(dtype, device):
    """z as the GDN step cuts it, heads of a wider projection [N, C + H·D + 2H]: read in place (token and head
    strides) where its loads vectorise as a copy's would, with the bits of the kernel over the copy; elsewhere
    (misaligned strides, one token, contiguous z) copied or viewed as rows, as before."""
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    N, H, D, C = 9, 8, 16, 192                                      # C + H·D + 2H = 336, a multiple of 16
    proj = randn(N, C + H * D + 2 * H, dtype=dtype, seed=0, scale=2.0).to(device)
    x, w = randn(N, H, D, dtype=dtype, seed=1).to(device), randn(D, dtype=dtype, seed=2).to(device)
    z = proj[:, C: C + H * D].view(N, H, D)
    assert triton_rmsnorm._by_head(z)
    assert torch.equal(triton_rmsnorm.gated_rms_norm(x, z, w, EPS), triton_rmsnorm.gated_rms_norm(x, z.contiguous(),
                                                                                                   w, EPS))
    torch.testing.assert_close(triton_rmsnorm.gated_rms_norm(x, z, w, EPS).cpu(),
                               naive.gated_rms_norm(x.cpu(), z.cpu(), w.cpu(), EPS), **TOLERANCE[dtype])
    narrow = randn(N, 200, dtype=dtype, seed=3).to(device)[:, 8: 8 + H * D].view(N, H, D)   # stride 200
    for other in (narrow, z[:1], z.contiguous()):
        assert not triton_rmsnorm._by_head(other)
        rows = other.shape[0]
        assert torch.equal(triton_rmsnorm.gated_rms_norm(x[:rows], other, w, EPS),
                           triton_rmsnorm.gated_rms_norm(x[:rows], other.contiguous(), w, EPS))
