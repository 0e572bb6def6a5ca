"""hc_fused's Triton kernels (mHC on CUDA) against hc.py's torch form, called directly: in triton's interpreter on
the CPU (conftest chooses it), on the GPU where there is one. `post` is hc_post bit for bit; the coefficients are
within 1e-6 of hc_coefficients (relative for pre and post, absolute for comb, whose entries lie in [0, 1], and 4e-6
relative for it); the block input is bitwise the torch collapse of the kernel's own pre, and within one ulp (plus
what pre's difference can move) of the torch path's; a row alone gives the bits it gives inside a batch. The
tests print what they measure; docs/families/glm.md ("Fused mHC") says where the differences come from.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tensorfold_glm import hc
from tensorfold_glm.hc import HcWeights, collapse, hc_coefficients, hc_mixes, hc_post, hc_pre, spread

pytest.importorskip("triton")
from tensorfold_glm import hc_fused  # noqa: E402  (after the skip: triton is the gpu extra)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HC_EPS = 1e-6
PRE_POST_RTOL = 1e-6
COMB_ATOL, COMB_RTOL = 1e-6, 4e-6
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
MANTISSA = {torch.float32: 23, torch.bfloat16: 7}


def weights(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, HcWeights]:
    """base [M] and scale [3] float32 on DEVICE, and the HcWeights the torch form reads them from (fn unused)."""
    g = torch.Generator().manual_seed(seed)
    n = (2 + m) * m
    base, scale = torch.randn(n, generator=g), torch.rand(3, generator=g) + 0.5
    base, scale = base.to(DEVICE), scale.to(DEVICE)
    return base, scale, HcWeights(fn=torch.zeros(n, 1, device=DEVICE), base=base, scale=scale)


def mixes_for(m: int, t: int, seed: int) -> torch.Tensor:
    """Raw mixes [T, (2 + m)·m] float32, spread like a real GEMM's (a few units)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, (2 + m) * m, generator=g) * 2).to(DEVICE)


def draw(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values in dtype on DEVICE."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of dtype's values at |x| (float32; the smallest normal's below it)."""
    _, exponent = torch.frexp(x.float().abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 1 - MANTISSA[dtype])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / |b|."""
    return ((a - b).abs() / b.abs()).max().item() if a.numel() else 0.0


@pytest.mark.parametrize("iters", [1, 3, 20])
@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_coefficients_within_the_bound(m, t, iters):
    base, scale, w = weights(m, seed=m)
    mixes = mixes_for(m, t, seed=100 + t)
    pre, post, comb = hc_fused.coefficients(mixes, base, scale, m, iters, HC_EPS)
    ref_pre, ref_post, ref_comb = hc_coefficients(w, mixes, iters, HC_EPS)
    assert pre.shape == ref_pre.shape == post.shape == (t, m) and comb.shape == ref_comb.shape == (t, m, m)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    measured = relative(pre, ref_pre), relative(post, ref_post), (comb - ref_comb).abs().max().item()
    print(f"\nm={m} T={t} iters={iters}: pre {measured[0]:.2e} post {measured[1]:.2e} (rel), "
          f"comb {measured[2]:.2e} (abs) {relative(comb, ref_comb):.2e} (rel)")
    assert measured[0] <= PRE_POST_RTOL and measured[1] <= PRE_POST_RTOL
    assert measured[2] <= COMB_ATOL and relative(comb, ref_comb) <= COMB_RTOL
    if m == 1:                                       # a 1 × 1 softmax is 1: comb has no rounding to differ in
        assert torch.equal(comb, ref_comb)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("e", [64, 100])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_block_input_is_the_collapse_of_its_coefficients(m, e, t, dtype):
    base, scale, w = weights(m, seed=m)
    mixes, streams = mixes_for(m, t, seed=200 + t), draw((t, m, e), dtype, seed=300 + e)
    x, post, comb = hc_fused.coefficients_and_collapse(mixes, base, scale, streams, 20, HC_EPS)
    pre, post_alone, comb_alone = hc_fused.coefficients(mixes, base, scale, m, 20, HC_EPS)
    assert torch.equal(post, post_alone) and torch.equal(comb, comb_alone)
    assert x.shape == (t, e) and x.dtype == dtype
    assert torch.equal(x, collapse(pre, streams))                   # the kernel's pre, torch's collapse: same bits
    ref_pre = hc_coefficients(w, mixes, 20, HC_EPS)[0]
    ref = collapse(ref_pre, streams)                                # the torch path's block input
    same = (pre == ref_pre).all(dim=1)
    assert torch.equal(x[same], ref[same])
    scale_of_sum = (ref_pre[:, :, None] * streams.float().abs()).sum(dim=1)
    bound = ulp(ref, dtype) + 8 * 2.0 ** -23 * scale_of_sum         # one ulp, plus what pre's last bits can move
    assert ((x.float() - ref.float()).abs() <= bound).all()
    worst = ((x.float() - ref.float()).abs() / bound).max().item()
    print(f"\nm={m} E={e} T={t} {dtype}: rows with pre equal {int(same.sum())}/{t}, max |Δx| {worst:.2f} of the bound")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("e", [64, 100])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_post_is_hc_post_bit_for_bit(m, e, t, dtype):
    _, _, w = weights(m, seed=m)
    _, post, comb = hc_coefficients(w, mixes_for(m, t, seed=400 + t), 3, HC_EPS)
    streams, block_out = draw((t, m, e), dtype, seed=500 + e), draw((t, e), dtype, seed=600 + e)
    new = hc_fused.post(block_out, streams, post, comb)
    assert new.shape == (t, m, e) and new.dtype == dtype
    assert torch.equal(new, spread(block_out, streams, post, comb))


def test_post_casts_a_float32_block_output_as_hc_post_does():
    """block_out in float32 with bf16 streams: rounded to bf16 (nearest even) before post · out, as `.to(dtype)`."""
    _, _, w = weights(4, seed=4)
    _, post, comb = hc_coefficients(w, mixes_for(4, 9, seed=7), 20, HC_EPS)
    streams, block_out = draw((9, 4, 100), torch.bfloat16, seed=8), draw((9, 100), torch.float32, seed=9)
    assert torch.equal(hc_fused.post(block_out, streams, post, comb), spread(block_out, streams, post, comb))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("m", [3, 4])
def test_a_row_alone_gives_its_bits_in_a_batch(m, dtype):
    """33 rows span three coefficient programs (16 rows each): each row alone gives the batch's bits."""
    base, scale, _ = weights(m, seed=m)
    mixes, streams = mixes_for(m, 33, seed=11), draw((33, m, 100), dtype, seed=12)
    block_out = draw((33, 100), dtype, seed=13)
    pre, post, comb = hc_fused.coefficients(mixes, base, scale, m, 20, HC_EPS)
    x = hc_fused.collapse(pre, streams)
    new = hc_fused.post(block_out, streams, post, comb)
    again = hc_fused.coefficients(mixes, base, scale, m, 20, HC_EPS)
    assert all(torch.equal(a, b) for a, b in zip(again, (pre, post, comb), strict=True))
    for row in (0, 15, 16, 32):
        one = slice(row, row + 1)
        alone = hc_fused.coefficients(mixes[one], base, scale, m, 20, HC_EPS)
        assert all(torch.equal(a, b[one]) for a, b in zip(alone, (pre, post, comb), strict=True))
        assert torch.equal(hc_fused.collapse(pre[one], streams[one]), x[one])
        assert torch.equal(hc_fused.post(block_out[one], streams[one], post[one], comb[one]), new[one])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_e_blocks_split_a_row_without_changing_its_bits(monkeypatch, dtype):
    """E = 100 in blocks of 32 (the last one partial): the bits of one block of 128, and hc_post's."""
    base, scale, _ = weights(3, seed=3)
    mixes, streams = mixes_for(3, 5, seed=14), draw((5, 3, 100), dtype, seed=15)
    block_out = draw((5, 100), dtype, seed=16)
    pre, post, comb = hc_fused.coefficients(mixes, base, scale, 3, 20, HC_EPS)
    whole = hc_fused.collapse(pre, streams), hc_fused.post(block_out, streams, post, comb)
    monkeypatch.setattr(hc_fused, "MAX_BLOCK_E", 32)
    assert hc_fused._block_e(100, 4) == 32
    split = hc_fused.collapse(pre, streams), hc_fused.post(block_out, streams, post, comb)
    assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])
    assert torch.equal(split[0], collapse(pre, streams))
    assert torch.equal(split[1], spread(block_out, streams, post, comb))


@pytest.mark.parametrize("m", [4, 9])
def test_hc_pre_and_hc_post_run_the_kernels_where_triton_runs(monkeypatch, m):
    """With use_triton true (CUDA), hc_pre and hc_post are the kernels' results; above MAX_STREAMS, the torch form."""
    monkeypatch.setattr(hc, "use_triton", lambda tensor: True)
    calls = []

    def spy(name: str) -> Callable[..., object]:
        kernel = getattr(hc_fused, name)

        def call(*args: object) -> object:
            calls.append(name)
            return kernel(*args)
        return call

    for name in ("coefficients_and_collapse", "post"):
        monkeypatch.setattr(hc_fused, name, spy(name))
    g = torch.Generator().manual_seed(17)
    base, scale, _ = weights(m, seed=m)
    w = HcWeights(fn=torch.randn((2 + m) * m, m * 100, generator=g).to(DEVICE), base=base, scale=scale)
    streams, block_out = draw((5, m, 100), torch.bfloat16, seed=18), draw((5, 100), torch.bfloat16, seed=19)
    x, post, comb = hc_pre(w, streams, 1e-6, 20, HC_EPS)
    new = hc_post(block_out, streams, post, comb)
    assert calls == (["coefficients_and_collapse", "post"] if m <= hc_fused.MAX_STREAMS else [])
    mixes = hc_mixes(w, streams, 1e-6)
    if m <= hc_fused.MAX_STREAMS:
        want = hc_fused.coefficients_and_collapse(mixes, base, scale, streams, 20, HC_EPS)
    else:
        pre, *rest = hc_coefficients(w, mixes, 20, HC_EPS)
        want = (collapse(pre, streams), *rest)
    assert all(torch.equal(a, b) for a, b in zip((x, post, comb), want, strict=True))
    assert torch.equal(new, spread(block_out, streams, post, comb))


def test_no_rows_give_empty_results():
    base, scale, _ = weights(4, seed=4)
    streams = torch.empty(0, 4, 64, device=DEVICE)
    x, post, comb = hc_fused.coefficients_and_collapse(torch.empty(0, 24, device=DEVICE), base, scale, streams, 3,
                                                       HC_EPS)
    assert x.shape == (0, 64) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert hc_fused.post(torch.empty(0, 64, device=DEVICE), streams, post, comb).shape == (0, 4, 64)


def test_refuses_what_the_kernels_were_not_written_for():
    base, scale, _ = weights(9, seed=9)
    with pytest.raises(ValueError, match="hc_mult must be 1..8, got 9"):
        hc_fused.coefficients(mixes_for(9, 2, seed=1), base, scale, 9, 3, HC_EPS)
    base, scale, _ = weights(4, seed=4)
    with pytest.raises(ValueError, match=r"mixes must be float32 \[T, 24\]"):
        hc_fused.coefficients(mixes_for(3, 2, seed=1), base, scale, 4, 3, HC_EPS)
    streams = torch.zeros(2, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="post: want block_out"):
        hc_fused.post(torch.zeros(2, 63, device=DEVICE), streams, torch.zeros(2, 4, device=DEVICE),
                      torch.zeros(2, 4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="collapse: streams must be"):
        hc_fused.collapse(torch.zeros(2, 3, device=DEVICE), streams)
