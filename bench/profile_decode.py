"""Where a decode step's GPU time goes: the eager decode under torch.profiler, kernels grouped by name, one JSON
line per kernel group (largest first) and one for the step as a whole, beside the graph replay's wall time. With
--prefill ROWS, the same for one stream's prefill of ROWS rows in --chunk pieces instead, with `issue_us` (the host's
time to issue the prefill, before waiting for the device) beside `wall_us`.

    python bench/profile_decode.py --shape qwen3_5-9b --batch 1 --out $OUT
    python bench/profile_decode.py --shape nemotron_h-30b-a3b --prefill 8192 --out $OUT
    python bench/profile_decode.py --shape qwen3_5-9b --prefill 8192 --hf --out $OUT    (HF's prefill profiled too)
    python bench/profile_decode.py --shape qwen3_5-moe-35b --prefill 2048 --host --out $OUT   (host time by function)
    python bench/profile_decode.py --shape glm --batch 1 --out $OUT     (bench/glm_gpu.py's GLM shape)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from gpu import SHAPES, build, hf_model, our_store, ours_in_place_of  # bench/gpu.py: run from bench/ on sys.path

from tensorfold.engine.graphs import DecodeRunner
from tensorfold.plan import StepPlan, StreamStep


def main() -> None:
    parser = argparse.ArgumentParser(description="profile one decode step")
    parser.add_argument("--shape", default="qwen3_5-9b", choices=sorted(SHAPES) + ["glm"],
                        help="glm: bench/glm_gpu.py's shape (8 layers, 64 experts)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--prefill", type=int, help="profile a prefill of this many rows instead")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--hf", action="store_true", help="with --prefill: profile HF's prefill of the same rows too")
    parser.add_argument("--host", action="store_true",
                        help="with --prefill: the host's time by Python function and by file (cProfile) too")
    args = parser.parse_args()
    torch.manual_seed(0)
    ours, layout = subject(args)
    if args.prefill:
        return profile_prefill(args, ours, layout)
    context = args.prompt + 3 * args.steps + 4
    store = our_store(layout, args.batch, context)
    # each stream its own random tokens, so a MoE routes the batch as it routes a real one (the same tokens in every
    # stream would route every row to the same experts)
    tokens = torch.randint(0, ours.vocab_size, (args.batch, args.prompt)).tolist()
    with torch.inference_mode():
        for slot in range(args.batch):
            ours.forward(StepPlan((StreamStep(slot, 0, tokens[slot]),)), store)
        runners = {g: DecodeRunner(ours, store, (args.batch,), context, graphs=g) for g in (False, True)}
        runners[True].capture()
        position = [args.prompt]

        def step(graphs: bool) -> None:
            at = position[0]
            plan = StepPlan(tuple(StreamStep(s, at, (tokens[s][at % args.prompt],)) for s in range(args.batch)))
            runners[graphs].forward(plan, store)
            position[0] += 1

        step(False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step(False)
            torch.cuda.synchronize()
        totals = kernel_totals(prof, args.steps)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(args.steps):
            step(True)
        torch.cuda.synchronize()
        replay_us = (time.perf_counter() - began) / args.steps * 1e6
    report(args, totals, {"bench": "decode_profile", "shape": args.shape, "batch": args.batch,
                          "graph_replay_us": round(replay_us, 1)}, "decode_kernel")


def subject(args: argparse.Namespace):
    """Our model and its Layout; HF's prefill profiled first with --hf. Without --hf ours is loaded in place of HF's
    model (a 35B model is held once, not twice)."""
    if args.shape == "glm":
        import glm_gpu  # bench/glm_gpu.py

        _, ours, layout, _ = glm_gpu.build(8, 64, torch.bfloat16)
        return ours, layout
    if args.prefill and args.hf:
        hf, ours, layout, _, _ = build(args.shape, torch.bfloat16)
        profile_hf_prefill(args, hf)
        return ours, layout
    hf, config = hf_model(args.shape, torch.bfloat16)
    return ours_in_place_of(hf, config, args.shape, torch.bfloat16)


def kernel_totals(prof: torch.profiler.profile, steps: int) -> dict[str, list[float]]:
    """GPU time (µs) and calls per step of each kernel name."""
    totals: dict[str, list[float]] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA or getattr(event, "self_device_time_total", 0):
            time_us = getattr(event, "self_device_time_total", 0.0)
            if time_us:
                totals[event.key] = [time_us / steps, event.count / steps]
    return totals


def profile_prefill(args: argparse.Namespace, ours, layout) -> None:
    """One stream's prefill of --prefill rows in --chunk pieces, profiled once after a warm-up pass."""
    tokens = torch.randint(0, ours.vocab_size, (args.prefill,)).tolist()

    def run() -> None:
        store = our_store(layout, 1, args.prefill + 1)
        for a in range(0, args.prefill, args.chunk):
            ours.forward(StepPlan((StreamStep(0, a, tokens[a: a + args.chunk],
                                              sample=a + args.chunk >= args.prefill),)), store)

    with torch.inference_mode():
        wall_us, issue_us, prof = profiled(run)
        syncs = host_syncs(run)
        if args.host:
            host_profile(args, run)
    report(args, kernel_totals(prof, 1), {"bench": "prefill_profile", "shape": args.shape, "rows": args.prefill,
                                          "chunk": args.chunk, "wall_us": round(wall_us, 1),
                                          "issue_us": round(issue_us, 1), **syncs},
           "prefill_kernel")


def profile_hf_prefill(args: argparse.Namespace, hf) -> None:
    """HF's one-call prefill of --prefill rows (its own cache, the last row's logits), profiled the same way: the
    peer our kernel groups are read against."""
    ids = torch.randint(0, hf.config.vocab_size, (1, args.prefill), device="cuda")

    def run() -> None:
        hf(ids, use_cache=True, logits_to_keep=1)

    with torch.inference_mode():
        wall_us, issue_us, prof = profiled(run)
    report(args, kernel_totals(prof, 1), {"bench": "hf_prefill_profile", "shape": args.shape, "rows": args.prefill,
                                          "wall_us": round(wall_us, 1), "issue_us": round(issue_us, 1)},
           "hf_prefill_kernel")


def profiled(run) -> tuple[float, float, torch.profiler.profile]:
    """`run` once to warm up, once timed (µs: until it returns, the issue time, and synchronised, the wall time; an
    issue time near the wall time says the host's launches bound the run), once under the profiler."""
    run()
    torch.cuda.synchronize()
    began = time.perf_counter()
    run()
    issue_us = (time.perf_counter() - began) * 1e6
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - began) * 1e6
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return wall_us, issue_us, prof


def host_profile(args: argparse.Namespace, run) -> None:
    """Where the host's time goes while it issues `run`: cProfile's own time by function and by file, one JSON line
    each (largest first), printed and appended to --out/host.jsonl."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile).stats
    lines, files = [], {}
    for (filename, lineno, name), (_, calls, own, total, _) in stats.items():
        where = f"{'/'.join(Path(filename).parts[-2:])}:{lineno}:{name}"
        lines.append({"bench": "host_function", "where": where, "calls": calls, "own_ms": round(own * 1e3, 2),
                      "total_ms": round(total * 1e3, 2)})
        key = "/".join(Path(filename).parts[-3:-1]) if filename.startswith("/") else filename
        files[key] = files.get(key, 0.0) + own
    lines = sorted(lines, key=lambda line: -line["own_ms"])[: 2 * args.top]
    lines += [{"bench": "host_file", "where": key, "own_ms": round(own * 1e3, 2)}
              for key, own in sorted(files.items(), key=lambda kv: -kv[1])[: args.top]]
    emit_lines(args, lines, "host.jsonl")


def host_syncs(run) -> dict:
    """Where `run` waits for the device: torch's sync debug mode warns at each sync; the call sites, counted."""
    import traceback
    import warnings

    sites: dict[str, int] = {}

    def seen(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-4:][::-1])
        sites[where] = sites.get(where, 0) + 1

    previous = warnings.showwarning
    warnings.showwarning = seen
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous
    return {"host_syncs": sum(sites.values()), "sync_sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])[:8])}


def report(args: argparse.Namespace, totals: dict[str, list[float]], head: dict, kind: str) -> None:
    """The whole as one JSON line, then the largest kernel groups, printed and appended to --out/profile.jsonl."""
    lines = [{**head, "kernel_us": round(sum(t for t, _ in totals.values()), 1),
              "kernels": round(sum(c for _, c in totals.values()), 1)}]
    for name, (t, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
        lines.append({"bench": kind, "name": name[:90], "us": round(t, 1), "calls": c})
    emit_lines(args, lines, "profile.jsonl")


def emit_lines(args: argparse.Namespace, lines: list[dict], name: str) -> None:
    """Each line printed as JSON and appended to --out/`name`."""
    for line in lines:
        print(json.dumps(line), flush=True)
        if args.out is not None:
            with open(args.out / name, "a") as handle:
                handle.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
