"""The routed experts' Triton tiles on the GPU at a real MoE shape: each candidate configuration timed on one prefill
chunk's rows, beside the "decode" and "prefill" kinds' own, one JSON line each (fastest first at the end).

    python bench/moe_tiles.py --out $OUT                       # Nemotron-3-Nano-30B-A3B's experts, 2,048 rows
    python bench/moe_tiles.py --hidden 2048 --inner 512 --experts 256 --top 8 --activation silu_gate
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

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
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--activation", default="relu2", choices=("relu2", "silu_gate"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    E, F, N, k, T = args.hidden, args.inner, args.experts, args.top, args.rows
    dtype, device = torch.bfloat16, "cuda"
    width = F if args.activation == "relu2" else 2 * F
    x = torch.randn(T, E, dtype=dtype, device=device)
    gate_up = torch.randn(N, width, E, dtype=dtype, device=device) * E ** -0.5
    down = torch.randn(N, E, F, dtype=dtype, device=device) * F ** -0.5
    chosen = torch.rand(T, N, device=device).topk(k, dim=-1).indices
    weights = torch.rand(T, k, device=device).to(dtype)
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
        try:
            ms = timed(config=cfg)
        except Exception as error:  # out of shared memory for a large tile: recorded, not fatal
            emit(args.out, bench="moe_tiles", config=str(cfg), error=str(error)[:200])
            continue
        results.append((ms, str(cfg)))
        emit(args.out, bench="moe_tiles", config=str(cfg), rows=T, ms=round(ms, 3),
             tflops=round(flops / ms / 1e9, 1))
    for ms, name in sorted(results)[:5]:
        emit(args.out, bench="moe_tiles_best", config=name, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))


if __name__ == "__main__":
    main()
