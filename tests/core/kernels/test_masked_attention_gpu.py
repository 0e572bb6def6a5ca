"""Masked attention's Triton kernel on a CUDA device, at the published GLM-5.3-Flash widths (64 heads, qk and v
head 256, a 2048-row chunk at key 8192) and at 192/128 and the tiny widths: against a float64 reference on sampled
rows, and the exactness contract (a row's bits do not depend on the call). Skipped without CUDA; run in device
sessions (`pytest -m gpu`); `-s` prints what each test measured.
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels import masked_attention as public
from tensorfold.kernels.masked_attention import naive
from tensorfold.testing.cuda_graphs import without_host_sync

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DIMS = {"published": (64, 256, 256), "qk192-v128": (16, 192, 128), "tiny": (4, 16, 16)}   # heads, DQ, DV
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2}       # |kernel - float64|, unit-scale q, k, v
EMPTY, LATE, ONE = 3, 7, 11                                # rows that select nothing, late keys only, one key
LATE_FROM = 1000


def case(dims: tuple[int, int, int], dtype: torch.dtype, T: int, S: int, seed: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, DQ], k [S, H, DQ] and v [S, H, DV] (views of one [S, H, DQ + DV] tensor, as GLM's kv_b gives them)
    and a causal selection [T, S] (the rows end at key S - 1) keeping about a third of the keys; row EMPTY selects
    nothing, row LATE only keys from LATE_FROM on, row ONE only its own key."""
    H, DQ, DV = dims
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, DQ, generator=g, device="cuda").to(dtype)
    k, v = torch.randn(S, H, DQ + DV, generator=g, device="cuda").to(dtype).split([DQ, DV], dim=-1)
    keys = torch.arange(S, device="cuda")
    causal = keys <= torch.arange(S - T, S, device="cuda")[:, None]
    mask = (torch.rand(T, S, generator=g, device="cuda") < 0.35) & causal
    mask[:, 0] = True
    mask[EMPTY] = False
    mask[LATE, :LATE_FROM] = False
    mask[LATE, S - T + LATE] = True
    mask[ONE] = keys == S - T + ONE
    return q, k, v, mask


def sizes(dims: tuple[int, int, int]) -> tuple[int, int]:
    """(T, S): a 2048-row chunk at key 8192 at the published widths, smaller elsewhere."""
    return (2048, 8192) if dims[0] == 64 else (300, 1300)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("dims", DIMS.values(), ids=DIMS.keys())
def test_kernel_matches_float64(dims, dtype):
    T, S = sizes(dims)
    q, k, v, mask = case(dims, dtype, T, S)
    out = public.masked_attention(q, k, v, mask)
    rows = torch.tensor([0, EMPTY, LATE, ONE, T // 2, T - 1] + list(range(64, T, T // 24)), device="cuda")
    ref = naive.masked_attention(q[rows].double(), k.double(), v.double(), mask[rows], dims[1] ** -0.5)
    err = float((out[rows].double() - ref).abs().max())
    print(f"\n[masked_attention {dims} {dtype}] max |kernel - f64| over {len(rows)} rows {err:.2e}")
    assert out.shape == (T, dims[0], dims[2]) and out.dtype == dtype and torch.isfinite(out).all()
    assert torch.equal(out[EMPTY], torch.zeros_like(out[EMPTY]))
    assert err <= BOUND[dtype]
    one = (out[ONE].double() - v[S - T + ONE].double()).abs().max()
    assert one <= BOUND[dtype], f"a one-key row is its value (exactly, if exp2(0) is 1): off by {one}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("dims", DIMS.values(), ids=DIMS.keys())
def test_a_rows_bits_do_not_depend_on_the_call(dims, dtype):
    T, S = sizes(dims)
    q, k, v, mask = case(dims, dtype, T, S, seed=1)
    whole = public.masked_attention(q, k, v, mask)
    for r in (0, EMPTY, LATE, ONE, 150, T // 2 + 1, T - 1):
        keys = S - T + r + 1                                  # the row's causal keys only: a call with fewer S
        alone = public.masked_attention(q[r: r + 1], k[:keys], v[:keys], mask[r: r + 1, :keys])
        assert torch.equal(alone, whole[r: r + 1]), f"row {r} alone differs by {(alone - whole[r]).abs().max()}"
    for a, b in ((0, 1), (5, 70), (64, 128), (131, 300), (T - 333, T)):
        keys = S - T + b                                      # a chunk ending at its last row's key
        part = public.masked_attention(q[a:b], k[:keys], v[:keys], mask[a:b, :keys])
        assert torch.equal(part, whole[a:b]), (a, b)
    more = 301                                                # keys past every row's, unselected
    H, DQ, DV = dims
    kv = torch.randn(S + more, H, DQ + DV, device="cuda").to(dtype)
    kv[:S] = torch.cat([k, v], dim=-1)
    k2, v2 = kv.split([DQ, DV], dim=-1)
    wide = torch.nn.functional.pad(mask, (0, more))
    assert torch.equal(public.masked_attention(q, k2, v2, wide), whole)


def test_the_scores_never_reach_memory_and_no_sync():
    H, DQ, DV, T, S = 64, 256, 256, 2048, 8192
    q, k, v, mask = case((H, DQ, DV), torch.bfloat16, T, S, seed=2)
    public.masked_attention(q, k, v, mask)                    # warm: the first call compiles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    without_host_sync(lambda: public.masked_attention(q, k, v, mask))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    scores = H * T * S * 4
    print(f"\n[masked_attention memory] peak {peak / 2**20:.0f} MiB past the inputs; "
          f"f32 scores {scores / 2**20:.0f} MiB")
    assert peak < scores // 16
