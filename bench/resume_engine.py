"""TTFT of a next turn at a real shape, in process: the engine with its real tiers, on random weights (no checkpoint
on disk, so the 9B shape fits a short device call). bench/resume.py measures the same through a server.

For each history length L: cold = the next turn (L history rows + NEW rows) on an engine with no tiers; device /
host = the history sent first on an engine with only that tier (its state kept at L), then the next turn, which
resumes at L. Also the measured pinned host -> device copy bandwidth, and for the host resume the bytes restored
over the extra time it took beside the device resume (the tier's achieved GB/s, an estimate).
One JSON line per measurement.

    python bench/resume_engine.py --shape qwen3_5-9b --lengths 2048 8192 32768 --out $OUT
"""

from __future__ import annotations

import argparse
import queue
import time
from pathlib import Path

import gpu  # bench/gpu.py: this script runs from bench/ on sys.path
import torch
from gpu import SHAPES, build, sync

from tensorfold.engine.api import KeepMarks, Request, Sampling, TokenEvent
from tensorfold.engine.memory import StreamMemory
from tensorfold.engine.runner import Engine
from tensorfold.kv import PagedStore
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.tiers import DeviceTier, HostTier

NEW = 64
PAGE_ROWS = 256
FIRST = Sampling(temperature=0.0, max_tokens=1)


def emit(out: Path | None, **record: object) -> None:
    gpu.emit(out, jsonl="resume.jsonl", **record)


def engine(model, layout, context: int, chunk: int, device: str, tier: str | None) -> Engine:
    pages = 2 * -(-context // PAGE_ROWS)
    kv = PagedStore(layout, 2, pages, PAGE_ROWS, device)
    mem = StreamMemory(kv, SlotPool(2), PagePool(pages, PAGE_ROWS))
    host = HostTier(mem, 64 << 30) if tier == "host" else None
    kept = DeviceTier(mem, 64 << 30) if tier == "device" else None
    return Engine(model, mem, chunk, context, 4, min_chunk=256, tier=kept, host=host)


def first_token(eng: Engine, name: str, prompt: list[int], starts: tuple[int, ...]) -> tuple[float, int]:
    """Seconds from submit to the first token, and the rows the request resumed."""
    events: queue.Queue = queue.Queue()
    sync()
    began = time.perf_counter()
    eng.submit(Request(name, tuple(prompt), FIRST, events.put, starts=starts, marks=KeepMarks()))
    seconds, cached = None, 0
    while True:
        event = events.get(timeout=600)
        if isinstance(event, TokenEvent) and seconds is None:
            seconds = time.perf_counter() - began
        elif not isinstance(event, TokenEvent):
            if not hasattr(event, "cached_tokens"):
                raise RuntimeError(f"{name}: {event}")
            cached = event.cached_tokens
            break
    return seconds, cached


def pinned_bandwidth(device: str) -> float | None:
    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        sync()
        began = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - began)
    return src.numel() / best


def main() -> None:
    parser = argparse.ArgumentParser(description="TTFT cold vs resumed from each tier, in process")
    parser.add_argument("--shape", default="qwen3_5-9b", choices=sorted(SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gpu.DEVICE = args.device
    torch.manual_seed(0)
    hf, ours, layout, _, _ = build(args.shape, torch.bfloat16)
    del hf
    bandwidth = pinned_bandwidth(args.device)
    emit(args.out, bench="pinned_copy", device=args.device,
         gb_s=None if bandwidth is None else round(bandwidth / 1e9, 1))
    context = max(args.lengths) + NEW + 8
    vocab = ours.vocab_size
    for length in args.lengths:
        history = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        turn = history + torch.randint(3, vocab, (NEW,), generator=torch.Generator().manual_seed(7)).tolist()
        record = {"bench": "resume_ttft", "shape": args.shape, "history": length, "new": NEW}
        times = {}
        for tier in (None, "device", "host"):
            eng = engine(ours, layout, context, args.chunk, args.device, tier)
            eng.start()
            try:
                first_token(eng, "warm", turn[: args.chunk], ())
                if tier is not None:
                    first_token(eng, "history", history, ())
                seconds, cached = first_token(eng, "turn", turn, (length,))
                expected = length if tier is not None else 0
                if cached != expected:
                    raise RuntimeError(f"{tier or 'cold'}: resumed {cached} rows, expected {expected}")
                times[tier or "cold"] = seconds
                if tier == "host":
                    record["host_state_bytes"] = max(state.nbytes for state in eng.tiers[0].states)
            finally:
                eng.close()
        record |= {f"{k}_ms": round(v * 1e3, 2) for k, v in times.items()}
        record |= {"device_over_cold": round(times["device"] / times["cold"], 4),
                   "host_over_cold": round(times["host"] / times["cold"], 4)}
        extra = times["host"] - times["device"]
        if record.get("host_state_bytes") and extra > 0:
            record["host_restore_gb_s_estimate"] = round(record["host_state_bytes"] / extra / 1e9, 1)
        emit(args.out, **record)


if __name__ == "__main__":
    main()
