"""Masked attention's Triton tiles on the GPU at GLM-5.3-Flash's MLA widths (64 heads, qk and v head 256, bf16): each
candidate (BLOCK_M, BLOCK_N, warps, stages) with and without the empty-block test, timed on a prefill chunk, beside
the shipped config and the einsum form the CPU path runs; registers and spills from Triton's compiled kernel. One
JSON line each (`--out`: also masked_attention_tiles.jsonl there).

Cases: `causal` (the first 2,048-row chunk: every row selects all its causal keys, DSA's top-2048 keeps them all)
and `dsa` (a 2,048-row chunk ending at key 8,192: every row selects 2,048 random keys of its causal prefix).

    python bench/masked_attention_tiles.py --out $OUT
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import gpu  # bench/gpu.py: this script runs from bench/ on sys.path
import torch
import triton

from tensorfold.kernels.masked_attention import naive, triton_prefill

CANDIDATES = [(128, 64, 8, 2), (128, 64, 8, 1), (128, 32, 8, 2), (128, 128, 8, 1), (64, 64, 4, 2), (64, 64, 8, 2),
              (64, 32, 4, 2), (64, 128, 8, 2), (32, 64, 4, 2)]


def emit(out: Path | None, **record) -> None:
    """One JSON line to stdout and to --out/masked_attention_tiles.jsonl."""
    gpu.emit(out, jsonl="masked_attention_tiles.jsonl", **record)


def selection(T: int, S: int, top: int, device: str) -> torch.Tensor:
    """bool [T, S]: row r (at key S - T + r) keeps `top` random keys of its causal prefix (all when it has fewer)."""
    causal = torch.arange(S, device=device) <= torch.arange(S - T, S, device=device)[:, None]
    scores = torch.rand(T, S, device=device).masked_fill(~causal, -1.0)
    chosen = scores.topk(min(top, S), dim=-1).indices
    mask = torch.zeros(T, S, dtype=torch.bool, device=device)
    mask.scatter_(1, chosen, True)
    return mask & causal


def main() -> None:
    parser = argparse.ArgumentParser(description="time masked attention's tile configurations")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dq", type=int, default=256)
    parser.add_argument("--dv", type=int, default=256)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--top", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    H, DQ, DV, T = args.heads, args.dq, args.dv, args.rows
    dtype, device, scale = torch.bfloat16, "cuda", args.dq ** -0.5
    for case, S in (("causal", T), ("dsa", 4 * T)):
        q = torch.randn(T, H, DQ, dtype=dtype, device=device)
        k, v = torch.randn(S, H, DQ + DV, dtype=dtype, device=device).split([DQ, DV], dim=-1)
        mask = selection(T, S, args.top, device)
        bits = triton_prefill.pack_mask(mask)
        flops = 2 * H * (DQ + DV) * int(mask.sum())            # the selected pairs' dots
        ref = naive.masked_attention(q, k, v, mask, scale)
        shipped = triton_prefill.config(DQ, DV, dtype)
        ms = triton.testing.do_bench(functools.partial(naive.masked_attention, q, k, v, mask, scale), warmup=3,
                                     rep=30)
        emit(args.out, bench="masked_attention_tiles", case=case, rows=T, keys=S, form="einsum", ms=round(ms, 3),
             tflops=round(flops / ms / 1e9, 1))
        for tiles in [shipped] + [c for c in CANDIDATES if c != shipped]:
            for skip in (True, False):
                out = torch.empty(T, H, DV, dtype=dtype, device=device)
                try:
                    compiled = triton_prefill.launch(q, k, v, bits, out, scale, tiles, skip)
                    call = functools.partial(triton_prefill.launch, q, k, v, bits, out, scale, tiles, skip)
                    ms = triton.testing.do_bench(call, warmup=3, rep=30)
                except Exception as error:  # noqa: BLE001  (a config that does not compile or fit: say so, go on)
                    emit(args.out, bench="masked_attention_tiles", case=case, tiles=list(tiles), skip_empty=skip,
                         error=f"{type(error).__name__}: {str(error)[:200]}")
                    continue
                emit(args.out, bench="masked_attention_tiles", case=case, rows=T, keys=S, form="triton",
                     tiles=list(tiles), skip_empty=skip, shipped=tiles == shipped, ms=round(ms, 3),
                     tflops=round(flops / ms / 1e9, 1), n_regs=getattr(compiled, "n_regs", None),
                     n_spills=getattr(compiled, "n_spills", None),
                     max_err=round(float((out.float() - ref.float()).abs().max()), 5))


if __name__ == "__main__":
    main()
