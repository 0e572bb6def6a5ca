"""The body the delta-rule kernel benches (kernels_gdn.py, kernels_kda.py) share: each script supplies its op's
inputs and implementations, this module times them, compares them and writes the JSON lines, so both report the
same measurements in the same form."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from gpu import emit  # bench/gpu.py: the scripts run from bench/ on sys.path

Inputs = tuple[torch.Tensor, ...]
Chunk = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Step = Callable[..., torch.Tensor]


class Log:
    """One script's JSON-lines log: --out is known only after parsing, so `run` binds it."""

    def __init__(self, jsonl: str) -> None:
        self.jsonl = jsonl
        self.out: Path | None = None

    def __call__(self, **record: object) -> None:
        emit(self.out, self.jsonl, **record)


def timed_ms(fn: Callable[[], object], repeats: int = 10) -> float:
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


def first_call_ms(fn: Callable[[], object]) -> float:
    """Wall milliseconds of one call, synchronised: fla's first call includes its autotuning."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64, so the difference itself is not rounded."""
    return float((a.double() - b.double()).abs().max())


def same(a: tuple | torch.Tensor, b: tuple | torch.Tensor) -> bool:
    """Bit-for-bit equality of two results (a tensor or a tuple of them): what determinism is judged by."""
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def kept_states(shape: Sequence[int], seed: int) -> torch.Tensor:
    """Float32 states such as streams keep after some tokens (modest entries), on the GPU."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05).cuda()


def bench_chunk(log: Log, inputs: Inputs, state: torch.Tensor, naive_chunk: Chunk, fla_chunk: Chunk | None,
                options: dict[str, object]) -> None:
    """Prefill of T rows: naive float32 against a float64 truth, then fla (None: not installed) as one stream, on
    the absolute grid (align_grid), as 4 varlen streams, and bitwise: the same call twice, each stream alone."""
    q, k, v, g, beta = inputs
    T, name = q.shape[0], str(q.dtype).removeprefix("torch.")
    ref, ref_final = naive_chunk(q, k, v, g, beta, state, **options)
    truth, truth_final = naive_chunk(q.double(), k.double(), v.double(), g, beta.double(), state, **options,
                                     math_dtype=torch.float64)
    naive_ms = timed_ms(lambda: naive_chunk(q, k, v, g, beta, state, **options), repeats=3)
    log(bench="chunk", impl="naive", dtype=name, T=T, ms=round(naive_ms, 3), tok_s=round(T / naive_ms * 1e3),
        vs_truth_out=worst(ref, truth), vs_truth_state=worst(ref_final, truth_final),
        out_max=float(truth.abs().max()))
    if fla_chunk is None:
        return

    def fla_call(cu: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        initial = state if cu is None else state.expand(len(cu) - 1, -1, -1, -1)
        return fla_chunk(q, k, v, g, beta, initial, cu_seqlens=cu, **options)

    first = first_call_ms(fla_call)
    out, final = fla_call()
    fla_ms = timed_ms(fla_call)
    log(bench="chunk", impl="fla", dtype=name, T=T, ms=round(fla_ms, 3), tok_s=round(T / fla_ms * 1e3),
        first_call_ms=round(first, 1), speedup_vs_naive=round(naive_ms / fla_ms, 1),
        vs_naive_out=worst(out, ref), vs_naive_state=worst(final, ref_final),
        vs_truth_out=worst(out, truth), vs_truth_state=worst(final, truth_final))
    aligned_ms = timed_ms(lambda: fla_chunk(q, k, v, g, beta, state, 37, align_grid=True, **options))
    log(bench="chunk", impl="fla_align_grid", dtype=name, T=T, start=37, ms=round(aligned_ms, 3),
        overhead_vs_fla=round(aligned_ms / fla_ms, 3))
    quarter = T // 4
    cu = [0, quarter, 2 * quarter, 3 * quarter, T]
    varlen_ms = timed_ms(lambda: fla_call(cu=cu))
    log(bench="chunk", impl="fla_varlen4", dtype=name, T=T, ms=round(varlen_ms, 3),
        tok_s=round(T / varlen_ms * 1e3))
    batch = fla_call(cu=cu)
    again = fla_call(cu=cu)
    alone = [fla_chunk(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, **options)
             for a, b in zip(cu, cu[1:], strict=False)]
    log(bench="bitwise", op="fla_chunk", dtype=name, T=T, same_call_twice=same(fla_call(), (out, final)),
        varlen_twice=same(batch, again),
        alone_vs_in_batch=[same(alone[n][0], batch[0][cu[n]:cu[n + 1]]) and same(alone[n][1], batch[1][n])
                           for n in range(4)],
        alone_vs_in_batch_max_diff=max(worst(alone[n][0], batch[0][cu[n]:cu[n + 1]]) for n in range(4)))


def pool_slots(slots_total: int, batch: int) -> torch.Tensor:
    """`batch` distinct slots of the pool in random order, on the GPU."""
    return torch.randperm(slots_total, generator=torch.Generator().manual_seed(4))[:batch].cuda()


def bench_step(log: Log, inputs: Inputs, states: torch.Tensor, slots: torch.Tensor, impls: dict[str, Step],
               options: dict[str, object]) -> None:
    """A decode step of B streams in a pool, per implementation (impls["naive"] is the reference): ms and state
    GB/s (read + write), max |diff| against naive, and bitwise: the same call twice, the last stream alone."""
    q, k, v, g, beta = inputs
    B, name = q.shape[0], str(q.dtype).removeprefix("torch.")
    state_bytes = 2 * B * states[0].numel() * states.element_size()
    ref_pool = states.clone()
    ref = impls["naive"](q, k, v, g, beta, ref_pool, slots, **options)
    for impl, fn in impls.items():
        pool = states.clone()
        out = fn(q, k, v, g, beta, pool, slots, **options)
        pool2 = states.clone()
        out2 = fn(q, k, v, g, beta, pool2, slots, **options)
        alone_pool = states.clone()
        alone = fn(q[-1:], k[-1:], v[-1:], g[-1:], beta[-1:], alone_pool, slots[-1:], **options)
        scratch = states.clone()
        ms = timed_ms(lambda fn=fn, scratch=scratch: fn(q, k, v, g, beta, scratch, slots, **options),
                      repeats=3 if impl == "naive" else 20)
        last = int(slots[-1])
        log(bench="step", impl=impl, dtype=name, B=B, ms=round(ms, 4), state_gb_s=round(state_bytes / ms / 1e6, 1),
            vs_naive_out=worst(out, ref), vs_naive_state=worst(pool, ref_pool))
        log(bench="bitwise", op=f"{impl}_step", dtype=name, B=B,
            same_call_twice=same(out, out2) and same(pool, pool2),
            alone_vs_in_batch=same(alone[0], out[-1]) and same(alone_pool[last], pool[last]))


def run(log: Log, description: str, batches: list[int], backend, shape: dict[str, int],
        chunk: Callable[[int, torch.dtype, bool], None], step: Callable[[int, torch.dtype, bool, int], None]) -> None:
    """Parse the common options, then `chunk` at each length and `step` at each batch, bf16 then fp32; without
    CUDA one env line says so."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=batches)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    log.out = args.out
    if not torch.cuda.is_available():
        log(bench="env", error="needs a CUDA device")
        return
    import triton
    has_fla = backend.available()
    log(bench="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        shape=shape, **backend.environment())
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            for T in args.lengths:
                chunk(T, dtype, has_fla)
            for B in args.batches:
                step(B, dtype, has_fla, max(args.batches) * 2)
