"""The gated delta rule on the GPU: the questions docs/kernels.md asks of fla-core — closeness in fp32 and bf16,
resumption from a kept state, determinism, one stream alone vs inside a varlen batch — and our decode step there.
Skipped without CUDA. Tests print `GDN {json}` lines: run with -s, or read $OUT/gdn-tests.jsonl.
"""

from __future__ import annotations

import pytest
import torch
from gdn_cases import CUDA, HAS_FLA, kept_state, l2, relative, report, rows, worst

from tensorfold.kernels import gated_delta
from tensorfold.kernels.gated_delta import fla_backend, naive

# ---------------------------------------------------------------- fla on the GPU: the decision's questions

QWEN = dict(NK=16, NV=32, DK=128, DV=128)          # Qwen3.5-9B's GDN heads


def _fla():
    """Skip without fla-core; fail when it is installed but does not import (a missing einops wheel, say)."""
    if not HAS_FLA:
        pytest.skip("fla-core is not installed")
    if not fla_backend.available():
        pytest.fail(fla_backend.import_error())


def _truth(q, k, v, g, beta, state, cu, starts):
    return naive.chunk_gated_delta(q.double(), k.double(), v.double(), g, beta.double(), state, cu_seqlens=cu,
                                   starts=starts, qk_l2norm=True, scale=q.shape[-1] ** -0.5,
                                   math_dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_chunk_against_naive(dtype, resumed):
    """fla's chunked op vs naive (float32 math on the GPU) and a float64 truth, fresh from position 0 or resumed
    from a kept state at unaligned starts, streams packed varlen."""
    _fla()
    NK, NV, DK, DV = 4, 8, 128, 128
    cu = [0, 300, 301, 1000]
    starts = [130, 7, 4097] if resumed else [0, 0, 0]
    q, k, v, g, beta = rows(cu[-1], NK, NV, DK, DV, "cuda", dtype, seed=12)
    state = kept_state(3, NV, DK, DV, "cuda") if resumed else None
    out, final = fla_backend.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts,
                                               **l2(DK))
    ref, ref_final = naive.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts, **l2(DK))
    truth, truth_final = _truth(q, k, v, g, beta, state, cu, starts)
    aligned, _ = fla_backend.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts,
                                               **l2(DK), align_grid=True)
    record = dict(test="fla_chunk", dtype=str(dtype), resumed=resumed,
                  fla_vs_naive_out=worst(out, ref), fla_vs_naive_state=worst(final, ref_final),
                  fla_vs_truth_out=worst(out, truth), naive_vs_truth_out=worst(ref, truth),
                  fla_vs_truth_state=worst(final, truth_final), naive_vs_truth_state=worst(ref_final, truth_final),
                  fla_aligned_vs_truth_out=worst(aligned, truth), out_max=float(truth.abs().max()),
                  env=fla_backend.environment())
    report(**record)
    limit = 2e-2 if dtype == torch.float32 else 6e-2
    assert relative(out, truth) < limit and relative(final, truth_final) < limit, record


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_chunk_is_deterministic_and_batch_invariant(dtype):
    """The same call twice gives the same bits; a stream alone gives the same bits as inside a varlen batch
    (first, middle and last place, with neighbours of other lengths)."""
    _fla()
    NK, NV, DK, DV = QWEN["NK"], QWEN["NV"], QWEN["DK"], QWEN["DV"]
    lengths = [190, 1000, 64, 513]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q, k, v, g, beta = rows(cu[-1], NK, NV, DK, DV, "cuda", dtype, seed=13)
    state = kept_state(4, NV, DK, DV, "cuda")
    first = fla_backend.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=cu, **l2(DK))
    second = fla_backend.chunk_gated_delta(q, k, v, g, beta, state, cu_seqlens=cu, **l2(DK))
    twice = torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    solo = {}
    for n in range(4):
        a, b = cu[n], cu[n + 1]
        out, final = fla_backend.chunk_gated_delta(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[n],
                                                   **l2(DK))
        solo[n] = (torch.equal(out, first[0][a:b]) and torch.equal(final, first[1][n]),
                   worst(out, first[0][a:b]))
    report(test="fla_chunk_bitwise", dtype=str(dtype), same_call_twice=twice,
           alone_vs_in_batch={n: s[0] for n, s in solo.items()}, worst_diff={n: s[1] for n, s in solo.items()})
    assert twice
    assert all(s[0] for s in solo.values()), solo


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["fla", "triton"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_step_against_naive_and_batch_invariant(dtype, backend):
    """The decode step of 16 streams in a pool of 40: vs naive, the same call twice, one stream alone vs inside."""
    if backend == "fla":
        _fla()
    NK, NV, DK, DV = QWEN["NK"], QWEN["NV"], QWEN["DK"], QWEN["DV"]
    B = 16
    q, k, v, g, beta = rows(B, NK, NV, DK, DV, "cuda", dtype, seed=14)
    states = kept_state(40, NV, DK, DV, "cuda")
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:B].cuda()
    ref_pool = states.clone()
    ref = naive.recurrent_gated_delta_step(q, k, v, g, beta, ref_pool, slots, **l2(DK))
    runs = []
    for _ in range(2):
        pool = states.clone()
        runs.append((gated_delta.recurrent_gated_delta_step(q, k, v, g, beta, pool, slots, **l2(DK),
                                                            backend=backend), pool))
    alone_pool = states.clone()
    alone = gated_delta.recurrent_gated_delta_step(q[5:6], k[5:6], v[5:6], g[5:6], beta[5:6], alone_pool,
                                                   slots[5:6], **l2(DK), backend=backend)
    (out, pool), (out2, pool2) = runs
    slot = int(slots[5])
    record = dict(test="step", backend=backend, dtype=str(dtype), vs_naive_out=worst(out, ref),
                  vs_naive_state=worst(pool, ref_pool),
                  same_call_twice=torch.equal(out, out2) and torch.equal(pool, pool2),
                  alone_vs_in_batch=torch.equal(alone[0], out[5]) and torch.equal(alone_pool[slot], pool[slot]))
    report(**record)
    assert record["vs_naive_state"] < 1e-4 and relative(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2)
    assert record["same_call_twice"] and record["alone_vs_in_batch"], record
    untouched = torch.ones(40, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(pool[untouched], states[untouched])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_prefill_then_decode_continues_the_stream():
    """Prefill through fla to a kept state, then decode steps: the same as the naive path end to end."""
    _fla()
    NK, NV, DK, DV = 4, 8, 128, 128
    T, steps = 333, 4
    q, k, v, g, beta = rows(T + steps, NK, NV, DK, DV, "cuda", seed=15)
    _, kept = fla_backend.chunk_gated_delta(q[:T], k[:T], v[:T], g[:T], beta[:T], **l2(DK))
    _, ref_kept = naive.chunk_gated_delta(q[:T], k[:T], v[:T], g[:T], beta[:T], **l2(DK))
    pool, ref_pool = kept[None].clone(), ref_kept[None].clone()
    diffs = []
    for t in range(T, T + steps):
        out = fla_backend.recurrent_gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                     beta[t:t + 1], pool, [0], **l2(DK))
        ref = naive.recurrent_gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                               ref_pool, [0], **l2(DK))
        diffs.append(worst(out, ref))
    report(test="fla_prefill_then_decode", step_out_diffs=diffs, state_diff=worst(pool, ref_pool))
    assert max(diffs) < 1e-2 and worst(pool, ref_pool) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_split_prefill_vs_one_shot(dtype):
    """Prefill [0, cut) to a kept state, then [cut, T) from it, vs one call over [0, T): close always; reported
    whether bitwise (a cut on a multiple of 64 gives fla the same chunks as the one-shot call)."""
    _fla()
    NK, NV, DK, DV = 4, 8, 128, 128
    T = 1000
    q, k, v, g, beta = rows(T, NK, NV, DK, DV, "cuda", dtype, seed=16)
    one, one_final = fla_backend.chunk_gated_delta(q, k, v, g, beta, **l2(DK))
    results = {}
    for cut in (512, 300):
        head, kept = fla_backend.chunk_gated_delta(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], **l2(DK))
        tail, final = fla_backend.chunk_gated_delta(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], kept, cut,
                                                    **l2(DK))
        both = torch.cat([head, tail])
        results[cut] = dict(bitwise=torch.equal(both, one) and torch.equal(final, one_final),
                            out_diff=worst(both, one), state_diff=worst(final, one_final))
    report(test="fla_split_vs_one_shot", dtype=str(dtype), **{str(c): r for c, r in results.items()})
    for r in results.values():
        assert r["out_diff"] < 5e-2 * float(one.double().abs().max()), results

