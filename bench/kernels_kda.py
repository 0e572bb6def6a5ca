"""Kimi Delta Attention kernels at GLM-5.3-Flash's KDA shape (H=64, DK=DV=128): fla-core against the naive form.

Prints one JSON line per measurement (and appends them to --out/kernels_kda.jsonl):
    env       versions, the GPU, fla's optional packages and FLA_* switches
    chunk     prefill of T rows (one stream, the same rows as 4 varlen streams, and fla with align_grid): ms,
              tokens/s, fla's first call (autotuning) ms, max |diff| against naive float32 and against a float64
              truth, for bf16 and fp32 inputs (float32 state; the decay GLM's bounded gate makes)
    step      a decode step of B streams in a pool: ms and state GB/s for naive and fla (gather/scatter and in
              place); max |diff| against naive
    bitwise   the same call twice, and one stream alone vs inside the batch

    python bench/kernels_kda.py [--lengths 2048 8192] [--batches 1 8 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tensorfold.kernels.kda import fla_backend, kda_gate, naive

H, DK, DV = 64, 128, 128
LOWER_BOUND = -5.0
L2 = dict(qk_l2norm=True, scale=DK ** -0.5)      # raw q, k: normalised in the op, q scaled
OUT: Path | None = None


def emit(**record: object) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / "kernels_kda.jsonl", "a") as handle:
            handle.write(line + "\n")


def rows(T: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """GLM-like inputs on the GPU: the bounded gate over a random projection, beta = sigmoid(.)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, DK, generator=gen)
    k = torch.randn(T, H, DK, generator=gen)
    v = torch.randn(T, H, DV, generator=gen)
    A_log = (0.5 + torch.rand(H, generator=gen)).log()
    dt_bias = -2.0 + 0.5 * torch.randn(H * DK, generator=gen)
    g, beta = kda_gate(torch.randn(T, H * DK, generator=gen), torch.randn(T, H, generator=gen), A_log, dt_bias,
                       LOWER_BOUND)
    return (q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), g.cuda(), beta.cuda().to(dtype))


def timed_ms(fn, repeats: int = 10) -> float:
    """Median milliseconds of `fn` over repeats (CUDA events), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def same(a: tuple | torch.Tensor, b: tuple | torch.Tensor) -> bool:
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def bench_chunk(T: int, dtype: torch.dtype, has_fla: bool) -> None:
    q, k, v, g, beta = rows(T, dtype)
    state = (torch.randn(H, DK, DV, generator=torch.Generator().manual_seed(1)) * 0.05).cuda()
    name = str(dtype).removeprefix("torch.")
    ref, ref_final = naive.chunk_kda(q, k, v, g, beta, state, **L2)
    truth, truth_final = naive.chunk_kda(q.double(), k.double(), v.double(), g, beta.double(), state, **L2,
                                         math_dtype=torch.float64)
    naive_ms = timed_ms(lambda: naive.chunk_kda(q, k, v, g, beta, state, **L2), repeats=3)
    emit(bench="chunk", impl="naive", dtype=name, T=T, ms=round(naive_ms, 3), tok_s=round(T / naive_ms * 1e3),
         vs_truth_out=worst(ref, truth), vs_truth_state=worst(ref_final, truth_final),
         out_max=float(truth.abs().max()))
    if not has_fla:
        return

    def fla_call(cu=None):
        initial = state if cu is None else state.expand(len(cu) - 1, -1, -1, -1).contiguous()
        return fla_backend.chunk_kda(q, k, v, g, beta, initial, cu_seqlens=cu, **L2)

    first = first_call_ms(fla_call)
    out, final = fla_call()
    fla_ms = timed_ms(fla_call)
    emit(bench="chunk", impl="fla", dtype=name, T=T, ms=round(fla_ms, 3), tok_s=round(T / fla_ms * 1e3),
         first_call_ms=round(first, 1), speedup_vs_naive=round(naive_ms / fla_ms, 1),
         vs_naive_out=worst(out, ref), vs_naive_state=worst(final, ref_final),
         vs_truth_out=worst(out, truth), vs_truth_state=worst(final, truth_final))
    aligned_ms = timed_ms(lambda: fla_backend.chunk_kda(q, k, v, g, beta, state, 37, align_grid=True, **L2))
    emit(bench="chunk", impl="fla_align_grid", dtype=name, T=T, start=37, ms=round(aligned_ms, 3),
         overhead_vs_fla=round(aligned_ms / fla_ms, 3))
    quarter = T // 4
    cu = [0, quarter, 2 * quarter, 3 * quarter, T]
    varlen_ms = timed_ms(lambda: fla_call(cu=cu))
    emit(bench="chunk", impl="fla_varlen4", dtype=name, T=T, ms=round(varlen_ms, 3),
         tok_s=round(T / varlen_ms * 1e3))
    batch = fla_call(cu=cu)
    again = fla_call(cu=cu)
    alone = [fla_backend.chunk_kda(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, **L2)
             for a, b in zip(cu, cu[1:], strict=False)]
    emit(bench="bitwise", op="fla_chunk", dtype=name, T=T, same_call_twice=same(fla_call(), (out, final)),
         varlen_twice=same(batch, again),
         alone_vs_in_batch=[same(alone[n][0], batch[0][cu[n]:cu[n + 1]]) and same(alone[n][1], batch[1][n])
                            for n in range(4)],
         alone_vs_in_batch_max_diff=max(worst(alone[n][0], batch[0][cu[n]:cu[n + 1]]) for n in range(4)))


def bench_step(B: int, dtype: torch.dtype, has_fla: bool, slots_total: int) -> None:
    q, k, v, g, beta = rows(B, dtype, seed=2)
    states = (torch.randn(slots_total, H, DK, DV, generator=torch.Generator().manual_seed(3)) * 0.05).cuda()
    slots = torch.randperm(slots_total, generator=torch.Generator().manual_seed(4))[:B].cuda()
    name = str(dtype).removeprefix("torch.")
    state_bytes = 2 * B * H * DK * DV * 4                                          # read + write
    ref_pool = states.clone()
    ref = naive.recurrent_kda_step(q, k, v, g, beta, ref_pool, slots.tolist(), **L2)
    impls = {"naive": lambda *a, **kw: naive.recurrent_kda_step(*a[:6], a[6].tolist(), **kw)}
    if has_fla:
        impls["fla"] = fla_backend.recurrent_kda_step
        impls["fla_in_place"] = lambda *a, **kw: fla_backend.recurrent_kda_step(*a, in_place=True, **kw)
    for impl, fn in impls.items():
        pool = states.clone()
        out = fn(q, k, v, g, beta, pool, slots, **L2)
        pool2 = states.clone()
        out2 = fn(q, k, v, g, beta, pool2, slots, **L2)
        alone_pool = states.clone()
        alone = fn(q[-1:], k[-1:], v[-1:], g[-1:], beta[-1:], alone_pool, slots[-1:], **L2)
        scratch = states.clone()
        ms = timed_ms(lambda fn=fn, scratch=scratch: fn(q, k, v, g, beta, scratch, slots, **L2),
                      repeats=3 if impl == "naive" else 20)
        last = int(slots[-1])
        emit(bench="step", impl=impl, dtype=name, B=B, ms=round(ms, 4), state_gb_s=round(state_bytes / ms / 1e6, 1),
             vs_naive_out=worst(out, ref), vs_naive_state=worst(pool, ref_pool))
        emit(bench="bitwise", op=f"{impl}_step", dtype=name, B=B,
             same_call_twice=same(out, out2) and same(pool, pool2),
             alone_vs_in_batch=same(alone[0], out[-1]) and same(alone_pool[last], pool[last]))


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description="KDA kernels: fla-core vs the naive form")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    OUT = args.out
    if not torch.cuda.is_available():
        emit(bench="env", error="needs a CUDA device")
        return
    import triton
    has_fla = fla_backend.available()
    emit(bench="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
         shape=dict(H=H, DK=DK, DV=DV), **fla_backend.environment())
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            for T in args.lengths:
                bench_chunk(T, dtype, has_fla)
            for B in args.batches:
                bench_step(B, dtype, has_fla, slots_total=max(args.batches) * 2)


if __name__ == "__main__":
    main()
