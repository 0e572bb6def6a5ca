"""Masked attention (tensorfold.kernels.masked_attention): the naive path and the Triton kernel (in triton's
interpreter on the CPU, small shapes) against a float64 reference, and the kernel's exactness contract: a row's bits
depend only on its q, its mask row and its keys, not on the rows around it nor on where the call's keys end.

Bounds against float64 (q, k, v ~ N(0, 1), scale DQ^-0.5): fp32 1e-5 abs; bf16 2e-2 abs (q, k, v are exact bf16
values; the kernel rounds the probabilities to bf16 for the value dot, the interpreter by truncation, and the
output once). Most tests run the kernel at small tiles (TILES: 16 rows x 32 keys) so a call spans several row and
key blocks; one runs the shipped tiles.
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels import masked_attention as public
from tensorfold.kernels.masked_attention import naive

pytestmark = pytest.mark.usefixtures("interpreter_fixes")  # conftest: triton 3.6 interpreter bugs

BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TILES = (16, 32, 4, 2)                                     # BLOCK_M, BLOCK_N, warps, stages
EMPTY, LATE, ONE = 3, 7, 11                                # rows that select nothing, late keys only, one key
LATE_FROM = 40                                             # row LATE's first key: its first key blocks are all masked


def case(T: int, S: int, H: int = 2, DQ: int = 16, DV: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, DQ], k [S, H, DQ] and v [S, H, DV] (views split from one [S, H, DQ + DV] tensor) and a causal
    selection [T, S] (the rows end at key S - 1) keeping about a third of the keys and key 0; when T and S leave
    room, row EMPTY selects nothing, row LATE only keys from LATE_FROM on, row ONE only its own key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, DQ, generator=g).to(dtype)
    k, v = torch.randn(S, H, DQ + DV, generator=g).to(dtype).split([DQ, DV], dim=-1)
    position = torch.arange(S - T, S)[:, None]
    mask = (torch.rand(T, S, generator=g) < 0.35) & (torch.arange(S) <= position)
    mask[:, 0] = True
    if T <= ONE or S - T + LATE < LATE_FROM:
        return q, k, v, mask
    mask[EMPTY] = False
    mask[LATE, :LATE_FROM] = False
    mask[LATE, S - T + LATE] = True
    mask[ONE] = torch.arange(S) == S - T + ONE
    return q, k, v, mask


def kernel(q, k, v, mask, tiles=TILES, skip_empty=True):
    from tensorfold.kernels.masked_attention import triton_prefill
    return triton_prefill.masked_attention(q, k, v, mask, q.shape[-1] ** -0.5, tiles, skip_empty)


def exact(q, k, v, mask) -> torch.Tensor:
    return naive.masked_attention(q.double(), k.double(), v.double(), mask, q.shape[-1] ** -0.5)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("dims", [(2, 16, 16), (1, 192, 128), (1, 256, 256)], ids=["16", "192-128", "256"])
def test_kernel_and_naive_match_float64(dims, dtype):
    H, DQ, DV = dims
    q, k, v, mask = case(40, 100, H, DQ, DV, dtype)
    ref = exact(q, k, v, mask)
    for out in (kernel(q, k, v, mask), naive.masked_attention(q, k, v, mask, DQ ** -0.5)):
        assert out.shape == (40, H, DV) and out.dtype == dtype and torch.isfinite(out).all()
        assert float((out.double() - ref).abs().max()) <= BOUND[dtype]
        assert torch.equal(out[EMPTY], torch.zeros_like(out[EMPTY]))


@pytest.mark.triton
@pytest.mark.parametrize("skip_empty", [True, False], ids=["skip", "dense"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_rows_bits_do_not_depend_on_the_call(dtype, skip_empty):
    T, S = 48, 100
    q, k, v, mask = case(T, S, dtype=dtype, seed=1)

    def run(q, k, v, mask):
        return kernel(q, k, v, mask, skip_empty=skip_empty)

    whole = run(q, k, v, mask)
    for r in (0, EMPTY, LATE, ONE, 20, 31, T - 1):
        keys = S - T + r + 1                               # only the row's causal keys: a call with a smaller S
        alone = run(q[r: r + 1], k[:keys], v[:keys], mask[r: r + 1, :keys])
        assert torch.equal(alone, whole[r: r + 1]), r
    for a, b in ((0, 1), (5, 29), (16, 32), (17, 48), (30, 31)):
        keys = S - T + b                                    # a block of rows over the keys up to its last row's
        assert torch.equal(run(q[a:b], k[:keys], v[:keys], mask[a:b, :keys]), whole[a:b]), (a, b)
    more = 37                                              # more keys past every row's, none selected
    kv = torch.randn(S + more, 2, 32).to(dtype)
    kv[:S] = torch.cat([k, v], dim=-1)
    k2, v2 = kv.split([16, 16], dim=-1)
    wide = torch.nn.functional.pad(mask, (0, more))
    assert torch.equal(run(q, k2, v2, wide), whole)
    rows = torch.cat([q, torch.randn(21, 2, 16).to(dtype)])   # more rows after (they select every key)
    many = run(rows, k2, v2, torch.cat([wide, torch.ones(21, S + more, dtype=torch.bool)]))
    assert torch.equal(many[:T], whole)
    assert torch.equal(whole, kernel(q, k, v, mask, skip_empty=not skip_empty))   # skipping a no-op changes nothing


@pytest.mark.triton
def test_the_shipped_tiles_keep_the_contract():
    T, S = 40, 150
    q, k, v, mask = case(T, S, H=1, dtype=torch.bfloat16, seed=2)
    whole = kernel(q, k, v, mask, tiles=None)
    for r in (LATE, 25, T - 1):
        keys = S - T + r + 1
        assert torch.equal(kernel(q[r: r + 1], k[:keys], v[:keys], mask[r: r + 1, :keys], tiles=None),
                           whole[r: r + 1]), r
    assert float((whole.double() - exact(q, k, v, mask)).abs().max()) <= BOUND[torch.bfloat16]


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_empty_late_and_single_key_rows(dtype):
    T, S = 24, 90
    q, k, v, mask = case(T, S, dtype=dtype, seed=3)
    out = kernel(q, k, v, mask)
    assert torch.equal(out[EMPTY], torch.zeros_like(out[EMPTY]))                     # exactly 0, no NaN
    assert torch.equal(out[ONE], v[S - T + ONE])                                      # one key: its value
    nothing = kernel(q, k, v, torch.zeros_like(mask))
    assert torch.equal(nothing, torch.zeros_like(nothing))
    late = exact(q, k, v, mask)[LATE]                                                 # first key blocks all masked
    assert float((out[LATE].double() - late).abs().max()) <= BOUND[dtype]
    assert not mask[LATE, :LATE_FROM].any() and torch.isfinite(out).all()


@pytest.mark.triton
def test_empty_calls():
    q, k, v, mask = case(8, 20)
    assert kernel(q[:0], k, v, mask[:0]).shape == (0, 2, 16)
    none = kernel(q, k[:0], v[:0], mask[:, :0])
    assert torch.equal(none, torch.zeros(8, 2, 16))


@pytest.mark.triton
def test_head_dims_past_256_are_refused():
    q, k, v, mask = case(4, 8, H=1, DQ=272, DV=16)
    with pytest.raises(ValueError, match="at most 256"):
        kernel(q, k, v, mask)


def test_pack_mask_bits():
    from tensorfold.kernels.masked_attention.triton_prefill import pack_mask
    mask = torch.rand(5, 70) < 0.5
    words = pack_mask(mask)
    assert words.shape == (5, 3) and words.dtype == torch.int32
    keys = torch.arange(96)
    unpacked = ((words[:, keys // 32] >> (keys % 32)) & 1).bool()
    assert torch.equal(unpacked[:, :70], mask) and not unpacked[:, 70:].any()


def test_public_function_runs_naive_on_the_cpu():
    q, k, v, mask = case(10, 30, seed=4)
    out = public.masked_attention(q, k, v, mask)
    assert torch.equal(out, naive.masked_attention(q, k, v, mask, 16 ** -0.5))
    assert torch.equal(public.masked_attention(q, k, v, mask, scale=0.5), naive.masked_attention(q, k, v, mask, 0.5))


def test_argument_errors():
    q, k, v, mask = case(6, 12)
    bad = [
        ((q[0], k, v, mask), "q must be 3-D"),
        ((q.int(), k, v, mask), "q dtype"),
        ((q, k[0], v, mask), "k must be 3-D"),
        ((q, k.double(), v, mask), "k dtype"),
        ((q, k, v[:, :1], mask), "v has 1 heads"),
        ((q, k[..., :8], v, mask), "k head dim 8"),
        ((q, k, v[:5], mask), "k has 12 keys, v 5"),
        ((q, k, v, mask.int()), "mask must be bool"),
        ((q, k, v, mask[:, :5]), r"mask \(6, 5\) is not"),
        ((q[..., :0], k[..., :0], v, mask), "head dims must be positive"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            public.masked_attention(*args)
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            public.masked_attention(q, k, v, mask, scale)
