"""ssd_step_gated: the Mamba2 decode step with the family's glue fused in (the time step from the raw dt, the D skip).

CPU: naive is bitwise the family's torch expressions (copied below from tensorfold_nemotron: mamba.time_steps, the
ssd_step call, the D skip in decode.mamba2), fp32 and bf16; the public function dispatches and validates. triton (the
interpreter on the CPU): against naive within FP32_REL (fp32: y_skip and state) and 1e-2 relative (bf16 y_skip, one
ulp of the rounded y); the kernel's dt' read back exactly (A = 0, unit B and C) against torch's softplus: equal
above the threshold 20 and at the clamp bounds, within 1e-6 relative elsewhere; padded rows touch no state.
GPU (marked gpu): the same at Nemotron-H 8B's decode shape (H 128, P 64, G 8, N 128), batch 1 and 8.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_ssd import FP32_REL, kept, relative, ssd_rows

from tensorfold.kernels import ssd
from tensorfold.kernels.ssd import naive

CUDA = torch.cuda.is_available()
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
LIMITS = [pytest.param((0.0, math.inf), id="hf-default"), pytest.param((1e-3, 0.1), id="clamped")]
BF16_REL = 1e-2             # y is rounded to bf16 before the skip: one ulp of it, relative to max |y_skip|
SOFTPLUS_REL = 1e-6         # the kernel's log1p(exp(v)) against torch's (measured in the interpreter: <= 2 ulps)


def gated_inputs(Bt: int, H: int, P: int, G: int, N: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x, raw dt [Bt, H] (model dtype, spread across softplus's range incl. > 20), dt_bias [H], A, D [H], B, C."""
    x, _, A, B, C = ssd_rows(Bt, H, P, G, N, device, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    raw = torch.randn(Bt, H, generator=gen) * 6
    raw.view(-1)[:4] = torch.tensor([25.0, 19.9, -30.0, 0.0])[: raw.numel()]
    dt_bias = torch.randn(H, generator=gen) * 2 - 3
    D = torch.randn(H, generator=gen)
    return (x, raw.to(device, dtype), dt_bias.to(device, dtype), A, D.to(device, dtype), B, C)


def family(x, raw, dt_bias, A, D, B, C, states, slots, low, high):
    """tensorfold_nemotron's decode glue as written there (mamba.time_steps; decode.mamba2's step and D skip)."""
    dt = F.softplus(raw.float() + dt_bias.float()).clamp(min=low, max=high)
    y = ssd.ssd_step(x, dt, A, B, C, states, slots)
    return y.float() + D.float()[:, None] * x.float()


# ---------------------------------------------------------------- naive


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_is_the_family_code_bitwise(dtype, limits):
    low, high = limits
    args = gated_inputs(3, 8, 16, 2, 32, dtype=dtype, seed=1)
    states = kept(5, 8, 16, 32)
    ref_pool, pool = states.clone(), states.clone()
    slots = torch.tensor([4, 0, 2])
    ref = family(*args, ref_pool, slots, low, high)
    out = naive.ssd_step_gated(*args, pool, slots, dt_min=low, dt_max=high)
    assert out.dtype == torch.float32 and out.shape == (3, 8, 16)
    assert torch.equal(out, ref) and torch.equal(pool, ref_pool)
    public_pool = states.clone()
    public = ssd.ssd_step_gated(*args, public_pool, slots, dt_min=low, dt_max=high)
    assert torch.equal(public, ref) and torch.equal(public_pool, ref_pool)


def test_naive_float32_dt_bias_and_padded_rows():
    """dt_bias in float32 (the other form the family keeps it in); a padded row gives D·x and touches no state."""
    x, raw, dt_bias, A, D, B, C = gated_inputs(3, 4, 8, 2, 16, dtype=torch.bfloat16, seed=2)
    states = kept(3, 4, 8, 16)
    ref_pool, pool = states.clone(), states.clone()
    slots = torch.tensor([-1, 1, -1])
    ref = family(x, raw, dt_bias.float(), A, D, B, C, ref_pool, slots, 0.0, math.inf)
    out = naive.ssd_step_gated(x, raw, dt_bias.float(), A, D, B, C, pool, slots, dt_min=0.0, dt_max=math.inf)
    assert torch.equal(out, ref) and torch.equal(pool, ref_pool)
    assert torch.equal(out[[0, 2]], D.float()[:, None] * x[[0, 2]].float())
    assert torch.equal(pool[[0, 2]], states[[0, 2]])


@pytest.mark.parametrize("mistake", ["dt_bias", "D", "dt_shape", "A_dtype"])
def test_refuses_bad_inputs(mistake):
    x, raw, dt_bias, A, D, B, C = gated_inputs(2, 4, 8, 2, 16, seed=3)
    bad = {"dt_bias": dict(dt_bias=dt_bias[:3]), "D": dict(D=D[None]), "dt_shape": dict(dt=raw[:, :3]),
           "A_dtype": dict(A=A.double())}[mistake]
    kwargs = dict(x=x, dt=raw, dt_bias=dt_bias, A=A, D=D, B=B, C=C, states=kept(2, 4, 8, 16), slots=[0, 1])
    kwargs.update(bad)
    with pytest.raises(ValueError):
        ssd.ssd_step_gated(**kwargs, dt_min=0.0, dt_max=math.inf)


# ---------------------------------------------------------------- triton (the interpreter on the CPU)


def _triton(*args, **kwargs):
    from tensorfold.kernels.ssd import triton_step
    return triton_step.ssd_step_gated(*args, **kwargs)


@pytest.mark.triton
@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("shape", [(4, 8, 2, 16), (8, 16, 8, 32), (2, 24, 1, 40)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_naive(device, dtype, shape, limits):
    H, P, G, N = shape
    low, high = limits
    args = gated_inputs(3, H, P, G, N, device, dtype, seed=4)
    states = kept(5, H, P, N, device)
    ref_pool, pool = states.clone(), states.clone()
    slots = torch.tensor([4, -1, 2], device=device)
    ref = naive.ssd_step_gated(*args, ref_pool, slots, dt_min=low, dt_max=high)
    out = _triton(*args, pool, slots, dt_min=low, dt_max=high)
    assert out.dtype == torch.float32 and out.shape == (3, H, P)
    assert relative(pool, ref_pool) < FP32_REL
    assert relative(out, ref) < (FP32_REL if dtype == torch.float32 else BF16_REL)
    assert torch.equal(pool[[0, 1, 3]], states[[0, 1, 3]])                        # padded row 1, other slots
    assert torch.equal(out[1], ref[1])                                             # padded: D·x, y zero


@pytest.mark.triton
@pytest.mark.parametrize("limits", LIMITS)
def test_triton_time_step_is_torchs_softplus(device, limits):
    """With A = 0, zero states, x = 1, D = 0 and B = C = e_0, y_skip[:, h, :] is the kernel's dt' exactly."""
    low, high = limits
    v = torch.tensor([-40.0, -20.0, -5.0, -0.5, 0.0, 1e-4, 0.7, 3.0, 9.0, 19.99, 20.0, 20.01, 35.0, 90.0, -1e-3,
                      1e-3])
    H, P, N = v.numel(), 16, 16
    raw, bias = (v - 0.25).reshape(1, H), torch.full((H,), 0.25)
    x = torch.ones(1, H, P)
    B = torch.zeros(1, 1, N)
    B[..., 0] = 1.0
    states = torch.zeros(1, H, P, N, device=device)
    out = _triton(x.to(device), raw.to(device), bias.to(device), torch.zeros(H, device=device),
                  torch.zeros(H, device=device), B.to(device), B.clone().to(device), states, [0],
                  dt_min=low, dt_max=high).cpu()
    got = out[0, :, 0]
    assert torch.equal(out[0], got[:, None].expand(H, P))
    want = F.softplus(raw.float() + bias.float()).clamp(min=low, max=high)[0]
    exact = (raw[0] + bias > 20) | (want == low) | (want == high)
    assert torch.equal(got[exact], want[exact])
    assert ((got - want).abs() <= SOFTPLUS_REL * want.abs()).all(), (got - want).abs().max()


# ---------------------------------------------------------------- GPU: Nemotron-H 8B's decode shape

NEMOTRON_8B = dict(H=128, P=64, G=8, N=128)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("Bt", [1, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_nemotron_8b_shape(Bt, dtype):
    """Fused triton vs naive (on the GPU) and vs the unfused triton path (time step, ssd_step, skip in torch);
    a padded row at batch 8; the other slots untouched."""
    H, P, G, N = NEMOTRON_8B.values()
    args = gated_inputs(Bt, H, P, G, N, "cuda", dtype, seed=5)
    states = kept(Bt + 2, H, P, N, "cuda")
    slots = torch.arange(Bt, device="cuda") + 1
    if Bt > 1:
        slots[3] = -1
    pools = [states.clone() for _ in range(3)]
    ref = naive.ssd_step_gated(*args, pools[0], slots, dt_min=0.0, dt_max=math.inf)
    out = ssd.ssd_step_gated(*args, pools[1], slots, dt_min=0.0, dt_max=math.inf)
    x, raw, dt_bias, A, D, B, C = args
    unfused = naive.d_skip(ssd.ssd_step(x, naive.time_steps(raw, dt_bias, 0.0, math.inf), A, B, C, pools[2], slots,
                                        backend="triton"), D, x)
    assert out.dtype == torch.float32 and out.shape == (Bt, H, P)
    rel = FP32_REL if dtype == torch.float32 else BF16_REL
    assert relative(out, ref) < rel and relative(pools[1], pools[0]) < FP32_REL
    assert relative(out, unfused) < rel and relative(pools[1], pools[2]) < FP32_REL
    untouched = [0, Bt + 1] + ([4] if Bt > 1 else [])                              # slot 4 was row 3's
    assert torch.equal(pools[1][untouched], states[untouched])
    print(f"SSD-GATED Bt={Bt} {dtype}: vs naive {relative(out, ref):.3g} (state {relative(pools[1], pools[0]):.3g});"
          f" vs unfused triton {relative(out, unfused):.3g}, bitwise y {torch.equal(out, unfused)},"
          f" state {torch.equal(pools[1], pools[2])}")
