"""Decode through the Engine against the DecodeRunner alone, on bench/gpu.py's random weights (same shapes, same
build), at 1/8/32/64/128 streams: how much of the kernels' speed the step loop hands on.

    runner   bench/gpu.py's measurement (gpu.our_decode): each stream prefilled with --prompt rows, then --new
             steps of one token per stream through a DecodeRunner captured for exactly that batch; tok/s = streams
             / seconds per step
    engine   the engine as `tensorfold serve` builds it (Engine over a DecodeRunner with CUDA graphs for
             batch_sizes(--parallel), StreamMemory over a PagedStore, greedy Sampling, no kept-state tiers):
             B requests of --prompt random tokens and --new new tokens each, submitted at once; decode tok/s =
             the tokens reported after the last stream's first token, over the time from that token to the last
             one (the probe of issue 14). One engine serves every level (as one server does), warmed per level
             with a 2-token round; --engine-per-level builds one per level sized to it instead. Decode steps
             are launched ahead (TF_OVERLAP on, engine/ahead.py), as serve does by default
    engine_sync  the same engine with TF_OVERLAP off: each step's ids read back before the next is planned
    hf       HF transformers on the same weights (gpu.hf_decode: greedy, one token per stream per call with its
             cache), --hf-steps steps

Level by level (runner, engine, hf, then the ratios, so that a run cut short keeps the levels it finished): one JSON
line per (shape, path, streams) and one `engine_ratio` line per streams (engine / runner, engine / hf); appended to
--out/engine.jsonl.

    python bench/engine_gpu.py --shape qwen3_5-9b --out $OUT
    python bench/engine_gpu.py --shape qwen3_5-moe-35b --paths runner engine --out $OUT
    python bench/engine_gpu.py --shape qwen3_5-tiny --device cpu --dtype float32 --streams 1 4 --new 8 --hf-steps 4
"""

from __future__ import annotations

import argparse
import math
import queue
import statistics
import time
from pathlib import Path

import gpu  # bench/gpu.py: python puts the script's directory (bench/) first on sys.path
import torch
from gpu import SHAPES, hf_decode, hf_model, our_decode, ours_in_place_of, sync

from tensorfold.engine.api import ErrorEvent, Request, Sampling, TokenEvent
from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.engine.runner import Engine
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.settings import DEFAULT_PREFILL_CHUNK

PAGE_ROWS = 256
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def emit(out: Path | None, **record: object) -> None:
    gpu.emit(out, jsonl="engine.jsonl", **record)


class Bench:
    """An engine as `serve` builds it (no tiers) for `parallel` streams of `rows` rows at most."""

    def __init__(self, ours, layout, parallel: int, rows: int, context: int, chunk: int, graphs: bool) -> None:
        pages = parallel * (math.ceil(rows / PAGE_ROWS) + 1)
        kv = PagedStore(layout, parallel, pages, PAGE_ROWS, gpu.DEVICE)
        memory = StreamMemory(kv, SlotPool(parallel), PagePool(pages, PAGE_ROWS))
        self.runner = DecodeRunner(ours, kv, batch_sizes(parallel), context, graphs=graphs)
        began = time.perf_counter()
        self.runner.capture()
        self.capture_s = time.perf_counter() - began
        self.memory, self.chunk, self.context = memory, chunk, context
        self.overlap = True
        self.engine = Engine(self.runner, memory, chunk, context, max_waiting=2 * parallel, overlap=True)
        self.engine.start()
        self.parallel = parallel
        self.vocab = ours.vocab_size
        self.rounds = 0

    def run(self, streams: int, prompt: int, new: int) -> dict[str, float]:
        """Submit `streams` requests at once and wait for all; the timings of their tokens."""
        self.rounds += 1
        generator = torch.Generator().manual_seed(self.rounds)
        prompts = torch.randint(0, self.vocab, (streams, prompt), generator=generator).tolist()
        stamps: list[list[float]] = [[] for _ in range(streams)]
        finished: queue.SimpleQueue = queue.SimpleQueue()
        errors: list[str] = []

        def handler(i: int):
            mine = stamps[i]

            def on_event(event: object) -> None:
                if isinstance(event, TokenEvent):
                    mine.append(time.perf_counter())
                    return
                if isinstance(event, ErrorEvent):
                    errors.append(event.message)
                finished.put(i)
            return on_event

        sampling = Sampling(temperature=0.0, max_tokens=new)
        replays = self.runner.replays
        ahead = self.runner.ahead
        sync()
        began = time.perf_counter()
        for i in range(streams):
            self.engine.submit(Request(f"b{self.rounds}-{i}", tuple(prompts[i]), sampling, handler(i)))
        for _ in range(streams):
            finished.get(timeout=900)
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, the first: {errors[0]}")
        if any(len(s) != new for s in stamps):
            raise RuntimeError(f"expected {new} tokens per stream, got {sorted({len(s) for s in stamps})}")
        firsts = [s[0] for s in stamps]
        last_first, end, first_done = max(firsts), max(s[-1] for s in stamps), min(s[-1] for s in stamps)
        after = sum(1 for s in stamps for t in s if t > last_first)
        full = sum(1 for s in stamps for t in s if last_first < t <= first_done)
        ttfts = sorted((t - began) * 1e3 for t in firsts)
        return {"tok_s": after / (end - last_first) if end > last_first else float("nan"),
                "full_batch_tok_s": full / (first_done - last_first) if first_done > last_first else None,
                "ttft_p50_ms": statistics.median(ttfts), "ttft_max_ms": ttfts[-1],
                "output_tok_s": streams * new / (end - began), "wall_s": end - began,
                "decode_tokens_counted": after, "replays": self.runner.replays - replays,
                "ahead": self.runner.ahead - ahead}

    def use(self, overlap: bool) -> None:
        """Serve the next runs from an engine with steps launched ahead (TF_OVERLAP on) or read back first."""
        if overlap == self.overlap:
            return
        self.engine.close()
        self.engine = Engine(self.runner, self.memory, self.chunk, self.context, max_waiting=2 * self.parallel,
                             overlap=overlap)
        self.engine.start()
        self.overlap = overlap

    def close(self) -> None:
        self.engine.close()


def r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def main() -> None:
    parser = argparse.ArgumentParser(description="Engine vs DecodeRunner decode tok/s on random weights")
    parser.add_argument("--shape", default="qwen3_5-9b", choices=sorted(SHAPES))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128, help="new tokens per stream (and runner steps)")
    parser.add_argument("--context", type=int, default=4096, help="the engine's context (serve's default)")
    parser.add_argument("--chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help="prefill chunk (serve's default)")
    parser.add_argument("--hf-steps", type=int, default=32, help="HF decode steps per batch; 0 skips HF")
    parser.add_argument("--engine-per-level", action="store_true",
                        help="a fresh engine per level sized to it (the issue's probe), not one for all")
    parser.add_argument("--no-graphs", action="store_true", help="eager decode on the same padded buffers")
    parser.add_argument("--paths", nargs="+", default=["runner", "engine", "engine_sync", "hf"],
                        choices=["runner", "engine", "engine_sync", "hf"],
                        help="engine: steps launched ahead (TF_OVERLAP on, serve's default); engine_sync: off")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gpu.DEVICE = args.device
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    graphs = not args.no_graphs
    torch.manual_seed(0)
    began = time.perf_counter()
    hf, config = hf_model(args.shape, DTYPES[args.dtype])
    params = sum(p.numel() for p in hf.parameters())
    hf_tok_s: dict[int, float] = {}
    if "hf" in args.paths and args.hf_steps > 0:        # HF first: ours then takes its tensors (ours_in_place_of)
        with torch.inference_mode():
            hf_tok_s = {n: n / hf_decode(hf, n, args.prompt, args.hf_steps) for n in args.streams}
    ours, layout = ours_in_place_of(hf, config, args.shape, DTYPES[args.dtype])
    del hf
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    emit(args.out, bench="engine_setup", shape=args.shape, device=device, dtype=args.dtype, params=params,
         streams=args.streams, prompt=args.prompt, new=args.new, context=args.context, graphs=graphs,
         engine_per_level=args.engine_per_level, build_s=round(time.perf_counter() - began, 1))
    base = {"bench": "engine_decode", "shape": args.shape}
    rows = args.prompt + args.new
    bench: Bench | None = None
    with torch.inference_mode():
        for streams in args.streams:                 # level by level, so that a run cut short keeps its ratios
            got: dict[str, float | None] = dict.fromkeys(("runner", "engine", "engine_sync", "hf"))
            if "runner" in args.paths:
                seconds = our_decode(ours, layout, streams, args.prompt, args.new, args.chunk, graphs=graphs)
                got["runner"] = streams / seconds
                emit(args.out, **base, path="runner", streams=streams, tok_s=r(streams / seconds),
                     step_ms=r(seconds * 1e3, 3))
            for path in ("engine", "engine_sync"):
                if path not in args.paths:
                    continue
                if bench is None or args.engine_per_level:
                    if bench is not None:
                        bench.close()
                        bench = None
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                    parallel = streams if args.engine_per_level else max(args.streams)
                    bench = Bench(ours, layout, parallel, rows, args.context, args.chunk, graphs)
                    emit(args.out, bench="engine_capture", shape=args.shape, parallel=parallel,
                         sizes=len(bench.runner.sizes), capture_s=round(bench.capture_s, 2))
                bench.use(overlap=path == "engine")
                bench.run(streams, args.prompt, 2)                    # warm: this level's prefill shapes
                run = bench.run(streams, args.prompt, args.new)
                got[path] = run["tok_s"]
                emit(args.out, **base, path=path, streams=streams, parallel=bench.parallel,
                     tok_s=r(run["tok_s"]), full_batch_tok_s=r(run["full_batch_tok_s"]),
                     output_tok_s=r(run["output_tok_s"]), ttft_p50_ms=r(run["ttft_p50_ms"], 2),
                     ttft_max_ms=r(run["ttft_max_ms"], 2), wall_s=r(run["wall_s"], 3),
                     decode_tokens_counted=run["decode_tokens_counted"], graph_replays=run["replays"],
                     steps_ahead=run["ahead"])
            if streams in hf_tok_s:
                got["hf"] = hf_tok_s[streams]
                emit(args.out, **base, path="hf", streams=streams, tok_s=r(got["hf"]), steps=args.hf_steps)
            runner, engine, hf_s, sync_s = got["runner"], got["engine"], got["hf"], got["engine_sync"]
            emit(args.out, bench="engine_ratio", shape=args.shape, streams=streams, runner_tok_s=r(runner),
                 engine_tok_s=r(engine), engine_sync_tok_s=r(sync_s), hf_tok_s=r(hf_s),
                 engine_over_runner=r(engine / runner, 3) if engine and runner else None,
                 engine_sync_over_runner=r(sync_s / runner, 3) if sync_s and runner else None,
                 engine_over_hf=r(engine / hf_s, 2) if engine and hf_s else None,
                 runner_over_hf=r(runner / hf_s, 2) if runner and hf_s else None)
    if bench is not None:
        bench.close()
    if args.device == "cuda":
        emit(args.out, bench="engine_memory", shape=args.shape, peak_gpu_bytes=torch.cuda.max_memory_allocated())


if __name__ == "__main__":
    main()
