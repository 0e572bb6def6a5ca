"""rope: the naive path against tensorfold_qwen's `layers.rope_tables` + `layers.apply_rope` (bitwise), the
Triton kernel against the naive path (reference always computed on the CPU).

Tolerances, Triton vs naive: float32 rtol = atol = 1e-5 (cos/sin of angles up to ~10^6 rad from another libm);
bfloat16 rtol = atol = 2^-7, one bf16 ulp at unit scale (cos and sin are rounded to bf16 before use, as in the
reference, so the two differ only where another libm's cos lands on the other side of a bf16 rounding edge).
The non-rotary dims are copies: exact.
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels.rope import apply_rope, naive

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 2**-7}}
# (H, D, R): full rotary, partial (Qwen3.5: a quarter of 256), R/2 not a power of two, nothing rotating
SHAPES = [pytest.param(3, 16, 16, id="H3-D16-R16"), pytest.param(16, 256, 64, id="H16-D256-R64"),
          pytest.param(5, 40, 24, id="H5-D40-R24"), pytest.param(2, 10, 0, id="H2-D10-R0")]


def inv_freq(rotary_dim: int, theta: float = 1e7) -> torch.Tensor:
    """Float32 [R/2] frequencies as the qwen family computes them."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float32)
    return 1.0 / (theta ** (steps / rotary_dim))


def inputs(N: int, H: int, D: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H, D] and absolute positions [N] (0, then up to 10^6)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, D, generator=generator).to(dtype)
    positions = torch.randint(0, 1_000_000, (N,), generator=generator)
    positions[0] = 0
    return x, positions


# ---- naive (no triton needed) -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, D, R", SHAPES[:3])
def test_naive_matches_qwen_reference(H, D, R, dtype):
    layers = pytest.importorskip("tensorfold_qwen.layers")
    x, positions = inputs(7, H, D, dtype)
    frequencies = layers.inverse_frequencies(R, 1e7, torch.device("cpu"))
    cos, sin = layers.rope_tables(positions, frequencies, dtype)
    out = naive.apply_rope(x, positions, frequencies, R)
    assert out.dtype == dtype and torch.equal(out, layers.apply_rope(x, cos, sin))
    assert torch.equal(out[..., R:], x[..., R:])


def test_naive_position_zero_and_no_rotary_are_identity():
    x, positions = inputs(4, 2, 10, torch.float32)
    assert torch.equal(naive.apply_rope(x, positions, inv_freq(0), 0), x)
    out = naive.apply_rope(x, torch.zeros(4, dtype=torch.long), inv_freq(8), 8)
    assert torch.equal(out, x)


def test_empty_rows():
    assert apply_rope(torch.ones(0, 2, 8), torch.zeros(0, dtype=torch.long), inv_freq(4), 4).shape == (0, 2, 8)


@pytest.mark.parametrize("kwargs, match", [
    pytest.param({"rotary_dim": 3}, "rotary_dim must be", id="odd-R"),
    pytest.param({"rotary_dim": 12}, "rotary_dim must be", id="R-over-D"),
    pytest.param({"positions": torch.zeros(3)}, "positions must be", id="float-positions"),
    pytest.param({"positions": torch.zeros(2, dtype=torch.long)}, "positions must be", id="positions-length"),
    pytest.param({"inv_freq": torch.ones(3)}, "inv_freq must be", id="inv-freq-length"),
    pytest.param({"x": torch.ones(3, 8)}, "x must be", id="x-2d"),
])
def test_rejects_bad_arguments(kwargs, match):
    args = {"x": torch.ones(3, 2, 8), "positions": torch.zeros(3, dtype=torch.long), "inv_freq": inv_freq(4),
            "rotary_dim": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        apply_rope(**args)


# ---- triton (GPU, or the interpreter on the CPU) ------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, D, R", SHAPES)
@pytest.mark.parametrize("N", [1, 9], ids=lambda n: f"N{n}")
def test_triton_matches_naive(N, H, D, R, dtype, device):
    from tensorfold.kernels.rope import triton_rope
    x, positions = inputs(N, H, D, dtype)
    frequencies = inv_freq(R)
    expected = naive.apply_rope(x, positions, frequencies, R)
    got = triton_rope.apply_rope(x.to(device), positions.to(device), frequencies.to(device), R)
    assert got.dtype == dtype and got.shape == (N, H, D)
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])
    assert torch.equal(got.cpu()[..., R:], x[..., R:])


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_strided_heads_and_int32_positions(dtype, device):
    """q cut from a [N, H, 2D] projection (head stride 2D), positions as int32."""
    from tensorfold.kernels.rope import triton_rope
    wide, positions = inputs(5, 3, 2 * 32, dtype)
    q = wide[..., :32]
    expected = naive.apply_rope(q, positions, inv_freq(16), 16)
    got = triton_rope.apply_rope(wide.to(device)[..., :32], positions.int().to(device), inv_freq(16).to(device), 16)
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.triton
def test_triton_empty(device):
    from tensorfold.kernels.rope import triton_rope
    x = torch.ones(0, 2, 8, device=device)
    got = triton_rope.apply_rope(x, torch.zeros(0, dtype=torch.long, device=device), inv_freq(4).to(device), 4)
    assert got.shape == (0, 2, 8)
