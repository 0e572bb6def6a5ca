"""silu_gate: the naive path against tensorfold_qwen's `mlp.swiglu` and attention's output gate (bitwise), the
Triton kernels against the naive path (reference always computed on the CPU).

Tolerances, Triton vs naive: float32 rtol = atol = 1e-5 (another exp); bfloat16 rtol = atol = 2^-7, one bf16
ulp at unit scale (the kernels round after the activation and after the product, as the torch ops do).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tensorfold.kernels.silu_gate import naive, sigmoid_mul, silu_mul

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 2**-7}}


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded CPU normals in dtype (the same values whatever the device they go to)."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# ---- naive (no triton needed) -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_silu_mul_is_qwen_swiglu_middle(dtype):
    mlp = pytest.importorskip("tensorfold_qwen.mlp")
    E, Fd = 16, 24
    w = mlp.MlpWeights(gate_proj=randn(Fd, E, dtype=dtype, seed=0), up_proj=randn(Fd, E, dtype=dtype, seed=1),
                       down_proj=randn(E, Fd, dtype=dtype, seed=2))
    x = randn(5, E, dtype=dtype, seed=3)
    hidden = naive.silu_mul(F.linear(x, w.gate_proj), F.linear(x, w.up_proj))
    assert torch.equal(F.linear(hidden, w.down_proj), mlp.swiglu(w, x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_silu_mul_limit_clamps_gate_above_and_up_both_ways(dtype):
    gate, up = randn(4, 64, dtype=dtype, seed=0, scale=8.0), randn(4, 64, dtype=dtype, seed=1, scale=8.0)
    limit = 7.0
    expected = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    assert torch.equal(naive.silu_mul(gate, up, limit), expected)
    assert not torch.equal(expected, naive.silu_mul(gate, up))             # the clamp did bite


@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_sigmoid_mul_is_the_attention_output_gate(dtype):
    out, gate = randn(3, 40, dtype=dtype, seed=0), randn(3, 40, dtype=dtype, seed=1, scale=4.0)
    assert torch.equal(naive.sigmoid_mul(out, gate), out * torch.sigmoid(gate))           # attention.py
    row_gate = randn(3, 1, dtype=dtype, seed=2)
    assert torch.equal(naive.sigmoid_mul(out, row_gate), out * torch.sigmoid(row_gate))   # shared expert gate


def test_empty_rows():
    assert silu_mul(torch.ones(0, 8), torch.ones(0, 8), 2.0).shape == (0, 8)
    assert sigmoid_mul(torch.ones(0, 8), torch.ones(0, 1)).shape == (0, 8)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="up must be"):
        silu_mul(torch.ones(3, 8), torch.ones(3, 7))
    with pytest.raises(ValueError, match="up must be"):
        silu_mul(torch.ones(3, 8), torch.ones(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="limit must be"):
        silu_mul(torch.ones(3, 8), torch.ones(3, 8), limit=0.0)
    with pytest.raises(ValueError, match="gate must be"):
        sigmoid_mul(torch.ones(3, 8), torch.ones(3, 2))
    with pytest.raises(ValueError, match="x must be"):
        sigmoid_mul(torch.ones(8), torch.ones(8))
    with pytest.raises(ValueError, match=r"gate \[N, H, D\] must have N = 3 rows and H·D = F = 8"):
        sigmoid_mul(torch.ones(3, 8), torch.ones(3, 3, 3))


def test_a_gate_of_heads_is_the_gate_of_its_rows():
    """gate [N, H, D] (the gate halves interleaved with q in one projection's columns) is gate.reshape(N, H·D)."""
    proj = randn(3, 2 * 4 * 5 + 6, dtype=torch.bfloat16, seed=2, scale=3.0)
    heads = proj[:, :40].view(3, 4, 10)[..., 5:]
    x = randn(3, 20, dtype=torch.bfloat16, seed=3)
    assert torch.equal(sigmoid_mul(x, heads), naive.sigmoid_mul(x, heads.reshape(3, 20)))


# ---- triton (GPU, or the interpreter on the CPU) ------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize("limit", [None, 7.0], ids=["nolimit", "limit7"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, Fd", [(1, 1), (3, 7), (2, 1500)], ids=["N1-F1", "N3-F7", "N2-F1500"])
def test_triton_silu_mul_matches_naive(N, Fd, dtype, limit, device):
    from tensorfold.kernels.silu_gate import triton_gate
    gate, up = randn(N, Fd, dtype=dtype, seed=0, scale=5.0), randn(N, Fd, dtype=dtype, seed=1, scale=5.0)
    expected = naive.silu_mul(gate, up, limit)
    got = triton_gate.silu_mul(gate.to(device), up.to(device), limit)
    assert got.dtype == dtype and got.shape == (N, Fd)
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_silu_mul_on_fused_gate_up_halves(dtype, device):
    """gate and up as the two halves of one [N, 2F] projection: strided rows, no copies."""
    from tensorfold.kernels.silu_gate import triton_gate
    gate_up = randn(4, 2 * 100, dtype=dtype, seed=0, scale=3.0)
    expected = naive.silu_mul(gate_up[:, :100], gate_up[:, 100:])
    on_device = gate_up.to(device)
    got = triton_gate.silu_mul(on_device[:, :100], on_device[:, 100:])
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("per_row", [False, True], ids=["gate-NF", "gate-N1"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, Fd", [(1, 1), (3, 7), (2, 1500)], ids=["N1-F1", "N3-F7", "N2-F1500"])
def test_triton_sigmoid_mul_matches_naive(N, Fd, dtype, per_row, device):
    from tensorfold.kernels.silu_gate import triton_gate
    x = randn(N, Fd, dtype=dtype, seed=0, scale=2.0)
    gate = randn(N, 1 if per_row else Fd, dtype=dtype, seed=1, scale=4.0)
    expected = naive.sigmoid_mul(x, gate)
    got = triton_gate.sigmoid_mul(x.to(device), gate.to(device))
    assert got.dtype == dtype and got.shape == (N, Fd)
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_sigmoid_mul_reads_a_gate_of_heads_in_place(dtype, device):
    """Gated attention's gate: heads of D interleaved with q's in one projection's columns ([N, H, 2D], the gate
    the second half of each head), read with their strides: the bits of the same gate copied to [N, H·D]."""
    from tensorfold.kernels.silu_gate import triton_gate
    N, H, D = 3, 4, 24
    proj = randn(N, 2 * H * D + 16, dtype=dtype, seed=4, scale=4.0).to(device)
    heads = proj[:, :2 * H * D].view(N, H, 2 * D)[..., D:]
    x = randn(N, H * D, dtype=dtype, seed=5, scale=2.0).to(device)
    got = triton_gate.sigmoid_mul(x, heads)
    assert torch.equal(got, triton_gate.sigmoid_mul(x, heads.reshape(N, H * D)))
    torch.testing.assert_close(got.cpu(), naive.sigmoid_mul(x.cpu(), heads.cpu()), **TOLERANCE[dtype])


@pytest.mark.triton
def test_triton_empty(device):
    from tensorfold.kernels.silu_gate import triton_gate
    empty = torch.ones(0, 8, device=device)
    assert triton_gate.silu_mul(empty, empty, 3.0).shape == (0, 8)
    assert triton_gate.sigmoid_mul(empty, torch.ones(0, 1, device=device)).shape == (0, 8)
