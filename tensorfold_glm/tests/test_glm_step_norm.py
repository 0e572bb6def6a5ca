"""hc.step_rms_norm, the decode step's block and MLA norms: the torch ops of hc.rms_norm where Triton does not run
(bit for bit), core's rms_norm kernel in the same order where it does (the interpreter on the CPU: within one
output ulp of the torch ops, and a row's bits the same alone or in a batch)."""

from __future__ import annotations

import pytest
import torch

import tensorfold.kernels.rmsnorm as rmsnorm_package
from tensorfold_glm import hc

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
ULP = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
EPS = 1e-5


def case(dtype: torch.dtype, rows: int = 5, width: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return (torch.randn(rows, width, generator=g) * 3).to(dtype), (torch.rand(width, generator=g) + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_triton_it_is_the_torch_norm(dtype):
    x, w = case(dtype)
    assert torch.equal(hc.step_rms_norm(x, w, EPS), hc.rms_norm(x, w, EPS))


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_with_triton_it_is_the_kernel_in_the_same_order(dtype, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(hc, "use_triton", lambda tensor: True)
    monkeypatch.setattr(rmsnorm_package, "use_triton", lambda tensor: True)
    x, w = case(dtype)
    got = hc.step_rms_norm(x, w, EPS)
    assert got.dtype == dtype
    torch.testing.assert_close(got, hc.rms_norm(x, w, EPS), rtol=ULP[dtype], atol=ULP[dtype])
    assert torch.equal(hc.step_rms_norm(x[2:3], w, EPS), got[2:3])
