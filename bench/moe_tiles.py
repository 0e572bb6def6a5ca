"""The routed experts' Triton tiles on the GPU at a real MoE shape: each candidate configuration timed on one prefill
chunk's rows, beside the "decode" and "prefill" kinds' own, one JSON line each (fastest first at the end).

    python bench/moe_tiles.py --out $OUT                       # Nemotron-3-Nano-30B-A3B's experts, 2,048 rows
    python bench/moe_tiles.py --hidden 2048 --inner 512 --experts 256 --top 8 --activation silu_gate
    python bench/moe_tiles.py --decode --rows 1 64 --hidden 2048 --inner 512 --experts 257 --top 9 \
        --activation silu_gate          # the "decode" kind's candidates, each timed as a CUDA graph replay
    (add --profile: the decode kind's kernels under torch.profiler instead, µs a call each)
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import attrs
import torch
import triton

from tensorfold.kernels.moe import triton_moe


def emit(out: Path | None, **record) -> None:
    """One JSON line to stdout and to --out/moe_tiles.jsonl."""
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        with open(out / "moe_tiles.jsonl", "a") as handle:
            handle.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="time the routed experts' tile configurations")
    parser.add_argument("--hidden", type=int, default=2688)
    parser.add_argument("--inner", type=int, default=1856)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--rows", type=int, nargs="+", default=[2048])
    parser.add_argument("--decode", action="store_true",
                        help="sweep the decode kind's candidates (16-row blocks) at each --rows, graph replays")
    parser.add_argument("--deep", action="store_true",
                        help="with --decode: sweep deeper K steps (E 128/256, F 64/128), 4/8 warps, 3-5 stages")
    parser.add_argument("--profile", action="store_true",
                        help="with --decode: the decode kind's kernels under torch.profiler at each --rows, "
                             "one moe_decode_kernel line per kernel (µs a call), instead of the sweep")
    parser.add_argument("--activation", default="relu2", choices=("relu2", "silu_gate"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.decode:
        for T in args.rows:
            (decode_kernels if args.profile else sweep_decode)(args, T)
        return
    E, F, k, T = args.hidden, args.inner, args.top, args.rows[0]
    dtype = torch.bfloat16
    width = F if args.activation == "relu2" else 2 * F
    x, chosen, weights, gate_up, down = expert_inputs(args, T, ordered=False)
    flops = 2 * T * k * (E * width + F * E)

    def timed(**kw) -> float:
        call = lambda: triton_moe.routed_experts(x, chosen, weights, gate_up, down, args.activation, **kw)  # noqa: E731
        return triton.testing.do_bench(call, warmup=5, rep=40)

    results = []
    for kind in triton_moe.KINDS:
        ms = timed(kind=kind)
        results.append((ms, kind))
        emit(args.out, bench="moe_tiles", kind=kind, rows=T, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
    base = triton_moe.config_for(E, F, dtype, "prefill")
    for block_m, block_n, block_k, warps, stages in itertools.product((64, 128), (64, 128), (64, 128), (4, 8),
                                                                       (3, 4)):
        if block_m == 128 and block_n == 128 and warps == 4:
            continue
        cfg = triton_moe.Config(block_f=block_n, block_k_e=block_k, block_e=block_n, block_k_f=block_k,
                                block_sum=base.block_sum, precision=base.precision, num_warps=warps,
                                block_m=block_m, num_stages=stages, grouped_only=True)
        tried(args, results, "moe_tiles", cfg, lambda c: timed(config=c), T, lambda ms: {
            "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)})
    for ms, name in sorted(results)[:5]:
        emit(args.out, bench="moe_tiles_best", config=name, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))


def tried(args: argparse.Namespace, results: list, bench: str, cfg, run, rows: int, figures) -> None:
    """One candidate timed (`run(cfg)`) and its line written (with `figures(ms)`), or its error recorded: a tile
    past the device's resources is not fatal."""
    try:
        ms = run(cfg)
    except Exception as error:
        emit(args.out, bench=bench, config=str(cfg), error=str(error)[:200])
        return
    results.append((ms, str(cfg)))
    emit(args.out, bench=bench, config=str(cfg), rows=rows, **figures(ms))


def expert_inputs(args: argparse.Namespace, T: int, ordered: bool = True) -> tuple[torch.Tensor, ...]:
    """x, chosen (ordered: ids ascending, as a routing kernel gives them), weights, gate_up, down at T rows on the
    GPU."""
    E, F, N, k = args.hidden, args.inner, args.experts, args.top
    dtype, device = torch.bfloat16, "cuda"
    width = F if args.activation == "relu2" else 2 * F
    x = torch.randn(T, E, dtype=dtype, device=device)
    gate_up = torch.randn(N, width, E, dtype=dtype, device=device) * E ** -0.5
    down = torch.randn(N, E, F, dtype=dtype, device=device) * F ** -0.5
    chosen = torch.rand(T, N, device=device).topk(k, dim=-1).indices
    weights = torch.rand(T, k, device=device).to(dtype)
    return x, chosen.sort(dim=-1).values if ordered else chosen, weights, gate_up, down


def decode_kernels(args: argparse.Namespace, T: int, calls: int = 50) -> None:
    """The decode kind's launches at T rows, each kernel's device time a call (where the experts' time goes)."""
    from profile_decode import kernel_totals  # bench/profile_decode.py, on sys.path here

    x, chosen, weights, gate_up, down = expert_inputs(args, T)

    def call() -> torch.Tensor:
        return triton_moe.routed_experts(x, chosen, weights, gate_up, down, args.activation, ordered=True)

    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    for name, (us, count) in sorted(kernel_totals(prof, calls).items(), key=lambda item: -item[1][0]):
        emit(args.out, bench="moe_decode_kernel", rows=T, name=name[:90], us=round(us, 2), calls=count)


def sweep_decode(args: argparse.Namespace, T: int) -> None:
    """The decode kind's config and its candidates at T rows (k pairs each, ids ascending as a routing kernel gives
    them), each call captured in a CUDA graph and timed by its replays (a decode step is replayed so)."""
    E, F, N, k = args.hidden, args.inner, args.experts, args.top
    dtype = torch.bfloat16
    width = F if args.activation == "relu2" else 2 * F
    x, chosen, weights, gate_up, down = expert_inputs(args, T)
    moved = (T * k if T * k < N else N) * (width * E + E * F) * 2          # weight bytes read, about

    def timed(config=None) -> float:
        def call():
            return triton_moe.routed_experts(x, chosen, weights, gate_up, down, args.activation, config=config,
                                             ordered=True)
        call()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(call, rep=40)

    base = triton_moe.config_for(E, F, dtype, "decode")
    results = [(timed(), "decode kind: " + str(base))]
    emit(args.out, bench="moe_tiles_decode", config=results[0][1], rows=T, ms=round(results[0][0], 4),
         gb_s=round(moved / results[0][0] / 1e6, 1))
    grid = (itertools.product((32,), (32, 64), (128, 256), (4, 8), (3, 4, 5)) if args.deep else
            itertools.product((16, 32, 64), (32, 64), (64, 128), (2, 4), (3,)))
    for block_f, block_e, block_k, warps, stages in grid:
        cfg = attrs.evolve(base, block_f=block_f, block_e=block_e, block_k_e=block_k,
                           block_k_f=min(block_k // 2, 128) if args.deep else min(block_k, 64), num_warps=warps,
                           num_stages=stages)
        tried(args, results, "moe_tiles_decode", cfg, timed, T, lambda ms: {
            "ms": round(ms, 4), "gb_s": round(moved / ms / 1e6, 1)})
    for ms, name in sorted(results)[:5]:
        emit(args.out, bench="moe_tiles_decode_best", rows=T, config=name, ms=round(ms, 4))


if __name__ == "__main__":
    main()
