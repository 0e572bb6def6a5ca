"""The batched sampling pass on its own: milliseconds per step (the host call, its one copy of B ids included) for
greedy, seeded temperature-only and seeded top_k + top_p + min_p rows, by batch size and vocabulary. One JSON line
per measurement.

    python bench/sampling.py [--device cuda] [--vocab 151936 248320] [--batch 1 8 64 128]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tensorfold.engine.api import Sampling
from tensorfold.engine.sampler import Sampler, SampleRow

MODES = {
    "greedy": Sampling(temperature=0.0),
    "temperature": Sampling(temperature=0.8, seed=1),
    "top_k_top_p_min_p": Sampling(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=1),
}


def measure(device: str, vocab: int, batch: int, mode: str, repeats: int) -> dict[str, object]:
    """Median milliseconds of `repeats` steps after warm-up, each ending when the ids are on the host."""
    logits = torch.randn(batch, vocab, device=device) * 4
    rows = [SampleRow.of(MODES[mode])] * batch
    sampler = Sampler()
    for t in range(3):
        sampler.sample(logits, rows, [t] * batch)
    times = []
    for t in range(repeats):
        began = time.perf_counter()
        sampler.sample(logits, rows, [t] * batch)
        times.append((time.perf_counter() - began) * 1e3)
    times.sort()
    return {"bench": "sampling", "device": device, "vocab": vocab, "batch": batch, "mode": mode,
            "ms_median": round(times[len(times) // 2], 4), "ms_min": round(times[0], 4), "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 248320])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 128])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    with torch.inference_mode():
        for vocab in args.vocab:
            for batch in args.batch:
                for mode in MODES:
                    print(json.dumps(measure(args.device, vocab, batch, mode, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
