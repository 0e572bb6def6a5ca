"""Tensor parallelism on two GPUs (issue 20): our engine at TP=2 against TP=1 on the same random weights.

Each world runs SPMD in spawned processes (rank r on cuda:r over NCCL, or on the CPU over gloo): every rank builds
HF's model of the shape with the same seed (so the same bits), drops it for its own part of ours (the family's
TensorParallel cuts over HF's tensors), then runs the same steps in lockstep; rank 0 writes the lines. The worlds
run one after another (TP=1 first), each in processes of its own, so a world's memory is free before the next
starts. NVLink multicast stays off (MULTICAST_OFF: NCCL_NVLS_ENABLE=0 and two more) in every rank before NCCL
starts, and TORCH_NCCL_AVOID_RECORD_STREAMS=1 unless given (the all-gathers are captured in CUDA graphs). A world
above 1 whose graphs fail runs again eagerly (its `tp_run` lines say so). One JSON line per measurement
(bench/gpu.py's emit), in --out/tp.jsonl:

    tp_run       per world run (parent): exit codes, seconds, whether decode ran from graphs
    tp_world     device, NCCL version and settings, load seconds, whether every rank built the same weights
    tp_decode    tok/s at each --streams through the DecodeRunner (CUDA graphs on the GPU, capturing the
                 reductions); the reductions one decode step makes (count, bytes) and their time alone, eager and
                 replayed from a CUDA graph, per step
    tp_prefill   tok/s of one stream's prefill at each --prefill rows
    tp_greedy    (TP=2) both ranks sampled the same greedy tokens
    tp_tokens    per prompt (parent, with both worlds): TP=2's greedy tokens against TP=1's, the first divergence
                 and TP=1's logit margin (top over runner-up) there; tp_tokens_all sums them up
    tp_memory    peak GPU bytes of rank 0
    tp_scaling   per decode streams and prefill rows (parent): TP=2 tok/s / (2 × TP=1 tok/s)

    device:  python bench/tp_gpu.py --shape qwen3_5-9b --world 1 2 --out $OUT      (bench/tp_gpu.sh: every shape)
    smoke:   python bench/tp_gpu.py --device cpu --shape qwen3_5-tiny --world 1 2 --streams 1 2 --prefill 64 \\
                 --prompts 2 --prompt-rows 24 --tokens 4 --decode-prompt 8 --steps 2
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path

import glm_gpu  # bench/glm_gpu.py and bench/gpu.py: this script runs from bench/ on sys.path
import gpu
import torch
import torch.distributed as dist
from gpu import SHAPES, TensorsCheckpoint, emit, hf_model, our_decode, our_prefill, our_store, sync, timed

from tensorfold.engine.graphs import DecodeRunner, has_decode
from tensorfold.follow.channel import backend_for, join, leave
from tensorfold.follow.rank import load_rank
from tensorfold.plan import DecodeBatch, StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.ports import free_port
from tensorfold.shard import SINGLE, Shard
from tensorfold.testing.cuda_graphs import captured

GLM_SHAPES = {"glm5_next-8l-64e": (8, 64, False), "glm5_next-tiny": (4, 8, True)}   # layers, experts, small
JSONL = "tp.jsonl"
SEED = 0
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Recording:
    """A Shard whose reductions note their input's shape and dtype: a decode step's collectives, as they are."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.calls: list[tuple[tuple[int, ...], torch.dtype]] = []

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((tuple(x.shape), x.dtype))
        return self.shard.reduce(x)

    def __getattr__(self, name: str):
        return getattr(self.shard, name)


def unfuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GLM's fused experts (gate_up [N, 2F, E], down [N, E, F]) as the per-expert tensors of its on-disk form, which
    its TP rules cut (parallel.check_form refuses the fused form above TP=1); views, no copies."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = tensor[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def hf_tensors(shape: str, dtype: torch.dtype) -> tuple[str, dict, dict[str, torch.Tensor], int]:
    """(family, config dict, HF's text tensors in a form the family's TP rules cut, parameter count), HF's own
    module dropped so that only the tensors hold the memory."""
    if shape in GLM_SHAPES:
        layers, experts, small = GLM_SHAPES[shape]
        hf, config, _ = glm_gpu.hf_glm(layers, experts, dtype, small)
        state = unfuse_experts({n: t for n, t in hf.state_dict().items() if ".visual." not in n})
        family = "glm"
    else:
        hf, config = hf_model(shape, dtype)
        state = dict(hf.state_dict())
        family = SHAPES[shape][0]
    params = sum(p.numel() for n, p in hf.named_parameters() if ".visual." not in n)
    hf.to("meta")
    del hf
    gc.collect()
    return family, config.to_dict(), state, params


def fingerprint(state: dict[str, torch.Tensor]) -> int:
    """One number from every tensor's bits (each tensor's bits summed as integers, weighted by its position): equal
    for equal weights, whatever order a device or a thread count adds them in."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return sum(int(t.view(bits[t.element_size()]).sum(dtype=torch.int64)) * (i + 1)
               for i, (_, t) in enumerate(sorted(state.items())))


def prompt_set(count: int, rows: int, vocab: int) -> list[list[int]]:
    """`count` prompts of rising lengths up to `rows`, from a fixed generator (the same on every rank and world)."""
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (max(2, rows * (i + 1) // count),), generator=generator).tolist()
            for i in range(count)]


def greedy(ours, layout, prompts: list[list[int]], tokens: int, chunk: int, graphs: bool) -> dict:
    """Each prompt's `tokens` greedy tokens (prefill through `forward`, then every stream's decode steps together
    through the DecodeRunner), and at each the top two logits and their ids."""
    n = len(prompts)
    context = max(map(len, prompts)) + tokens + 1
    store = our_store(layout, n, context)
    ids: list[list[int]] = [[] for _ in prompts]
    top: list[list[list[float]]] = [[] for _ in prompts]
    top_ids: list[list[list[int]]] = [[] for _ in prompts]

    def take(slot: int, row: torch.Tensor) -> None:
        values, picked = row.float().topk(2)
        ids[slot].append(int(row.argmax()))
        top[slot].append(values.tolist())
        top_ids[slot].append(picked.tolist())

    for slot, prompt in enumerate(prompts):
        for a in range(0, len(prompt), chunk):
            out = ours.forward(StepPlan((StreamStep(slot, a, prompt[a: a + chunk], sample=a + chunk >= len(prompt)),)),
                               store)
        take(slot, out[0])
    runner = ours
    if has_decode(ours):
        runner = DecodeRunner(ours, store, (n,), context, graphs=graphs)
        runner.capture()
    for step in range(tokens - 1):
        plan = StepPlan(tuple(StreamStep(s, len(prompts[s]) + step, (ids[s][-1],)) for s in range(n)))
        out = runner.forward(plan, store)
        for slot in range(n):
            take(slot, out[slot])
    return {"ids": ids, "top": top, "top_ids": top_ids, "prompt_rows": [len(p) for p in prompts]}


def decode_reductions(ours, layout, batch: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The reductions one decode step of `batch` streams makes (shape, dtype each), from one eager `decode` on
    all-padding rows (slot -1: no state read or written)."""
    store = our_store(layout, batch, 16)
    zeros = torch.zeros(batch, dtype=torch.int64, device=gpu.DEVICE)
    padding = DecodeBatch(tokens=zeros, positions=zeros, slots=zeros - 1,
                          tables=torch.zeros((batch, store.table_width(16)), dtype=torch.int32, device=gpu.DEVICE))
    recording = Recording(ours.shard)
    ours.shard = recording
    try:
        ours.decode(padding, store)
    finally:
        ours.shard = recording.shard
    return recording.calls


def reduce_seconds(shard: Shard, calls: list[tuple[tuple[int, ...], torch.dtype]], steps: int,
                   graphs: bool) -> float:
    """Seconds per decode step of the step's reductions alone: eager, or replayed from one CUDA graph per step."""
    inputs = [torch.randn(shape, device=gpu.DEVICE).to(dtype) for shape, dtype in calls]

    def run() -> None:
        for x in inputs:
            shard.reduce(x)

    once = run
    if graphs:
        once = captured(run)[0].replay
    once()
    return timed(lambda: [once() for _ in range(steps)], repeats=3) / steps


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One rank of a world: join, build, load its part, then every measurement in lockstep with the others."""
    os.environ.update(MULTICAST_OFF)                    # before any NCCL communicator exists: no NVLink multicast
    os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")   # no record_stream on tensors a graph captures
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        gpu.DEVICE = f"cuda:{rank}"
    else:
        gpu.DEVICE = "cpu"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device(gpu.DEVICE)
    shard = SINGLE
    if world > 1:
        shard = join(rank, world, f"tcp://127.0.0.1:{port}", args.timeout_s, backend_for(device)).shard
    dtype = getattr(torch, args.dtype)
    graphs = cuda and not args.eager
    out: Path = args.out
    say = rank == 0

    def line(bench: str, **record: object) -> None:
        if say:
            emit(out, JSONL, bench=bench, shape=args.shape, world=world, **record)

    began = time.perf_counter()
    torch.manual_seed(SEED)
    family_name, config, state, params = hf_tensors(args.shape, dtype)
    family = load_families([family_name])[family_name]
    refusals = family.tp_refusals(config, world)
    if refusals:
        raise SystemExit(f"{args.shape} at TP={world}: " + "; ".join(refusals))
    mark = fingerprint(state)
    marks = [mark]
    if world > 1:
        marks = [None] * world
        dist.all_gather_object(marks, mark)
    ours, layout = load_rank(family, TensorsCheckpoint(config, state, consume=True), dtype, device, shard)
    del state
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    sync()
    line("tp_world", device=torch.cuda.get_device_name() if cuda else "cpu", dtype=args.dtype,
         backend=backend_for(device) if world > 1 else None,
         nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
         nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
         torch_nccl_avoid_record_streams=os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS"), params=params,
         load_s=round(time.perf_counter() - began, 1), same_weights_on_ranks=len(set(marks)) == 1)
    result: dict = {"fingerprint": mark, "graphs": graphs, "decode": {}, "prefill": {}}
    with torch.inference_mode():
        prompts = prompt_set(args.prompts, args.prompt_rows, ours.vocab_size)
        result["greedy"] = greedy(ours, layout, prompts, args.tokens, args.chunk, graphs)
        if world > 1:
            ids = [None] * world
            dist.all_gather_object(ids, result["greedy"]["ids"])
            line("tp_greedy", ranks_agree=all(i == ids[0] for i in ids))
        for streams in args.streams:
            torch.manual_seed(SEED + streams)          # every rank feeds the same tokens
            seconds = our_decode(ours, layout, streams, args.decode_prompt, args.steps, args.chunk, graphs)
            result["decode"][streams] = streams / seconds
            record = {"streams": streams, "tok_s": round(streams / seconds, 1), "step_ms": round(seconds * 1e3, 3),
                      "graphs": graphs and has_decode(ours)}
            if has_decode(ours):
                calls = decode_reductions(ours, layout, streams)
                record |= {"reductions": len(calls),
                           "reduce_bytes": sum(torch.Size(s).numel() * d.itemsize for s, d in calls)}
                if world > 1:
                    eager = reduce_seconds(shard, calls, args.steps, graphs=False)
                    record["reduce_eager_ms"] = round(eager * 1e3, 3)
                    if cuda:
                        replayed = reduce_seconds(shard, calls, args.steps, graphs=True)
                        record |= {"reduce_graph_ms": round(replayed * 1e3, 3),
                                   "reduce_share": round(replayed / seconds, 3)}
            line("tp_decode", **record)
        for rows in args.prefill:
            torch.manual_seed(SEED + rows)
            seconds = our_prefill(ours, layout, rows, args.chunk)
            result["prefill"][rows] = rows / seconds
            line("tp_prefill", rows=rows, chunk=args.chunk, tok_s=round(rows / seconds, 1))
    if cuda:
        line("tp_memory", peak_gpu_bytes=torch.cuda.max_memory_allocated())
    if say:
        (out / f"tp{world}-{args.shape}.json").write_text(json.dumps(result))
    if world > 1:
        sync()
        leave()


def spawn_world(world: int, args: object, target: Callable[..., None] = run_rank) -> list[int | None]:
    """`target(rank, world, port, args)` for every rank of one world in a spawned process, on a free local port;
    their exit codes. When one fails the others are killed at once: a rank left in a collective waits for its
    timeout, in a CUDA graph for ever."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=target, args=(rank, world, port, args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    running = list(procs)
    while running:
        wait([proc.sentinel for proc in running])
        for proc in [proc for proc in running if not proc.is_alive()]:
            running.remove(proc)
            if proc.exitcode != 0:
                for other in running:
                    other.kill()
    for proc in procs:
        proc.join()
    return [proc.exitcode for proc in procs]


def compare(one: dict, two: dict) -> list[dict]:
    """Per prompt: whether TP=2's greedy tokens equal TP=1's, the first index where they differ, TP=1's and TP=2's
    margins there (top logit over the runner-up), and the largest difference of the top logit before it."""
    found = []
    a, b = one["greedy"], two["greedy"]
    for i, (x, y) in enumerate(zip(a["ids"], b["ids"], strict=True)):
        first = next((k for k, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), None)
        end = len(x) if first is None else first
        record = {"prompt": i, "prompt_rows": a["prompt_rows"][i], "tokens": len(x), "equal": first is None,
                  "first_divergence": first,
                  "top_logit_max_diff": max((abs(a["top"][i][k][0] - b["top"][i][k][0]) for k in range(end)),
                                            default=0.0)}
        if first is not None:
            record |= {"tp1_margin": a["top"][i][first][0] - a["top"][i][first][1],
                       "tp2_margin": b["top"][i][first][0] - b["top"][i][first][1],
                       "tp1_top2_ids": a["top_ids"][i][first], "tp2_top2_ids": b["top_ids"][i][first]}
        found.append(record)
    return found


def scaling(one: dict, two: dict) -> list[dict]:
    """TP=2 tok/s / (2 × TP=1 tok/s) for every decode streams and prefill rows both worlds measured (a decode's
    `graphs`: whether each world's ran from CUDA graphs)."""
    found = []
    for what, key in (("decode", "streams"), ("prefill", "rows")):
        for size, tok_s in one[what].items():
            if size in two[what]:
                graphs = {"graphs": [one.get("graphs"), two.get("graphs")]} if what == "decode" else {}
                found.append({"what": what, key: int(size), **graphs, "tp1_tok_s": round(tok_s, 1),
                              "tp2_tok_s": round(two[what][size], 1),
                              "efficiency": round(two[what][size] / (2 * tok_s), 3)})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description="TP=2 against TP=1: greedy tokens, decode and prefill tok/s")
    parser.add_argument("--shape", default="qwen3_5-9b", choices=sorted(SHAPES | GLM_SHAPES))
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2], help="worlds, run in this order")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prefill", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--prompts", type=int, default=8, help="greedy prompts")
    parser.add_argument("--prompt-rows", type=int, default=512, help="the longest greedy prompt")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--decode-prompt", type=int, default=128, help="rows each stream holds before timed decode")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a collective's timeout")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    os.environ.update(MULTICAST_OFF)
    args.out = args.out or Path(tempfile.mkdtemp(prefix="tp-gpu-"))
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for world in args.world:
        found = args.out / f"tp{world}-{args.shape}.json"
        graphs = args.device == "cuda" and not args.eager
        # a world above 1 that fails with graphs runs again without: its tokens and eager tok/s still count
        for eager in [args.eager, True][: 2 if graphs and world > 1 else 1]:
            found.unlink(missing_ok=True)
            began = time.perf_counter()
            codes = spawn_world(world, argparse.Namespace(**{**vars(args), "eager": eager}))
            emit(args.out, JSONL, bench="tp_run", shape=args.shape, world=world, graphs=graphs and not eager,
                 exit_codes=codes, seconds=round(time.perf_counter() - began, 1))
            if codes == [0] * world and found.exists():
                results[world] = json.loads(found.read_text())
                break
    if 1 in results and 2 in results:
        one, two = results[1], results[2]
        per_prompt = compare(one, two)
        for record in per_prompt:
            emit(args.out, JSONL, bench="tp_tokens", shape=args.shape, **record)
        emit(args.out, JSONL, bench="tp_tokens_all", shape=args.shape, equal=all(r["equal"] for r in per_prompt),
             prompts=len(per_prompt), tokens=args.tokens, same_weights=one["fingerprint"] == two["fingerprint"])
        for record in scaling(one, two):
            emit(args.out, JSONL, bench="tp_scaling", shape=args.shape, **record)


if __name__ == "__main__":
    main()
