"""A server's identity for the rows store: every fact that must match for a state on disk to be read here, and the
probe, a fixed prompt's state hashed at startup, so that only a server computing the same bits shares a directory.

    checkpoint   sha256 of config.json; every weight shard's name, size and mtime_ns (a stamp, not a content hash)
    family       the family's identity hook facts (cache format, dtypes, schedule)
    layout       the Layout digest, the image format and the dtype
    software     torch, triton, fla-core (each or none) and tensorfold versions; the device's name ("cpu" on the
                 CPU); the TP world, and above 1 the rank whose part of each state the store keeps (`tp_rank`)
    probe        sha256 of the images of a fixed prompt's state after its first and second chunk

Beside it, in the same free slot before the engine starts, the prefill rate the payoff rule weighs a read against
(rows/payoff.py): rows per second of one timed forward of a fixed chunk.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import torch

import tensorfold
from tensorfold.checkpoint import Checkpoint
from tensorfold.family import Declarations, FamilyModel
from tensorfold.image import layout_digest, read_out
from tensorfold.layout import Layout
from tensorfold.memory import Claim, StreamMemory
from tensorfold.plan import StepPlan, StreamStep

PROBE_OWNER = "tensorfold-probe"
T = TypeVar("T")


def probe_tokens(rows: int, vocab: int) -> tuple[int, ...]:
    """A fixed, deterministic prompt of `rows` ids below `vocab`."""
    return tuple((i * 7919 + 13) % vocab for i in range(rows))


def checkpoint_facts(checkpoint: Checkpoint) -> dict[str, str]:
    """The checkpoint as files: its config's hash and its shards' stamps (a rewritten shard is another server)."""
    config = (checkpoint.directory / "config.json").read_bytes()
    shards = []
    for shard in checkpoint.shards():
        stat = shard.stat()
        shards.append(f"{shard.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return {"checkpoint.config_sha256": hashlib.sha256(config).hexdigest(), "checkpoint.shards": ",".join(shards)}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def software_facts(device: torch.device, world: int = 1, rank: int = 0) -> dict[str, str]:
    """What computes the bits: library versions, the device, the tensor-parallel world (and above 1, the rank)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    facts = {"torch": torch.__version__, "triton": _version("triton"), "fla-core": _version("fla-core"),
             "tensorfold": tensorfold.__version__, "device": name, "tp_world": str(world)}
    return facts if world == 1 else {**facts, "tp_rank": str(rank)}


@contextmanager
def free_slot(memory: StreamMemory, rows: int) -> Iterator[Claim]:
    """A slot and pages for `rows` rows, taken before the engine starts and given back whatever happens."""
    claim = memory.take(PROBE_OWNER, rows)
    try:
        yield claim
    finally:
        memory.kv.clear(claim.slot)
        memory.release(claim)


def run_chunks(model: FamilyModel, memory: StreamMemory, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...],
               after: Callable[[int], T] | None = None) -> list[T]:
    """Feed `tokens` through the model's forward in chunks ending at `cuts`; `after(end)` after each chunk."""
    seen = []
    start = 0
    with torch.inference_mode():
        for end in cuts:
            memory.extend(claim, end)
            model.forward(StepPlan((StreamStep(claim.slot, start, tokens[start:end], sample=True),)), memory.kv)
            if after is not None:
                seen.append(after(end))
            start = end
    return seen


def room(memory: StreamMemory) -> int:
    """Rows one stream can hold in this memory: the pool's pages, or one window; without row states, any."""
    if memory.pool is not None:
        return memory.pool.total * memory.pool.page_rows
    return getattr(memory.kv, "capacity", sys.maxsize)


def probe_rows(memory: StreamMemory, min_chunk: int, prefill_chunk: int, context: int) -> int:
    """Rows of one probe chunk: a --min-chunk within the grid, and two of them within the context and the memory."""
    return max(1, min(min_chunk, prefill_chunk, (context - 1) // 2, room(memory) // 2))


def probe_hash(model: FamilyModel, memory: StreamMemory, declarations: Declarations, chunk: int) -> str:
    """Run the fixed prompt of two chunks in a free slot and hash the images of its state after each chunk."""
    tokens = probe_tokens(2 * chunk, model.vocab_size)
    digest = hashlib.sha256()
    with free_slot(memory, len(tokens)) as claim:
        images = run_chunks(model, memory, claim, tokens, (chunk, 2 * chunk),
                            lambda end: read_out(memory.kv, claim.slot, end, declarations.image).to_bytes())
    for image in images:
        digest.update(hashlib.sha256(image).digest())
    return digest.hexdigest()


def prefill_rate(model: FamilyModel, memory: StreamMemory, rows: int, runs: int = 3) -> float:
    """Rows per second of a forward over a fixed chunk of `rows` rows from row 0: the median of `runs` timed runs
    after one untimed warm-up (a first call pays one-time costs)."""
    tokens = probe_tokens(rows, model.vocab_size)
    seconds = []
    for _ in range(runs + 1):
        with free_slot(memory, rows) as claim:
            began = time.perf_counter()
            run_chunks(model, memory, claim, tokens, (rows,))
            if memory.kv.device.type == "cuda":
                torch.cuda.synchronize(memory.kv.device)
            seconds.append(time.perf_counter() - began)
    return rows / max(statistics.median(seconds[1:]), 1e-9)


def identity_facts(checkpoint: Checkpoint, declarations: Declarations, dtype: torch.dtype, device: torch.device,
                   probe: str, layout: Layout | None = None, world: int = 1) -> dict[str, str]:
    """Every fact the rows store's identity hash covers (rows/api.py identity_hash); `layout` rank 0's own at TP
    above 1 (every rank's is alike), the family's at TP=1."""
    image = declarations.image
    facts: dict[str, str] = {**checkpoint_facts(checkpoint), **software_facts(device, world)}
    facts |= {f"family.{key}": value for key, value in sorted(declarations.identity.items())}
    facts |= {"layout": layout_digest(layout or declarations.layout), "image": f"{image.name}/{image.version}",
              "dtype": str(dtype).removeprefix("torch."), "probe": probe}
    return facts


def describe(facts: Mapping[str, str]) -> str:
    """The facts in one log line's worth: device, dtype, probe."""
    return f"{facts.get('device')}, {facts.get('dtype')}, probe {facts.get('probe', '')[:12]}"
