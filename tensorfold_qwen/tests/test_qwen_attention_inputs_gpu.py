"""The fused attention inputs on a CUDA device against the unfused kernels (core's Triton rms_norm and rope, the
row writes), bit for bit, at the tiny and Qwen3.5's attention widths; and no host sync. Skipped without CUDA; run
in device sessions (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from test_qwen_attention_inputs import DTYPES, EPS, SHAPES, case, unfused

from tensorfold.testing.cuda_graphs import without_host_sync

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("N", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, KV, D, R", SHAPES)
def test_the_fused_inputs_are_the_unfused_kernels_bit_for_bit_on_cuda(H, KV, D, R, dtype, N):
    from tensorfold_qwen.attention_inputs import attention_inputs

    on = [t.cuda() if isinstance(t, torch.Tensor) else [p.cuda() for p in t]
          for t in case(N, H, KV, D, R, dtype, seed=N)]
    proj, q_norm, k_norm, positions, inv_freq, dest, pages = on
    expected_pages = [p.clone() for p in pages]
    expected = unfused(proj, q_norm, k_norm, positions, inv_freq, R, H, KV, D, expected_pages, dest)
    warm = [p.clone() for p in pages]
    attention_inputs(proj, q_norm, k_norm, EPS, positions, inv_freq, R, H, KV, D, *warm, dest)   # compiles
    q = without_host_sync(lambda: attention_inputs(proj, q_norm, k_norm, EPS, positions, inv_freq, R, H, KV, D,
                                                   *pages, dest))
    differ = int((q != expected).sum())
    print(f"\n[attention inputs {H}x{D} {dtype} N={N}] q elements differing from the unfused kernels: {differ}")
    assert differ == 0
    for got, want in zip(pages, expected_pages, strict=True):
        assert torch.equal(got, want)
