"""The decode step's fused attention inputs (tensorfold_qwen.attention_inputs, in triton's interpreter on the CPU)
against the unfused kernels it replaces: the q and k heads' RMSNorm and RoPE (core's Triton rms_norm and rope,
bit for bit) and the k and v page writes; rows whose dest is -1 leave the pages as they were."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tensorfold.kernels.rope import naive as rope_naive

CUDA = torch.cuda.is_available()
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# heads, kv heads, head dim, rotary dim: tiny, and Qwen3.5's attention (16 x 256, a quarter rotating)
SHAPES = [pytest.param(4, 2, 16, 8, id="tiny"), pytest.param(16, 4, 256, 64, id="qwen3_5")]
EPS = 1e-6


@pytest.fixture
def interpreted() -> Iterator[None]:
    if CUDA:
        pytest.skip("with CUDA the device is tested")
    pytest.importorskip("triton")
    from tensorfold.testing.triton_interpreter import interpreter_fixes
    with interpreter_fixes():
        yield


def case(N: int, H: int, KV: int, D: int, R: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(N, 2 * H * D + 2 * KV * D, generator=g).to(dtype)
    q_norm, k_norm = (0.1 * torch.randn(D, generator=g)).to(dtype), (0.1 * torch.randn(D, generator=g)).to(dtype)
    positions = torch.randint(0, 200_000, (N,), generator=g)
    positions[0] = 0
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, R, 2, dtype=torch.float32) / max(R, 1)))
    dest = torch.tensor([5, -1, 0, 11, 7][:N], dtype=torch.int64)
    pages = [torch.full((3, 4, KV, D), 7.0, dtype=dtype) for _ in range(2)]
    return proj, q_norm, k_norm, positions, inv_freq, dest, pages


def unfused(proj, q_norm, k_norm, positions, inv_freq, R, H, KV, D, pages, dest):
    """The decode step's form before the fusion, with core's Triton rms_norm and rope."""
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    from tensorfold.kernels.rope import triton_rope

    N = proj.shape[0]
    q, k, v = proj.split([2 * H * D, KV * D, KV * D], dim=-1)
    q = q.reshape(N, H, 2 * D)[..., :D]
    q = triton_rmsnorm.rms_norm(q.reshape(N * H, D), q_norm, EPS, zero_centred=True).view(N, H, D)
    k = triton_rmsnorm.rms_norm(k.reshape(N * KV, D), k_norm, EPS, zero_centred=True).view(N, KV, D)
    q, k = (triton_rope.apply_rope(t, positions, inv_freq, R) for t in (q, k))
    for page, rows in zip(pages, (k, v.reshape(N, KV, D)), strict=True):
        flat = page.view(-1, KV, D)
        live = dest >= 0
        flat[dest[live]] = rows[live]
    return q


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, KV, D, R", SHAPES)
def test_the_fused_inputs_are_the_unfused_kernels_bit_for_bit(interpreted, H, KV, D, R, dtype):
    from tensorfold_qwen.attention_inputs import attention_inputs

    proj, q_norm, k_norm, positions, inv_freq, dest, pages = case(5, H, KV, D, R, dtype)
    expected_pages = [p.clone() for p in pages]
    expected = unfused(proj, q_norm, k_norm, positions, inv_freq, R, H, KV, D, expected_pages, dest)
    q = attention_inputs(proj, q_norm, k_norm, EPS, positions, inv_freq, R, H, KV, D, *pages, dest)
    assert q.shape == (5, H, D) and q.dtype == dtype
    assert torch.equal(q, expected)
    for got, want in zip(pages, expected_pages, strict=True):
        assert torch.equal(got, want)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[dest[dest >= 0]] = False
    assert (pages[0].view(12, KV, D)[untouched] == 7.0).all()          # dest -1 wrote nothing


@pytest.mark.triton
def test_the_rotation_matches_the_naive_rope_within_a_bf16_ulp(interpreted):
    """Against core's CPU rope over the unfused norm (another cos/sin than the kernel's: within one bf16 ulp)."""
    from tensorfold.kernels.rmsnorm import naive as norm_naive
    from tensorfold_qwen.attention_inputs import attention_inputs

    H, KV, D, R = 16, 4, 256, 64
    proj, q_norm, k_norm, positions, inv_freq, dest, pages = case(5, H, KV, D, R, torch.bfloat16, seed=1)
    q = attention_inputs(proj, q_norm, k_norm, EPS, positions, inv_freq, R, H, KV, D, *pages, dest)
    raw = proj[:, : 2 * H * D].reshape(5, H, 2 * D)[..., :D]
    normed = norm_naive.rms_norm(raw.reshape(5 * H, D), q_norm, EPS, zero_centred=True).view(5, H, D)
    torch.testing.assert_close(q, rope_naive.apply_rope(normed, positions, inv_freq, R), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("D", [16, 64, 128, 256, 512, 4096])
def test_the_norm_tile_is_the_rms_norm_launchs(D):
    """The sum of squares is taken in the tile core's rms_norm launch uses, so its reduction order is that kernel's
    (the GPU test holds the bits)."""
    pytest.importorskip("triton")
    from tensorfold.kernels.rmsnorm import triton_rmsnorm
    from tensorfold_qwen.attention_inputs import norm_tile

    block_n, block_d, warps, _ = triton_rmsnorm.blocks(7, D)
    assert norm_tile(D) == (block_d, block_n, warps)
