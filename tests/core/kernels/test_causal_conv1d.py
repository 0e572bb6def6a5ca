"""causal_conv1d: the naive path against tensorfold_qwen's `gdn.causal_conv` (bitwise), the Triton kernels against
the naive path (reference always computed on the CPU).

Tolerances, Triton vs naive: float32 rtol = atol = 1e-5 (summation order, exp); bfloat16 rtol = atol = 2^-7, one
bf16 ulp at unit scale (the kernel rounds where F.conv1d and F.silu round; a flip of the rounded conv moves
the SiLU by less than that). The tails are copies of inputs, so they must match exactly.
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.kernels.causal_conv1d import causal_conv1d_prefill, causal_conv1d_update, naive

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 2**-7}}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Seeded CPU normals in dtype (the same values whatever the device they go to)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def inputs(T: int, C: int, K: int, dtype: torch.dtype, bias: bool = False, seed: int = 0):
    """x [T, C], weight [C, K], tail [C, K-1], bias [C] | None."""
    return (randn(T, C, dtype=dtype, seed=seed), randn(C, K, dtype=dtype, seed=seed + 1) * 0.5,
            randn(C, K - 1, dtype=dtype, seed=seed + 2), randn(C, dtype=dtype, seed=seed + 3) if bias else None)


# ---- naive (no triton needed) -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [2, 3, 4], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("T", [1, 3, 17], ids=lambda t: f"T{t}")
def test_naive_prefill_matches_qwen_reference(T, K, dtype):
    gdn = pytest.importorskip("tensorfold_qwen.gdn")
    x, w, tail, _ = inputs(T, 37, K, dtype)
    tail_ref = tail.clone()
    y = naive.causal_conv1d_prefill(x, w, tail)
    assert y.dtype == dtype and y.shape == (T, 37)
    assert torch.equal(y, gdn.causal_conv(x, w, tail_ref))
    assert torch.equal(tail, tail_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [2, 4], ids=lambda k: f"K{k}")
def test_naive_update_matches_one_row_prefill_per_stream(K, dtype):
    gdn = pytest.importorskip("tensorfold_qwen.gdn")
    B, S, C = 3, 5, 37
    x, w, _, _ = inputs(B, C, K, dtype)
    tails = randn(S, C, K - 1, dtype=dtype, seed=9)
    slots = torch.tensor([4, 0, 2])
    expected_tails = tails.clone()
    expected = torch.stack([gdn.causal_conv(x[b:b + 1], w, expected_tails[s])[0] for b, s in enumerate(slots)])
    y = naive.causal_conv1d_update(x, w, tails, slots)
    assert torch.equal(y, expected)
    assert torch.equal(tails, expected_tails)                  # slots 1 and 3 untouched too


@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_chunks_carry_the_tail(dtype):
    x, w, tail, _ = inputs(12, 37, 4, dtype)
    whole_tail, split_tail = tail.clone(), tail.clone()
    whole = naive.causal_conv1d_prefill(x, w, whole_tail)
    pieces = [naive.causal_conv1d_prefill(x[a:b], w, split_tail) for a, b in ((0, 1), (1, 3), (3, 12))]
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(split_tail, whole_tail)


def test_naive_bias_against_float64():
    x, w, tail, bias = inputs(6, 37, 4, torch.float32, bias=True)
    window = torch.cat((tail, x.T), dim=1).double()                                # [C, K-1+T]
    conv = sum(window[:, k:k + 6] * w[:, k:k + 1].double() for k in range(4)) + bias.double()[:, None]
    y = naive.causal_conv1d_prefill(x, w, tail.clone(), bias)
    torch.testing.assert_close(y.double(), torch.nn.functional.silu(conv).T, rtol=1e-5, atol=1e-5)


def test_empty_rows_change_nothing():
    x, w, tail, _ = inputs(0, 37, 4, torch.float32)
    before = tail.clone()
    assert causal_conv1d_prefill(x, w, tail).shape == (0, 37) and torch.equal(tail, before)
    tails = randn(2, 37, 3, dtype=torch.float32, seed=5)
    assert causal_conv1d_update(x, w, tails, torch.zeros(0, dtype=torch.long)).shape == (0, 37)


@pytest.mark.parametrize("bad, match", [
    pytest.param({"tail": torch.zeros(37, 2)}, "tail must be", id="tail-shape"),
    pytest.param({"tail": torch.zeros(37, 3, dtype=torch.bfloat16)}, "tail must be", id="tail-dtype"),
    pytest.param({"weight": torch.zeros(36, 4)}, "weight must be", id="weight-shape"),
    pytest.param({"bias": torch.zeros(5)}, "bias must be", id="bias-shape"),
    pytest.param({"x": torch.zeros(2, 3, 37)}, "x must be", id="x-3d"),
])
def test_prefill_rejects_bad_arguments(bad, match):
    x, w, tail, _ = inputs(2, 37, 4, torch.float32)
    args = {"x": x, "weight": w, "tail": tail, "bias": None} | bad
    with pytest.raises(ValueError, match=match):
        causal_conv1d_prefill(**args)


def test_prefill_rejects_a_bad_out():
    x, w, tail, _ = inputs(4, 37, 4, torch.float32)
    for out in (torch.zeros(3, 37), torch.zeros(4, 37, dtype=torch.bfloat16), torch.zeros(37, 4).t()):
        with pytest.raises(ValueError, match="out must be"):
            causal_conv1d_prefill(x, w, tail, out=out)


def test_update_rejects_bad_slots_and_tails():
    x, w, _, _ = inputs(2, 37, 4, torch.float32)
    tails = torch.zeros(3, 37, 3)
    with pytest.raises(ValueError, match="slots must be"):
        causal_conv1d_update(x, w, tails, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="slots must be"):
        causal_conv1d_update(x, w, tails, torch.tensor([0]))
    with pytest.raises(ValueError, match="tails must be"):
        causal_conv1d_update(x, w, torch.zeros(37, 3), torch.tensor([0, 1]))


# ---- triton (GPU, or the interpreter on the CPU) ------------------------------------------------------------

@pytest.mark.triton
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 2, 3, 4], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("T, C", [(1, 37), (2, 130), (5, 8), (33, 37), (17, 600)],
                         ids=["T1-C37", "T2-C130", "T5-C8", "T33-C37", "T17-C600"])
def test_triton_prefill_matches_naive(T, C, K, dtype, bias, device):
    from tensorfold.kernels.causal_conv1d import triton_conv
    x, w, tail, b = inputs(T, C, K, dtype, bias=bias)
    expected_tail = tail.clone()
    expected = naive.causal_conv1d_prefill(x, w, expected_tail, b)
    tail_dev = tail.to(device)
    y = triton_conv.causal_conv1d_prefill(x.to(device), w.to(device), tail_dev, None if b is None else b.to(device))
    assert y.dtype == dtype and y.shape == (T, C)
    torch.testing.assert_close(y.cpu(), expected, **TOLERANCE[dtype])
    assert torch.equal(tail_dev.cpu(), expected_tail)


@pytest.mark.triton
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [2, 3, 4], ids=lambda k: f"K{k}")
def test_triton_update_matches_naive(K, dtype, bias, device):
    from tensorfold.kernels.causal_conv1d import triton_conv
    B, S, C = 4, 7, 300
    x, w, _, b = inputs(B, C, K, dtype, bias=bias)
    tails = randn(S, C, K - 1, dtype=dtype, seed=11)
    slots = torch.tensor([6, 1, 3, 0])
    expected_tails = tails.clone()
    expected = naive.causal_conv1d_update(x, w, expected_tails, slots, b)
    tails_dev = tails.to(device)
    y = triton_conv.causal_conv1d_update(x.to(device), w.to(device), tails_dev, slots.to(device),
                                         None if b is None else b.to(device))
    torch.testing.assert_close(y.cpu(), expected, **TOLERANCE[dtype])
    assert torch.equal(tails_dev.cpu(), expected_tails)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_after_prefill_on_strided_state(dtype, device):
    """A stream prefilled in a slot of a [S, C, K-1] state, then decoded twice through slots (int32 here)."""
    from tensorfold.kernels.causal_conv1d import triton_conv
    C, K = 37, 4
    x, w, _, _ = inputs(5, C, K, dtype)
    rows = randn(2, C, dtype=dtype, seed=21)
    states = {"ref": torch.zeros(3, C, K - 1, dtype=dtype), "dev": torch.zeros(3, C, K - 1, dtype=dtype).to(device)}
    outs = {}
    for name, conv, where in (("ref", naive, "cpu"), ("dev", triton_conv, device)):
        wd, tails = w.to(where), states[name]
        ys = [conv.causal_conv1d_prefill(x.to(where), wd, tails[2])]
        for r in range(2):
            ys.append(conv.causal_conv1d_update(rows[r:r + 1].to(where), wd, tails,
                                                torch.tensor([2], dtype=torch.int32, device=where)))
        outs[name] = torch.cat(ys).cpu()
    torch.testing.assert_close(outs["dev"], outs["ref"], **TOLERANCE[dtype])
    assert torch.equal(states["dev"].cpu(), states["ref"])


@pytest.mark.triton
def test_triton_prefill_takes_at_most_four_taps(device):
    from tensorfold.kernels.causal_conv1d import triton_conv
    x, w, tail, _ = inputs(3, 8, 5, torch.float32)
    with pytest.raises(ValueError, match="K <= 4"):
        triton_conv.causal_conv1d_prefill(x.to(device), w.to(device), tail.to(device))
    expected = naive.causal_conv1d_prefill(x, w, tail.clone())                     # the public path falls back
    got = causal_conv1d_prefill(x.to(device), w.to(device), tail.to(device))
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[torch.float32])


@pytest.mark.triton
def test_triton_empty(device):
    from tensorfold.kernels.causal_conv1d import triton_conv
    w, tail = torch.ones(8, 4, device=device), torch.ones(8, 3, device=device)
    assert triton_conv.causal_conv1d_prefill(torch.ones(0, 8, device=device), w, tail).shape == (0, 8)
    assert torch.equal(tail, torch.ones(8, 3, device=device))
    empty_slots = torch.zeros(0, dtype=torch.long, device=device)
    y = triton_conv.causal_conv1d_update(torch.ones(0, 8, device=device), w, tail[None], empty_slots)
    assert y.shape == (0, 8)


@pytest.mark.parametrize("path", ["naive", pytest.param("triton", marks=pytest.mark.triton)])
def test_update_padded_rows_touch_no_tail(path, device):
    """A negative slot is a padded row of a captured batch: zero output, every tail unchanged by it."""
    dev = device if path == "triton" else "cpu"
    from tensorfold.kernels.causal_conv1d import triton_conv
    update = triton_conv.causal_conv1d_update if path == "triton" else naive.causal_conv1d_update
    x, w, _, _ = inputs(4, 37, 4, torch.float32)
    tails = randn(5, 37, 3, dtype=torch.float32, seed=12)
    padded, live_only = tails.clone().to(dev), tails.clone().to(dev)
    y = update(x.to(dev), w.to(dev), padded, torch.tensor([3, -1, 0, -1]).to(dev))
    alone = update(x[[0, 2]].to(dev), w.to(dev), live_only, torch.tensor([3, 0]).to(dev))
    assert torch.equal(y[[0, 2]].cpu(), alone.cpu())
    assert torch.equal(y[[1, 3]].cpu(), torch.zeros(2, 37))
    assert torch.equal(padded.cpu(), live_only.cpu())


@pytest.mark.triton
@pytest.mark.parametrize("triton", [False, True], ids=["naive", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_into_slices_of_one_buffer_is_the_concatenation_bitwise(triton, dtype, device, monkeypatch):
    """Streams packed end to end, each stream's rows written into its slice of one buffer (`out`): the bits and
    tails of each stream's own output, concatenated (what the batched step did before)."""
    import tensorfold.kernels.causal_conv1d as package
    if triton:
        from tensorfold.kernels.causal_conv1d import triton_conv  # noqa: F401  (imported under the interpreter)
    monkeypatch.setattr(package, "use_triton", lambda t: triton)
    C, K, bounds = 40, 4, (0, 1, 13, 30)
    x, w, _, _ = (t.to(device) if t is not None else None for t in inputs(bounds[-1], C, K, dtype))
    tails = randn(len(bounds) - 1, C, K - 1, dtype=dtype, seed=5).to(device)
    expected_tails, got_tails = tails.clone(), tails.clone()
    expected = torch.cat([causal_conv1d_prefill(x[a:b], w, expected_tails[i])
                          for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))])
    packed = torch.empty(bounds[-1], C, dtype=dtype, device=device)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        assert causal_conv1d_prefill(x[a:b], w, got_tails[i], out=packed[a:b]).data_ptr() == packed[a:b].data_ptr()
    assert torch.equal(packed, expected) and torch.equal(got_tails, expected_tails)
