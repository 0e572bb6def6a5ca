"""Kimi Delta Attention through fla-core (core/tensorfold/kernels/kda/fla_backend.py): the questions docs/kernels.md
("kda") asks before fla may be the GPU path.

GPU (marked `gpu`, skipped without CUDA; skipped without fla-core, failed when fla is installed but does not
import), at GLM-5.3-Flash's KDA widths (H 64, DK = DV 128) so that fla autotunes one shape per dtype:
  - prefill, fla vs naive float32 and vs a float64 truth (naive in float64), fp32 and bf16 inputs, one stream and
    varlen (with a 1-row and an empty stream), fresh from position 0 and resumed from kept states at unaligned
    starts; the zero-row grid alignment (`align_grid`) too                      bound: relative to the truth
  - prefill determinism and batch invariance: the same call twice, and each stream alone vs inside the varlen
    batch, with q, k normalised by fla (use_qk_l2norm_in_kernel) and prepared outside      asserted bitwise
  - resumption: [0, cut) then [cut, T) from the kept state vs one call over [0, T), cut 512 (on the grid of 64)
    and 300 (off it), fla's relative chunks and align_grid                bitwise at 512, close at 300
  - the decode step (gather/scatter and fla's in-place pool kernel) vs naive, with padded rows (slot -1): zero
    output, the same bits for the live rows and the pool as the call without them, other slots untouched
  - decode batch invariance: a stream alone vs at rows 0, 3 and 7 of a batch of 8   asserted bitwise: fla's
    recurrent kernel has one fixed config (no autotuning) and one program per (stream, head, 32 value columns),
    so nothing in a stream's arithmetic depends on the batch; the max difference is recorded as well
  - prefill then decode, extreme decays (-50 per step beside slow channels), and fla's safe_gate path on the
    bounded (-5) gate.
Each test prints `KDA-GPU {json}` lines (run with -s) and appends them to $OUT/kda-gpu-tests.jsonl when OUT is set:
every max difference is recorded before anything is asserted.

The adapter's glue on the CPU (fla in triton's interpreter) is tested in test_kda.py. This module imports on the
CPU without fla (fla is imported lazily by fla_backend).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from kda_cases import CUDA, HAS_FLA, kept_state, l2, relative, rows, worst

from tensorfold.kernels import kda
from tensorfold.kernels.kda import fla_backend, naive

DEVICE = "cuda"                                     # where the gpu-marked tests put their tensors
GLM = dict(H=64, DK=128, DV=128)                    # GLM-5.3-Flash's KDA: linear_num_heads, linear_head_dim
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


# ---------------------------------------------------------------- shared helpers


def report(**record: object) -> None:
    """Print a measurement (run with -s to see it) and append it to $OUT/kda-gpu-tests.jsonl when OUT is set."""
    line = json.dumps(record, default=str)
    print("KDA-GPU " + line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "kda-gpu-tests.jsonl", "a") as handle:
            handle.write(line + "\n")


def truth(q, k, v, g, beta, state, start=0, cu=None, starts=None):
    """The naive chunked form in float64 from the same (dtype-rounded) inputs: what fla and naive float32 are both
    measured against."""
    return naive.chunk_kda(q.double(), k.double(), v.double(), g, beta.double(), state, start, cu_seqlens=cu,
                           starts=starts, math_dtype=torch.float64, **l2(q.shape[-1]))


def _fla() -> None:
    """Skip without fla-core; fail when it is installed but does not import (a missing einops wheel, say)."""
    if not HAS_FLA:
        pytest.skip("fla-core is not installed")
    if not fla_backend.available():
        pytest.fail(fla_backend.import_error())


def _limit(dtype: torch.dtype) -> float:
    """fla vs the float64 truth, relative to the truth's largest entry: TF32 dots for fp32 inputs; bf16 storage of
    the solved (I + A)^-1, w, u, the per-chunk states for bf16 inputs (the bounds gated_delta's GPU tests use)."""
    return 2e-2 if dtype == torch.float32 else 6e-2


def _naive_out_limit(dtype: torch.dtype) -> float:
    """Naive float32 vs the float64 truth, relative to the truth's largest entry. Its states are float32 (1e-4);
    its output comes back in v's dtype, so for bf16 inputs each entry carries bf16's rounding, up to half an ulp,
    which is 2^-8 of the entry at worst (8 significant bits): the float32 arithmetic is not what that bound
    measures."""
    return 1e-4 if dtype == torch.float32 else 2.0 ** -8 + 1e-4


# ---------------------------------------------------------------- prefill: closeness


@DTYPES
@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
@pytest.mark.parametrize("layout", ["one", "varlen"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_chunk_against_naive_and_truth(dtype, resumed, layout):
    """fla's chunked op vs naive float32 (on the GPU) and the float64 truth; resumed = kept states and unaligned
    starts. Varlen includes a 1-row stream and an empty one (whose state must come back unchanged)."""
    _fla()
    H, DK, DV = GLM["H"], GLM["DK"], GLM["DV"]
    if layout == "one":
        T, cu, starts = 700, None, None
        start = 130 if resumed else 0
        state = kept_state(1, H, DK, DV, DEVICE)[0] if resumed else None
    else:
        cu, start = [0, 300, 301, 301, 1000], 0
        T, starts = cu[-1], ([130, 7, 64, 4097] if resumed else [0, 0, 0, 0])
        state = kept_state(4, H, DK, DV, DEVICE) if resumed else None
    q, k, v, g, beta = rows(T, H, DK, DV, DEVICE, dtype, seed=12)
    args = dict(cu_seqlens=cu, starts=starts, **l2(DK))
    out, final = fla_backend.chunk_kda(q, k, v, g, beta, state, start, **args)
    aligned, aligned_final = fla_backend.chunk_kda(q, k, v, g, beta, state, start, align_grid=True, **args)
    ref, ref_final = naive.chunk_kda(q, k, v, g, beta, state, start, **args)
    exact, exact_final = truth(q, k, v, g, beta, state, start, cu, starts)
    record = dict(test="fla_chunk", dtype=str(dtype), layout=layout, resumed=resumed, T=T,
                  fla_vs_naive_out=worst(out, ref), fla_vs_naive_state=worst(final, ref_final),
                  fla_vs_truth_out=worst(out, exact), fla_vs_truth_state=worst(final, exact_final),
                  naive_vs_truth_out=worst(ref, exact), naive_vs_truth_state=worst(ref_final, exact_final),
                  aligned_vs_truth_out=worst(aligned, exact), aligned_vs_truth_state=worst(aligned_final, exact_final),
                  out_max=float(exact.abs().max()), state_max=float(exact_final.abs().max()),
                  env=fla_backend.environment())
    report(**record)
    assert out.shape == ref.shape and out.dtype == v.dtype and final.dtype == torch.float32, record
    assert final.shape == ref_final.shape, record
    assert torch.isfinite(out).all() and torch.isfinite(final).all(), record
    limit = _limit(dtype)
    for name, (a, b) in {"out": (out, exact), "state": (final, exact_final), "aligned out": (aligned, exact),
                         "aligned state": (aligned_final, exact_final)}.items():
        assert relative(a, b) < limit, (name, record)
    assert relative(ref, exact) < _naive_out_limit(dtype) and relative(ref_final, exact_final) < 1e-4, record
    if layout == "varlen":
        initial = torch.zeros_like(final[2]) if state is None else state[2]
        assert torch.equal(final[2], initial) and torch.equal(aligned_final[2], initial), "empty stream's state"


# ---------------------------------------------------------------- prefill: determinism, batch invariance, resumption


@DTYPES
@pytest.mark.parametrize("qk", ["l2norm_in_fla", "prepared"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_chunk_is_deterministic_and_batch_invariant(dtype, qk):
    """The same call twice gives the same bits; each stream alone gives the same bits as inside a varlen batch
    (first, middle and last place, neighbours of other lengths). The batch has 1767 rows·64 heads > 65536 while
    the first stream alone has 190·64: fla's l2norm_fwd autotunes per NB = cdiv(rows·heads, 65536), so with
    "l2norm_in_fla" alone and batched could run different configs (it did, once in a device run), unless held to
    one (fla_import.pin_l2norm, on loading fla). "prepared": q, k normalised outside fla (l2norm in float32, q
    scaled, cast back to the input dtype)."""
    _fla()
    H, DK, DV = GLM["H"], GLM["DK"], GLM["DV"]
    lengths = [190, 1000, 64, 513]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q, k, v, g, beta = rows(cu[-1], H, DK, DV, DEVICE, dtype, seed=13)
    if qk == "prepared":
        q, k = naive.prepare_qk(q, k, DK ** -0.5, True, torch.float32)
        q, k = q.to(dtype), k.to(dtype)
        args = dict(scale=1.0, qk_l2norm=False)
    else:
        args = l2(DK)
    state = kept_state(4, H, DK, DV, DEVICE)
    first = fla_backend.chunk_kda(q, k, v, g, beta, state, cu_seqlens=cu, **args)
    second = fla_backend.chunk_kda(q, k, v, g, beta, state, cu_seqlens=cu, **args)
    twice = torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    solo = {}
    for n in range(4):
        a, b = cu[n], cu[n + 1]
        out, final = fla_backend.chunk_kda(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[n], **args)
        solo[n] = dict(bitwise=torch.equal(out, first[0][a:b]) and torch.equal(final, first[1][n]),
                       out_diff=worst(out, first[0][a:b]), state_diff=worst(final, first[1][n]))
    record = dict(test="fla_chunk_bitwise", dtype=str(dtype), qk=qk, same_call_twice=twice, lengths=lengths,
                  alone_vs_in_batch=solo)
    report(**record)
    assert twice, record
    assert all(s["bitwise"] for s in solo.values()), record


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_l2norm_is_one_config_alone_and_in_a_batch():
    """Loading fla pins its l2norm kernels to one config: rows alone (NB 1) and inside a batch of rows·heads past
    65536 (NB 2) give the same bits."""
    _fla()
    from fla.modules.norm import l2norm

    from tensorfold.kernels import fla_import
    assert all(len(kernel.configs) == 1 for kernel in (l2norm.l2norm_fwd_kernel, l2norm.l2norm_bwd_kernel))
    assert fla_import.pin_l2norm()
    x = torch.randn(1767 * 64, 128, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEVICE)
    whole, _ = l2norm.l2norm_fwd(x)
    for a, b in ((0, 190 * 64), (1190 * 64, 1767 * 64)):
        assert torch.equal(l2norm.l2norm_fwd(x[a:b])[0], whole[a:b]), (a, b)


@DTYPES
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_split_prefill_vs_one_shot(dtype):
    """Prefill [0, cut) to a kept state, then [cut, T) from it (start = cut), vs one call over [0, T). At cut 512
    (a multiple of 64) fla's chunks are those of the one-shot call and the carried float32 state is what the
    one-shot call holds in registers there: asserted bitwise (with and without align_grid, which pads nothing
    there). At cut 300 the chunks differ (fla's relative ones, or align_grid's zero-padded partial chunk): close.
    """
    _fla()
    H, DK, DV = GLM["H"], GLM["DK"], GLM["DV"]
    T = 1000
    q, k, v, g, beta = rows(T, H, DK, DV, DEVICE, dtype, seed=16)
    state = kept_state(1, H, DK, DV, DEVICE, seed=3)[0]
    one, one_final = fla_backend.chunk_kda(q, k, v, g, beta, state, **l2(DK))
    exact, exact_final = truth(q, k, v, g, beta, state)
    results = {}
    for cut in (512, 300):
        for align in (False, True):
            head, kept = fla_backend.chunk_kda(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state,
                                               align_grid=align, **l2(DK))
            tail, final = fla_backend.chunk_kda(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], kept, cut,
                                                align_grid=align, **l2(DK))
            both = torch.cat([head, tail])
            results[f"cut{cut}{'_aligned' if align else ''}"] = dict(
                bitwise=torch.equal(both, one) and torch.equal(final, one_final),
                out_diff=worst(both, one), state_diff=worst(final, one_final),
                vs_truth_out=worst(both, exact), vs_truth_state=worst(final, exact_final))
    report(test="fla_split_vs_one_shot", dtype=str(dtype), one_shot_vs_truth_out=worst(one, exact),
           out_max=float(exact.abs().max()), **results)
    for name, r in results.items():
        assert r["vs_truth_out"] < _limit(dtype) * float(exact.abs().max()), (name, results)
    assert results["cut512"]["bitwise"] and results["cut512_aligned"]["bitwise"], results


# ---------------------------------------------------------------- decode


def _pool_case(dtype, B: int, pool: int, seed: int):
    H, DK, DV = GLM["H"], GLM["DK"], GLM["DV"]
    q, k, v, g, beta = rows(B, H, DK, DV, DEVICE, dtype, seed=seed)
    return (q, k, v, g, beta), kept_state(pool, H, DK, DV, DEVICE, seed=seed + 1)


@DTYPES
@pytest.mark.parametrize("in_place", [False, True], ids=["gather_scatter", "in_place"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_step_with_padded_rows(dtype, in_place):
    """A decode step of 8 rows, 3 of them padded (slot -1, as a captured batch pads), in a pool of 40: vs naive;
    padded rows output zero; the live rows' outputs and the whole pool have the same bits as the call without the
    padded rows; slots not in the batch keep their bits; the same call twice gives the same bits."""
    _fla()
    DK = GLM["DK"]
    inputs, states = _pool_case(dtype, 8, 40, seed=20)
    slots = torch.tensor([17, -1, 3, 39, -1, 0, 25, -1], device=DEVICE)
    live = (slots >= 0).nonzero()[:, 0]
    ref_pool = states.clone()
    ref = naive.recurrent_kda_step(*inputs, ref_pool, slots.tolist(), **l2(DK))
    runs = []
    for _ in range(2):
        pool = states.clone()
        runs.append((fla_backend.recurrent_kda_step(*inputs, pool, slots, in_place=in_place, **l2(DK)), pool))
    (out, pool), (out2, pool2) = runs
    compact_pool = states.clone()
    compact = fla_backend.recurrent_kda_step(*(t[live] for t in inputs), compact_pool, slots[live],
                                             in_place=in_place, **l2(DK))
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[slots[live]] = False
    record = dict(test="fla_step_padded", dtype=str(dtype), in_place=in_place, vs_naive_out=worst(out, ref),
                  vs_naive_state=worst(pool, ref_pool), out_max=float(ref.abs().max()),
                  padded_out_zero=bool((out[slots < 0] == 0).all()),
                  same_as_without_padding=torch.equal(out[live], compact) and torch.equal(pool, compact_pool),
                  same_call_twice=torch.equal(out, out2) and torch.equal(pool, pool2),
                  others_untouched=torch.equal(pool[untouched], states[untouched]))
    report(**record)
    assert record["vs_naive_state"] < 1e-4, record
    assert relative(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2), record
    assert record["padded_out_zero"] and record["same_as_without_padding"], record
    assert record["same_call_twice"] and record["others_untouched"], record


@DTYPES
@pytest.mark.parametrize("in_place", [False, True], ids=["gather_scatter", "in_place"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_step_is_batch_invariant(dtype, in_place):
    """One stream's decode step alone (B = 1) vs the same stream at rows 0, 3 and 7 of a batch of 8: asserted
    bitwise (module docstring: fixed config, per-stream programs); the max difference is recorded too. The public
    op (backend=None, which picks fla on CUDA) is checked against fla_backend as well."""
    _fla()
    DK = GLM["DK"]
    inputs, states = _pool_case(dtype, 8, 24, seed=30)
    slots = torch.tensor([5, 11, 2, 20, 7, 13, 0, 23], device=DEVICE)
    pool = states.clone()
    batch = fla_backend.recurrent_kda_step(*inputs, pool, slots, in_place=in_place, **l2(DK))
    alone = {}
    for row in (0, 3, 7):
        single = states.clone()
        out = fla_backend.recurrent_kda_step(*(t[row:row + 1] for t in inputs), single, slots[row:row + 1],
                                             in_place=in_place, **l2(DK))
        slot = int(slots[row])
        alone[row] = dict(bitwise=torch.equal(out[0], batch[row]) and torch.equal(single[slot], pool[slot]),
                          out_diff=worst(out[0], batch[row]), state_diff=worst(single[slot], pool[slot]))
    public_pool = states.clone()
    public = kda.recurrent_kda_step(*inputs, public_pool, slots, **l2(DK))
    record = dict(test="fla_step_batch_invariance", dtype=str(dtype), in_place=in_place, alone_vs_in_batch=alone,
                  step_backend=kda.step_backend(DEVICE),
                  public_equals_fla_gather_scatter=torch.equal(public, batch) and torch.equal(public_pool, pool))
    report(**record)
    assert all(a["bitwise"] for a in alone.values()), record
    assert kda.step_backend(DEVICE) == "fla"
    if not in_place and not kda.FLA_STEP_IN_PLACE:
        assert record["public_equals_fla_gather_scatter"], record


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_prefill_then_decode_continues_the_stream():
    """Prefill through fla to a kept state, then four decode steps through fla: the same as the naive path."""
    _fla()
    H, DK, DV = GLM["H"], GLM["DK"], GLM["DV"]
    T, steps = 333, 4
    q, k, v, g, beta = rows(T + steps, H, DK, DV, DEVICE, seed=15)
    head, kept = fla_backend.chunk_kda(q[:T], k[:T], v[:T], g[:T], beta[:T], **l2(DK))
    ref_head, ref_kept = naive.chunk_kda(q[:T], k[:T], v[:T], g[:T], beta[:T], **l2(DK))
    pool, ref_pool = kept[None].clone(), ref_kept[None].clone()
    diffs = []
    for t in range(T, T + steps):
        row = (q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
        out = fla_backend.recurrent_kda_step(*row, pool, [0], **l2(DK))
        ref = naive.recurrent_kda_step(*row, ref_pool, [0], **l2(DK))
        diffs.append(relative(out, ref))
    record = dict(test="fla_prefill_then_decode", prefill_out=relative(head, ref_head),
                  prefill_state=relative(kept, ref_kept), step_out=diffs, state=relative(pool, ref_pool))
    report(**record)
    assert max(diffs) < 2e-2 and record["state"] < 2e-2, record


# ---------------------------------------------------------------- gates: extreme decays, fla's safe_gate


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_extreme_decays_stay_finite():
    """-50 per step (a chunk's cumulative decay reaches -3200) beside slow channels (-1e-3): fla's default path
    uses pairwise exp2(G_i - G_j) <= 1, like ours, so it stays finite and close to the truth."""
    _fla()
    H, DK, DV = GLM["H"], GLM["DK"], GLM["DV"]
    T = 300
    q, k, v, _, beta = rows(T, H, DK, DV, DEVICE, seed=17)
    g = torch.full((T, H, DK), -50.0, device=DEVICE)
    g[:, :, ::2] = -1e-3
    state = kept_state(1, H, DK, DV, DEVICE)[0]
    out, final = fla_backend.chunk_kda(q, k, v, g, beta, state, 9, **l2(DK))
    exact, exact_final = truth(q, k, v, g, beta, state, 9)
    record = dict(test="fla_extreme_decays", finite=bool(torch.isfinite(out).all() and torch.isfinite(final).all()),
                  out=relative(out, exact), state=relative(final, exact_final))
    report(**record)
    assert record["finite"] and record["out"] < 2e-2 and record["state"] < 2e-2, record


@DTYPES
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_fla_safe_gate_on_the_bounded_gate(dtype):
    """fla's safe_gate path (tensor cores on the diagonal blocks, factorised exponentials) on GLM's bounded gate
    (-5 < g < 0): close to the truth, and how far from the default path (recorded for the decision)."""
    _fla()
    H, DK, DV = GLM["H"], GLM["DK"], GLM["DV"]
    cu, starts = [0, 400, 1000], [0, 130]
    q, k, v, g, beta = rows(cu[-1], H, DK, DV, DEVICE, dtype, seed=18)
    state = kept_state(2, H, DK, DV, DEVICE)
    safe, safe_final = fla_backend.chunk_kda(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts, safe_gate=True,
                                             **l2(DK))
    plain, plain_final = fla_backend.chunk_kda(q, k, v, g, beta, state, cu_seqlens=cu, starts=starts, **l2(DK))
    exact, exact_final = truth(q, k, v, g, beta, state, cu=cu, starts=starts)
    record = dict(test="fla_safe_gate", dtype=str(dtype),
                  finite=bool(torch.isfinite(safe).all() and torch.isfinite(safe_final).all()),
                  safe_vs_truth_out=relative(safe, exact), safe_vs_truth_state=relative(safe_final, exact_final),
                  plain_vs_truth_out=relative(plain, exact), safe_vs_plain_out=relative(safe, plain))
    report(**record)
    assert record["finite"], record
    assert record["safe_vs_truth_out"] < _limit(dtype) and record["safe_vs_truth_state"] < _limit(dtype), record


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_public_chunk_dispatch():
    """backend=None on CUDA runs fla (when it imports) and gives fla_backend's bits; backend='naive' gives naive's."""
    _fla()
    H, DK, DV = GLM["H"], GLM["DK"], GLM["DV"]
    q, k, v, g, beta = rows(200, H, DK, DV, DEVICE, torch.bfloat16, seed=19)
    state = kept_state(1, H, DK, DV, DEVICE)[0]
    assert kda.chunk_backend(DEVICE) == "fla"
    auto = kda.chunk_kda(q, k, v, g, beta, state, 70, **l2(DK))
    direct = fla_backend.chunk_kda(q, k, v, g, beta, state, 70, **l2(DK))
    forced = kda.chunk_kda(q, k, v, g, beta, state, 70, backend="naive", **l2(DK))
    ref = naive.chunk_kda(q, k, v, g, beta, state, 70, **l2(DK))
    assert all(torch.equal(a, b) for a, b in zip(auto, direct, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(forced, ref, strict=True))
