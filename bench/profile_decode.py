"""Where a decode step's GPU time goes: the eager decode under torch.profiler, kernels grouped by name, one JSON
line per kernel group (largest first) and one for the step as a whole, beside the graph replay's wall time.

    python bench/profile_decode.py --shape qwen3_5-9b --batch 1 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from gpu import SHAPES, build, our_store  # bench/gpu.py: this script runs from bench/ on sys.path

from tensorfold.engine.graphs import DecodeRunner
from tensorfold.plan import StepPlan, StreamStep


def main() -> None:
    parser = argparse.ArgumentParser(description="profile one decode step")
    parser.add_argument("--shape", default="qwen3_5-9b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    hf, ours, layout, _, _ = build(args.shape, torch.bfloat16)
    del hf
    context = args.prompt + 3 * args.steps + 4
    store = our_store(layout, args.batch, context)
    with torch.inference_mode():
        for slot in range(args.batch):
            ours.forward(StepPlan((StreamStep(slot, 0, tuple(range(3, 3 + args.prompt))),)), store)
        runners = {g: DecodeRunner(ours, store, (args.batch,), context, graphs=g) for g in (False, True)}
        runners[True].capture()
        position = [args.prompt]

        def step(graphs: bool) -> None:
            plan = StepPlan(tuple(StreamStep(s, position[0], (7,)) for s in range(args.batch)))
            runners[graphs].forward(plan, store)
            position[0] += 1

        step(False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step(False)
            torch.cuda.synchronize()
        totals: dict[str, list[float]] = {}
        for event in prof.key_averages():
            if event.device_type == torch.autograd.DeviceType.CUDA or getattr(event, "self_device_time_total", 0):
                time_us = getattr(event, "self_device_time_total", 0.0)
                if time_us:
                    totals[event.key] = [time_us / args.steps, event.count / args.steps]
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(args.steps):
            step(True)
        torch.cuda.synchronize()
        replay_us = (time.perf_counter() - began) / args.steps * 1e6
    lines = [{"bench": "decode_profile", "shape": args.shape, "batch": args.batch,
              "kernel_us_per_step": round(sum(t for t, _ in totals.values()), 1),
              "kernels_per_step": round(sum(c for _, c in totals.values()), 1), "graph_replay_us": round(replay_us, 1)}]
    for name, (t, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
        lines.append({"bench": "decode_kernel", "name": name[:90], "us_per_step": round(t, 1), "calls": c})
    for line in lines:
        print(json.dumps(line), flush=True)
        if args.out is not None:
            with open(args.out / "profile.jsonl", "a") as handle:
                handle.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
