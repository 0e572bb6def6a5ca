"""Programmatic dependent launch (kernels/pdl.py): which launches take it, and on a CUDA device that a chain of
decode kernels gives the same bits with it on and off, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels import pdl


def test_options_are_empty_off_cuda_and_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl.options(torch.zeros(1)) == {}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.options(torch.zeros(1)) == {}


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """rms_norm, silu_mul, rms_norm with a residual, sigmoid_mul: four launches, each reading the last one's output."""
    from tensorfold.kernels.rmsnorm.triton_rmsnorm import rms_norm
    from tensorfold.kernels.silu_gate.triton_gate import sigmoid_mul, silu_mul
    h = rms_norm(x, w, 1e-6, zero_centred=True)
    g = silu_mul(h, x)
    y, s = rms_norm(g, w, 1e-6, zero_centred=False, residual=h)
    return sigmoid_mul(y, s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chain_gives_the_same_bits_with_pdl_on_and_off(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch.cuda.get_device_capability() < (9, 0) or pdl.options(torch.zeros(1, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 4096, generator=g, device="cuda").to(dtype)
    w = torch.randn(4096, generator=g, device="cuda").to(dtype)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", on)
        eager = chain(x, w)
        chain(x, w)                                                     # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain(x, w)
        graph.replay()
        torch.cuda.synchronize()
        runs[on] = (eager, captured.clone())
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])
    assert torch.equal(runs[True][0], runs[True][1])
