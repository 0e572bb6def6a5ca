"""Decode variants in one process: the model built once, then the decode step (CUDA graphs, as bench/gpu.py times
it) timed under each variant, the variants taken in turn round after round so drift in the device's clocks falls
on all of them alike. A variant sets module constants (a kernel's tile, stages, a switch) before its graphs are
captured and restores them after.

Prints one JSON line per variant (and appends them to --out/sweep.jsonl): its step times (ms) in every round, the
best and the median, and the best as a fraction of the HBM limit at batch 1. With --combine MARGIN, the variants
whose median beats the base's by more than MARGIN are then set together (`combined`; of two that set one constant,
the faster whole) and timed against the base (`base_again`) for as many rounds again. A SIGTERM (a `timeout`
around the call) ends the timing where it is and still prints what was measured, marked `cut_short`.

    python bench/decode_sweep.py --shape qwen3_5-moe-35b --rounds 3 --out $OUT \\
        --variant stages4=tensorfold.kernels.linear_norm.triton_linear_norm:NUM_STAGES=4 \\
        --variant input_cublas=tensorfold_qwen.decode:INPUT_GEMV=False
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import importlib
import signal
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import gpu
import torch


@attrs.frozen
class Setting:
    """One module constant a variant sets."""

    module: str
    attribute: str
    value: object


def parse_variant(text: str) -> tuple[str, tuple[Setting, ...]]:
    """`name=module:attr=value[,module:attr=value...]` -> (name, its settings); the value a Python literal."""
    name, _, rest = text.partition("=")
    settings = []
    for item in filter(None, rest.split(",")):
        target, _, value = item.partition("=")
        module, _, attribute = target.partition(":")
        if not (module and attribute and value):
            raise SystemExit(f"--variant {text!r}: each setting is module:attribute=value")
        settings.append(Setting(module, attribute, ast.literal_eval(value)))
    if not name:
        raise SystemExit(f"--variant {text!r}: a name first (name=module:attribute=value)")
    return name, tuple(settings)


def applied(settings: tuple[Setting, ...]) -> list[tuple[object, str, object]]:
    """Sets each constant; returns what to restore."""
    restore = []
    for s in settings:
        module = importlib.import_module(s.module)
        if not hasattr(module, s.attribute):
            raise SystemExit(f"{s.module} has no {s.attribute}")
        restore.append((module, s.attribute, getattr(module, s.attribute)))
        setattr(module, s.attribute, s.value)
    return restore


def combined(variants: list[tuple[str, tuple[Setting, ...]]], times: dict[str, list[float]], margin: float
             ) -> tuple[Setting, ...]:
    """The settings of every variant whose median beats the base's by more than `margin` (a fraction), fastest
    first; a variant that sets a constant a faster one set is left out whole (its settings belong together)."""
    base = statistics.median(times["base"])
    winners = sorted((statistics.median(times[name]), name, settings) for name, settings in variants
                     if name != "base" and statistics.median(times[name]) < base * (1 - margin))
    chosen: dict[tuple[str, str], Setting] = {}
    for _, _, settings in winners:
        if not any((s.module, s.attribute) in chosen for s in settings):
            chosen |= {(s.module, s.attribute): s for s in settings}
    return tuple(chosen.values())


def timed_rounds(variants: list[tuple[str, tuple[Setting, ...]]], times: dict[str, list[float]], rounds: int,
                 measure) -> None:
    """Each variant timed once a round, in turn, its constants set for its own timing only."""
    for _ in range(rounds):
        for name, settings in variants:
            restore = applied(settings)
            try:
                times.setdefault(name, []).append(measure())
                print(f"# {name} {times[name][-1] * 1e3:.3f} ms", flush=True)   # progress, if cut short
            finally:
                for module, attribute, value in restore:
                    setattr(module, attribute, value)


class CutShort(Exception):
    """A SIGTERM arrived while timing."""


@contextlib.contextmanager
def term_raises() -> Iterator[None]:
    """SIGTERM raises CutShort inside the block (so what was timed is still written), the old handler after."""
    def raise_cut_short(signum, frame):
        raise CutShort()
    before = signal.signal(signal.SIGTERM, raise_cut_short)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def sweep(variants: list[tuple[str, tuple[Setting, ...]]], rounds: int, combine: float | None,
          measure: Callable[[], float]) -> tuple[list[tuple[str, tuple[Setting, ...]]], dict[str, list[float]], bool]:
    """The rounds, then (with `combine`) the winners together against the base again: (every variant timed or
    meant to be, their times, whether a SIGTERM cut it short)."""
    variants = list(variants)
    times: dict[str, list[float]] = {}
    try:
        with term_raises():
            timed_rounds(variants, times, rounds, measure)
            if combine is not None:
                final = [("base_again", ()), ("combined", combined(variants, times, combine))]
                variants += final
                timed_rounds(final, times, rounds, measure)
    except CutShort:
        return variants, times, True
    return variants, times, False


def main() -> None:
    parser = argparse.ArgumentParser(description="decode variants timed in one process")
    parser.add_argument("--shape", default="qwen3_5-moe-35b", choices=sorted(gpu.SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], help="name=module:attr=value[,...] (repeatable)")
    parser.add_argument("--combine", type=float, default=None, metavar="MARGIN",
                        help="then the winners' settings together (`combined`: medians better than the base's by "
                             "more than MARGIN, a fraction) timed against the base for --rounds more rounds")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    gpu.DEVICE = args.device
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    variants = [("base", ())] + [parse_variant(v) for v in args.variant]
    torch.manual_seed(0)
    bandwidth, _ = gpu.hardware(args.out)
    hf, config = gpu.hf_model(args.shape, torch.bfloat16)
    read = gpu.bytes_per_step(hf, config)
    ours, layout = gpu.ours_in_place_of(hf, config, args.shape, torch.bfloat16)
    del hf
    moved = read + layout.fixed_bytes * 2 + layout.bytes_per_token * args.prompt

    def measure() -> float:
        try:
            return gpu.our_decode(ours, layout, args.batch, args.prompt, args.steps, args.prompt, graphs=True)
        finally:
            gc.collect()        # the timing's graphs, store and runner go before the next capture, cycles or not

    with torch.inference_mode():
        variants, times, cut_short = sweep(variants, args.rounds, args.combine, measure)
    for name, settings in variants:
        if not times.get(name):
            continue
        best = min(times[name])
        record = {"bench": "decode_variant", "shape": args.shape, "batch": args.batch, "variant": name,
                  "settings": [f"{s.module}:{s.attribute}={s.value!r}" for s in settings],
                  "step_ms": [round(t * 1e3, 3) for t in times[name]], "best_ms": round(best * 1e3, 3),
                  "median_ms": round(statistics.median(times[name]) * 1e3, 3), "cut_short": cut_short}
        if args.batch == 1:
            record["hbm_limit_fraction"] = round(moved / bandwidth / best, 4)
        gpu.emit(args.out, "sweep.jsonl", **record)


if __name__ == "__main__":
    main()
