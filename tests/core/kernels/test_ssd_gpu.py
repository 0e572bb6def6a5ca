"""The Mamba2 SSD scan on the GPU, at Nemotron-H 30B-A3B's Mamba shape (H 64, P 64, G 8, N 128): our Triton step and
fla-core's simple GLA against the naive ops and a float64 truth, fp32 and bf16, varlen, fresh and resumed; bitwise
properties (determinism, batch invariance, resumption at a grid cut, CUDA-graph replay). Skipped without CUDA.
Tests print `SSD {json}` lines: run with -s, or read $OUT/ssd-tests.jsonl.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from test_ssd import FP32_REL, kept, pieces, relative, ssd_rows

from tensorfold.kernels import ssd
from tensorfold.kernels.ssd import fla_backend, naive

CUDA = torch.cuda.is_available()
HAS_FLA = importlib.util.find_spec("fla") is not None
NEMOTRON = dict(H=64, P=64, G=8, N=128)             # Nemotron-H 30B-A3B's Mamba2 heads
FLA_REL = {torch.float32: 1e-2, torch.bfloat16: 5e-2}   # fla's dots run in TF32 / bf16; relative to max |truth|
BF16_REL = 1e-2                                     # a bf16 y against float32 math: its own rounding and then some
CU = [0, 300, 301, 1000]                            # three streams: one of a single row
DTYPES = [torch.float32, torch.bfloat16]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


def report(**record: object) -> None:
    """Print a measurement (run with -s) and append it to $OUT/ssd-tests.jsonl when OUT is set."""
    line = json.dumps(record)
    print("SSD " + line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "ssd-tests.jsonl", "a") as handle:
            handle.write(line + "\n")


def _fla() -> None:
    """Skip without fla-core; fail when it is installed but does not import (a missing einops wheel, say)."""
    if not HAS_FLA:
        pytest.skip("fla-core is not installed")
    if not fla_backend.available():
        pytest.fail(fla_backend.import_error())


def _case(dtype: torch.dtype, resumed: bool, seed: int = 20):
    rows = ssd_rows(CU[-1], **NEMOTRON, device="cuda", dtype=dtype, seed=seed)
    state = kept(3, NEMOTRON["H"], NEMOTRON["P"], NEMOTRON["N"], "cuda") if resumed else None
    starts = [130, 7, 4097] if resumed else [0, 0, 0]
    return rows, state, starts


def _truth(rows, state, starts):
    x, dt, A, B, C = rows
    return naive.chunk_ssd(x.double(), dt, A, B.double(), C.double(), state, cu_seqlens=CU, starts=starts,
                           math_dtype=torch.float64)


# ---------------------------------------------------------------- naive on the GPU


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gpu_naive_against_truth_and_resume_bitwise(dtype):
    """naive (float32 math) within FP32_REL of float64 in fp32 (BF16_REL for a bf16 y); split at a grid cut it gives
    the one-shot bits; packed == solo bitwise."""
    rows, state, starts = _case(dtype, resumed=True)
    y, final = naive.chunk_ssd(*rows, state, cu_seqlens=CU, starts=starts)
    truth, truth_final = _truth(rows, state, starts)
    report(test="naive_truth", dtype=str(dtype), y=relative(y, truth), state=relative(final, truth_final))
    assert relative(y, truth) < (FP32_REL if dtype == torch.float32 else BF16_REL)
    assert relative(final, truth_final) < FP32_REL
    a, b = CU[2], CU[3]
    cut = 256 - starts[2] % 64                                                     # an absolute grid position
    head, kept_state = naive.chunk_ssd(*pieces(rows, a, a + cut), state[2], starts[2])
    tail, end = naive.chunk_ssd(*pieces(rows, a + cut, b), kept_state, starts[2] + cut)
    assert torch.equal(torch.cat([head, tail]), y[a:b]) and torch.equal(end, final[2])


# ---------------------------------------------------------------- our Triton step


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gpu_triton_step_against_naive(dtype):
    """32 streams in a pool of 48, three padded rows: state within FP32_REL, y within FP32_REL (fp32) / BF16_REL."""
    from tensorfold.kernels.ssd import triton_step
    H, P, G, N = NEMOTRON.values()
    rows = ssd_rows(32, H, P, G, N, "cuda", dtype, seed=21)
    states = kept(48, H, P, N, "cuda")
    slots = torch.randperm(48, generator=torch.Generator().manual_seed(0))[:32].cuda()
    slots[[3, 17, 31]] = -1
    ref_pool, pool = states.clone(), states.clone()
    ref = naive.ssd_step(*rows, ref_pool, slots)
    out = triton_step.ssd_step(*rows, pool, slots)
    report(test="triton_step", dtype=str(dtype), y=relative(out, ref), state=relative(pool, ref_pool))
    assert relative(pool, ref_pool) < FP32_REL
    assert relative(out, ref) < (FP32_REL if dtype == torch.float32 else BF16_REL)
    assert torch.equal(out[[3, 17, 31]], torch.zeros_like(out[[3, 17, 31]]))


def test_gpu_triton_step_is_batch_invariant_and_graph_capturable():
    """A stream alone and inside a batch of 16 give the same bits; a captured CUDA graph replays the eager bits."""
    from tensorfold.kernels.ssd import triton_step
    H, P, G, N = NEMOTRON.values()
    rows = ssd_rows(16, H, P, G, N, "cuda", torch.bfloat16, seed=22)
    states = kept(20, H, P, N, "cuda")
    slots = torch.arange(16, device="cuda") + 2
    alone_pool, pool = states.clone(), states.clone()
    alone = triton_step.ssd_step(*pieces(rows, 5, 6), alone_pool, slots[5:6])
    eager = triton_step.ssd_step(*rows, pool, slots)
    assert torch.equal(eager[5], alone[0]) and torch.equal(pool[7], alone_pool[7])
    graph_pool = states.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_step.ssd_step(*rows, states.clone(), slots)                        # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_step.ssd_step(*rows, graph_pool, slots)
    graph_pool.copy_(states)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(graph_pool, pool)


# ---------------------------------------------------------------- fla's simple GLA


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_gpu_fla_chunk_against_naive_and_truth(dtype, resumed):
    """fla's chunked op vs naive and a float64 truth, varlen, fresh from 0 or resumed from kept states at unaligned
    starts (and with align_grid): within FLA_REL of the truth."""
    _fla()
    rows, state, starts = _case(dtype, resumed)
    out, final = fla_backend.chunk_ssd(*rows, state, cu_seqlens=CU, starts=starts)
    aligned, aligned_final = fla_backend.chunk_ssd(*rows, state, cu_seqlens=CU, starts=starts, align_grid=True)
    ref, ref_final = naive.chunk_ssd(*rows, state, cu_seqlens=CU, starts=starts)
    truth, truth_final = _truth(rows, state, starts)
    report(test="fla_chunk", dtype=str(dtype), resumed=resumed, fla_vs_truth_y=relative(out, truth),
           fla_vs_truth_state=relative(final, truth_final), naive_vs_truth_y=relative(ref, truth),
           naive_vs_truth_state=relative(ref_final, truth_final), fla_vs_naive_y=relative(out, ref),
           aligned_vs_truth_y=relative(aligned, truth), env=fla_backend.environment())
    for y, s in ((out, final), (aligned, aligned_final)):
        assert y.dtype == dtype and s.dtype == torch.float32
        assert relative(y, truth) < FLA_REL[dtype] and relative(s, truth_final) < FLA_REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gpu_fla_chunk_is_deterministic_and_batch_invariant(dtype):
    """The same call twice, and one stream alone vs inside the varlen batch, give the same bits."""
    _fla()
    rows, state, starts = _case(dtype, resumed=True, seed=23)
    out, final = fla_backend.chunk_ssd(*rows, state, cu_seqlens=CU, starts=starts)
    again, again_final = fla_backend.chunk_ssd(*rows, state, cu_seqlens=CU, starts=starts)
    alone, alone_final = fla_backend.chunk_ssd(*pieces(rows, CU[2], CU[3]), state[2])
    report(test="fla_bitwise", dtype=str(dtype), twice=bool(torch.equal(out, again)),
           alone=bool(torch.equal(alone, out[CU[2]:])))
    assert torch.equal(out, again) and torch.equal(final, again_final)
    assert torch.equal(alone, out[CU[2]:]) and torch.equal(alone_final, final[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gpu_fla_split_prefill_vs_one_shot(dtype):
    """fla prefill split at a grid cut vs one shot: within FLA_REL of each other; whether the bits match is
    reported (fla chunks from each call's first row, so with both calls starting on the grid they can)."""
    _fla()
    H, P, G, N = NEMOTRON.values()
    rows = ssd_rows(700, H, P, G, N, "cuda", dtype, seed=24)
    one, one_final = fla_backend.chunk_ssd(*rows)
    head, kept_state = fla_backend.chunk_ssd(*pieces(rows, 0, 256))
    tail, final = fla_backend.chunk_ssd(*pieces(rows, 256, 700), kept_state, 256)
    split = torch.cat([head, tail])
    report(test="fla_split", dtype=str(dtype), y=relative(split, one), state=relative(final, one_final),
           bitwise=bool(torch.equal(split, one) and torch.equal(final, one_final)))
    assert relative(split, one) < FLA_REL[dtype] and relative(final, one_final) < FLA_REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gpu_fla_step_against_naive(dtype):
    """fla's fused recurrent simple GLA through gather/scatter vs the naive step: state within FLA_REL."""
    _fla()
    H, P, G, N = NEMOTRON.values()
    rows = ssd_rows(8, H, P, G, N, "cuda", dtype, seed=25)
    states = kept(12, H, P, N, "cuda")
    slots = [11, 0, 3, 5, 7, 2, 9, 4]
    ref_pool, pool = states.clone(), states.clone()
    ref = naive.ssd_step(*rows, ref_pool, slots)
    out = fla_backend.ssd_step(*rows, pool, slots)
    report(test="fla_step", dtype=str(dtype), y=relative(out, ref), state=relative(pool, ref_pool))
    assert relative(out, ref) < FLA_REL[dtype] and relative(pool, ref_pool) < FLA_REL[dtype]
    assert torch.equal(pool[[1, 6, 8, 10]], states[[1, 6, 8, 10]])


def test_gpu_public_dispatch():
    """backend=None on CUDA: fla for prefill when it imports (its bits), naive otherwise; triton for the step."""
    rows, state, starts = _case(torch.bfloat16, resumed=True, seed=26)
    y, final = ssd.chunk_ssd(*rows, state, cu_seqlens=CU, starts=starts)
    chosen = fla_backend if fla_backend.available() else naive
    ref, ref_final = chosen.chunk_ssd(*rows, state, cu_seqlens=CU, starts=starts)
    assert torch.equal(y, ref) and torch.equal(final, ref_final)
    assert ssd.step_backend("cuda") == "triton"
