"""Packed forwards run once before serving, so the kernels' one-time work (Triton compiles a kernel again for each
pattern of its integer arguments being 1 or a multiple of 16; autotuners time their configurations on first use)
happens at startup, not inside a step every decoding stream waits on.

    the plans   one stream, rows a multiple of 16; one stream, an odd count; then two and three streams mixing
                decode rows (one token past a prefix) with prefill chunks, totals odd and a multiple of 16
    memory      slots and pages taken as a stream would and given back, the slots cleared: no state is left
"""

from __future__ import annotations

import logging
import time

import torch

from tensorfold.family import FamilyModel
from tensorfold.memory import Claim, StreamMemory
from tensorfold.plan import StepPlan, StreamStep

log = logging.getLogger(__name__)
WARM_OWNER = "warm-up"
WARM_ROWS = 128  # the longest prefill chunk of the plans: one stream's rows stay under 4 of these


def warm_plans(streams: int, rows: int) -> list[tuple[tuple[int, int, int], ...]]:
    """The warm-up steps for `streams` slots of `rows` rows each, as (slot index, start, end) shares."""
    big = max(16, min(WARM_ROWS, rows // 4) // 16 * 16)  # a multiple of 16
    odd = max(1, big // 4 + 1 - (big // 4) % 2)  # an odd chunk
    steps: list[tuple[tuple[int, int, int], ...]] = [((0, 0, big),)]
    if streams == 1:
        return steps + [((0, big, big + odd),), ((0, big + odd, big + odd + 1),)]
    steps += [((1, 0, odd),), ((0, big, big + 1), (1, odd, 2 * odd))]
    if streams == 2:
        return steps + [((0, big + 1, big + 2), (1, 2 * odd, 2 * odd + 16))]
    return steps + [((2, 0, 16), (1, 2 * odd, 3 * odd), (0, big + 1, big + 2)),
                    ((2, 16, 48), (1, 3 * odd, 3 * odd + 32))]


def warm_forward(model: FamilyModel, memory: StreamMemory, context: int) -> int:
    """Run the warm-up steps through the model's forward in free slots; the number of steps run."""
    streams = min(3, memory.slots.free)
    rows = min(context - 1, 4 * WARM_ROWS)
    if memory.pool is not None:
        rows = min(rows, memory.pool.free * memory.pool.page_rows // max(streams, 1) - memory.pool.page_rows)
    plans = warm_plans(streams, rows) if streams else []
    if not plans or any(end > rows for shares in plans for _, _, end in shares):
        log.info("no warm-up of the packed forward: too little room (%d slots, %d rows each)", streams, rows)
        return 0
    began = time.perf_counter()
    claims: list[Claim] = []
    try:
        claims = [memory.take(f"{WARM_OWNER} {n}", rows) for n in range(streams)]
        tokens = tuple((i * 7919 + 11) % max(model.vocab_size - 1, 1) for i in range(rows))
        with torch.inference_mode():
            for shares in plans:
                for index, _, end in shares:
                    memory.extend(claims[index], end)
                model.forward(StepPlan(tuple(StreamStep(claims[index].slot, start, tokens[start:end], sample=True)
                                             for index, start, end in shares)), memory.kv)
        if memory.kv.device.type == "cuda":
            torch.cuda.synchronize(memory.kv.device)
    finally:
        for claim in claims:
            memory.kv.clear(claim.slot)
            memory.release(claim)
    log.info("warmed the packed forward: %d steps in %.1f s", len(plans), time.perf_counter() - began)
    return len(plans)
