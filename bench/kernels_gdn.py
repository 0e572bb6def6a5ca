"""The gated delta rule kernels at Qwen3.5-9B's GDN shape (NK=16, NV=32, DK=DV=128): fla-core against ours.

Prints one JSON line per measurement (and appends them to --out/kernels_gdn.jsonl):
    env       versions, the GPU, fla's optional packages and FLA_* switches
    chunk     prefill of T rows (one stream, and the same rows as 4 varlen streams): ms, tokens/s, fla's first
              call (autotuning) ms, max |diff| against naive float32 and against a float64 truth, for bf16 and
              fp32 inputs (float32 state)
    step      a decode step of B streams in a pool: ms and state GB/s for naive, our triton kernel (in place),
              fla (gather + kernel + scatter) and fla's kernel alone; max |diff| against naive
    bitwise   the same call twice, and one stream alone vs inside the batch, for fla's chunked op and every step

    python bench/kernels_gdn.py [--lengths 2048 8192] [--batches 1 8 32 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorfold.kernels.gated_delta import fla_backend, naive

NK, NV, DK, DV = 16, 32, 128, 128
L2 = dict(qk_l2norm=True, scale=DK ** -0.5)      # raw q, k: normalised in the op, q scaled
OUT: Path | None = None


def emit(**record: object) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / "kernels_gdn.jsonl", "a") as handle:
            handle.write(line + "\n")


def rows(T: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Qwen-like inputs on the GPU: g = -A·softplus(a + dt_bias) float32, beta = sigmoid(.)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, NK, DK, generator=gen)
    k = torch.randn(T, NK, DK, generator=gen)
    v = torch.randn(T, NV, DV, generator=gen)
    A = torch.empty(NV).uniform_(1, 16, generator=gen)
    dt = torch.exp(torch.empty(NV).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    g = -A * F.softplus(torch.randn(T, NV, generator=gen) + dt + torch.log(-torch.expm1(-dt)))
    beta = torch.sigmoid(torch.randn(T, NV, generator=gen))
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
    state = (torch.randn(NV, DK, DV, generator=torch.Generator().manual_seed(1)) * 0.05).cuda()
    name = str(dtype).removeprefix("torch.")
    ref, ref_final = naive.chunk_gated_delta(q, k, v, g, beta, state, **L2)
    truth, truth_final = naive.chunk_gated_delta(q.double(), k.double(), v.double(), g, beta.double(), state,
                                                 **L2, math_dtype=torch.float64)
    naive_ms = timed_ms(lambda: naive.chunk_gated_delta(q, k, v, g, beta, state, **L2), repeats=3)
    emit(bench="chunk", impl="naive", dtype=name, T=T, ms=round(naive_ms, 3), tok_s=round(T / naive_ms * 1e3),
         vs_truth_out=worst(ref, truth), vs_truth_state=worst(ref_final, truth_final),
         out_max=float(truth.abs().max()))
    if not has_fla:
        return

    def fla_call(cu=None):
        initial = state if cu is None else state.expand(len(cu) - 1, -1, -1, -1)
        return fla_backend.chunk_gated_delta(q, k, v, g, beta, initial, cu_seqlens=cu, **L2)

    first = first_call_ms(fla_call)
    out, final = fla_call()
    fla_ms = timed_ms(fla_call)
    emit(bench="chunk", impl="fla", dtype=name, T=T, ms=round(fla_ms, 3), tok_s=round(T / fla_ms * 1e3),
         first_call_ms=round(first, 1), speedup_vs_naive=round(naive_ms / fla_ms, 1),
         vs_naive_out=worst(out, ref), vs_naive_state=worst(final, ref_final),
         vs_truth_out=worst(out, truth), vs_truth_state=worst(final, truth_final))
    aligned_ms = timed_ms(lambda: fla_backend.chunk_gated_delta(q, k, v, g, beta, state, 37, align_grid=True, **L2))
    emit(bench="chunk", impl="fla_align_grid", dtype=name, T=T, start=37, ms=round(aligned_ms, 3),
         overhead_vs_fla=round(aligned_ms / fla_ms, 3))
    quarter = T // 4
    cu = [0, quarter, 2 * quarter, 3 * quarter, T]
    varlen_ms = timed_ms(lambda: fla_call(cu=cu))
    emit(bench="chunk", impl="fla_varlen4", dtype=name, T=T, ms=round(varlen_ms, 3),
         tok_s=round(T / varlen_ms * 1e3))
    batch = fla_call(cu=cu)
    again = fla_call(cu=cu)
    alone = [fla_backend.chunk_gated_delta(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, **L2)
             for a, b in zip(cu, cu[1:], strict=False)]
    emit(bench="bitwise", op="fla_chunk", dtype=name, T=T, same_call_twice=same(fla_call(), (out, final)),
         varlen_twice=same(batch, again),
         alone_vs_in_batch=[same(alone[n][0], batch[0][cu[n]:cu[n + 1]]) and same(alone[n][1], batch[1][n])
                            for n in range(4)],
         alone_vs_in_batch_max_diff=max(worst(alone[n][0], batch[0][cu[n]:cu[n + 1]]) for n in range(4)))


def bench_step(B: int, dtype: torch.dtype, has_fla: bool, slots_total: int) -> None:
    from tensorfold.kernels.gated_delta import triton_recurrent
    q, k, v, g, beta = rows(B, dtype, seed=2)
    states = (torch.randn(slots_total, NV, DK, DV, generator=torch.Generator().manual_seed(3)) * 0.05).cuda()
    slots = torch.randperm(slots_total, generator=torch.Generator().manual_seed(4))[:B].cuda()
    name = str(dtype).removeprefix("torch.")
    state_bytes = 2 * B * NV * DK * DV * 4                                         # read + write, in place
    ref_pool = states.clone()
    ref = naive.recurrent_gated_delta_step(q, k, v, g, beta, ref_pool, slots, **L2)
    impls = {"naive": naive.recurrent_gated_delta_step, "triton": triton_recurrent.recurrent_gated_delta_step}
    if has_fla:
        impls["fla"] = fla_backend.recurrent_gated_delta_step
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
    if has_fla:
        ops = fla_backend._ops()
        initial = states.index_select(0, slots)
        ms = timed_ms(lambda: ops.fused_recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], initial_state=initial,
            output_final_state=True, use_qk_l2norm_in_kernel=True), repeats=20)
        emit(bench="step", impl="fla_kernel_only", dtype=name, B=B, ms=round(ms, 4),
             state_gb_s=round(state_bytes / ms / 1e6, 1))


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description="gated delta rule kernels: fla-core vs ours")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    OUT = args.out
    if not torch.cuda.is_available():
        emit(bench="env", error="needs a CUDA device")
        return
    import triton
    has_fla = fla_backend.available()
    emit(bench="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
         shape=dict(NK=NK, NV=NV, DK=DK, DV=DV), **fla_backend.environment())
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            for T in args.lengths:
                bench_chunk(T, dtype, has_fla)
            for B in args.batches:
                bench_step(B, dtype, has_fla, slots_total=max(args.batches) * 2)


if __name__ == "__main__":
    main()
