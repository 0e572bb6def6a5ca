"""Where a GLM-5.3-Flash step's time goes: one prefill chunk and decode steps under torch.profiler, with each block
of the model (mHC, KDA, MLA, MoE, dense MLP) wrapped in a labelled range, so wall time (launches included) and GPU
time are read per block. One JSON line per (phase, block), largest first. Also an fp32 check of our logits
against HF's at the real widths (`--check-layers` layers).

    python bench/glm_profile.py --out $OUT          (from bench/)
"""

from __future__ import annotations

import argparse
import functools

import glm_gpu  # bench/glm_gpu.py
import gpu
import torch
from gpu import emit, our_store, sync

from tensorfold.plan import StepPlan, StreamStep
from tensorfold_glm import model as glm_model

BLOCKS = ("hc_pre", "hc_post", "kimi_delta_attention", "mla_attention", "moe", "swiglu")


def labelled() -> None:
    """Wrap the model's block functions (as model.py calls them) in profiler ranges named after them."""
    for name in BLOCKS:
        original = getattr(glm_model, name)

        @functools.wraps(original)
        def wrapped(*args, _original=original, _name=name, **kwargs):
            with torch.profiler.record_function(f"glm::{_name}"):
                return _original(*args, **kwargs)

        setattr(glm_model, name, wrapped)


def profile(run, repeats: int) -> dict[str, tuple[float, float, int]]:
    """Per labelled block: (wall ms, GPU ms, calls) per repeat of `run`, and the whole under 'step'."""
    run()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("glm::step"):
            for _ in range(repeats):
                run()
            sync()
    found: dict[str, tuple[float, float, int]] = {}
    for event in prof.key_averages():
        if event.key.startswith("glm::"):        # on CUDA a range shows twice: its CPU side and its GPU annotation
            seen = found.get(event.key[5:], (0.0, 0.0, 0))
            found[event.key[5:]] = (max(seen[0], event.cpu_time_total / 1e3 / repeats),
                                    max(seen[1], getattr(event, "device_time_total", 0.0) / 1e3 / repeats),
                                    max(seen[2], event.count // repeats))
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    found["kernels"] = (0.0, 0.0, kernels // repeats)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description="profile GLM-5.3-Flash prefill and decode by block")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--check-layers", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="tiny widths: a CPU smoke run of this script")
    args = glm_gpu.parse_args(parser)
    labelled()
    phases(args)
    if gpu.DEVICE == "cuda":
        torch.cuda.empty_cache()
    hf, ours, layout, text = glm_gpu.build(args.check_layers, 16, torch.float32, args.small)
    with torch.inference_mode():
        record = glm_gpu.check(hf, ours, layout, 256)
    emit(args.out, jsonl="glm-profile.jsonl", bench="check_fp32", shape=f"glm5_next-{args.check_layers}l-16e",
         **record)


def phases(args: argparse.Namespace) -> None:
    """Profile one prefill chunk after a prompt, and decode steps, by block."""
    hf, ours, layout, text = glm_gpu.build(args.layers, args.experts, torch.bfloat16, args.small)
    del hf
    shape = f"glm5_next-{args.layers}l-{args.experts}e"
    store = our_store(layout, 1, args.prompt + args.chunk + 64)
    tokens = torch.randint(3, ours.vocab_size, (args.prompt + args.chunk,)).tolist()
    with torch.inference_mode():
        ours.forward(StepPlan((StreamStep(0, 0, tokens[: args.prompt]),)), store)

        def prefill() -> None:
            ours.forward(StepPlan((StreamStep(0, args.prompt, tokens[args.prompt:]),)), store)

        def decode() -> None:
            ours.forward(StepPlan((StreamStep(0, args.prompt, (7,)),)), store)

        for phase, run, repeats in (("prefill", prefill, 2), ("decode", decode, 5)):
            found = profile(run, repeats)
            for block, (wall, device, calls) in sorted(found.items(), key=lambda kv: -kv[1][0]):
                emit(args.out, jsonl="glm-profile.jsonl", bench="glm_profile", shape=shape, phase=phase,
                     block=block, wall_ms=round(wall, 3), gpu_ms=round(device, 3), calls=calls)


if __name__ == "__main__":
    main()
