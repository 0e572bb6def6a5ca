"""One process of the GPU disk-tier gate (test_qwen_cuda_disk.py): the real engine with graphs on a CUDA device,
run as a separate process per phase so that each starts as a restarted server does (its own kernel autotuning,
its own CUDA context).

    write   an engine with the disk tier (boot.build_disk, as `serve --learn-conversations` builds it) runs two
            chats for two turns, then closes: its kept states are written at shutdown; the third turn's requests
            go to `out`
    resume  a new engine and store on the same --learn-dir run those requests; every restored state is read
            back out of the slot and compared byte for byte with the image read from disk
    fresh   an engine with no tiers runs them

    python cuda_disk_turns.py PHASE CHECKPOINT LEARN_DIR OUT.json [REQUESTS.json]
"""

from __future__ import annotations

import json
import queue
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from tensorfold.boot import build_disk
from tensorfold.engine.api import DoneEvent, ErrorEvent, KeepMarks, Request, Sampling, TokenEvent
from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.engine.runner import Engine
from tensorfold.image import read_out
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.plugins import load_families
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.settings import Settings
from tensorfold.testing import kit

CONTEXT, PAGE_ROWS, CHUNK, MIN_CHUNK, PARALLEL = 512, 16, 64, 16, 2
GREEDY = Sampling(temperature=0.0, max_tokens=12)


def tokens(n: int, salt: int) -> list[int]:
    return [(i * 41 + salt * 7) % 500 + 3 for i in range(n)]


def engine(subject, checkpoint: Path, root: Path | None) -> tuple[Engine, object]:
    """The engine a server builds: graphs for decode, and the disk tier alone when `root` is given."""
    pages = PARALLEL * -(-CONTEXT // PAGE_ROWS)
    kv = PagedStore(subject.declarations.layout, PARALLEL, pages, PAGE_ROWS, "cuda", poison=True)
    mem = StreamMemory(kv, SlotPool(PARALLEL), PagePool(pages, PAGE_ROWS))
    runner = DecodeRunner(subject.model, kv, batch_sizes(PARALLEL), CONTEXT, graphs=True)
    runner.capture()
    disk = None
    if root is not None:
        settings = Settings(learn=True, learn_dir=root, context=CONTEXT, prefill_chunk=CHUNK, min_chunk=MIN_CHUNK)
        disk = build_disk(settings, subject.checkpoint, subject.declarations, subject.model, mem, torch.bfloat16,
                          torch.device("cuda"))
    return Engine(runner, mem, CHUNK, CONTEXT, 8, min_chunk=MIN_CHUNK, disk=disk), disk


def ask(eng: Engine, name: str, prompt: Sequence[int], starts: Sequence[int], marks: KeepMarks | None = None
        ) -> tuple[list[int], DoneEvent]:
    """The reply's token ids and its done event (cached_tokens: the rows its request resumed)."""
    out: list[int] = []
    done: queue.Queue = queue.Queue()

    def on_event(event) -> None:
        if isinstance(event, TokenEvent):
            out.append(event.token_id)
        else:
            done.put(event)

    eng.submit(Request(name, tuple(prompt), GREEDY, on_event, starts=tuple(starts), marks=marks or KeepMarks()))
    event = done.get(timeout=300)
    if isinstance(event, ErrorEvent) or not isinstance(event, DoneEvent):
        raise RuntimeError(f"{name}: {event}")
    return out, event


def write(eng: Engine) -> list[dict]:
    """Two turns of two chats; the third turn's requests."""
    chats = {name: (tokens(60, salt), []) for name, salt in (("one", 1), ("two", 2))}
    for turn in range(2):
        for name, (prompt, starts) in list(chats.items()):
            reply, _ = ask(eng, f"{name}{turn}", prompt, starts)
            chats[name] = (prompt + reply + tokens(20, turn + 5), starts + [len(prompt), len(prompt) + len(reply)])
    return [{"name": name, "prompt": prompt, "starts": starts} for name, (prompt, starts) in chats.items()]


def checked_loads(disk, kv) -> list[bool]:
    """Wrap the disk tier's load: after each restore, the slot's state read out equals the state's image read from
    disk again (a second, independent read)."""
    same: list[bool] = []
    load = disk.load

    def load_and_compare(state, claim, owner=""):
        rows = load(state, claim, owner)
        if rows:
            torch.cuda.synchronize()
            image = disk.store.read(state.entry, use=False)
            same.append(read_out(kv, claim.slot, rows, disk.fmt).to_bytes() == image.to_bytes())
        return rows

    disk.load = load_and_compare
    return same


def main(phase: str, checkpoint: Path, root: Path, out: Path, requests: Path | None) -> None:
    torch.manual_seed(0)
    subject = kit.load(load_families(["qwen"])["qwen"], checkpoint, dtype=torch.bfloat16, device="cuda")
    eng, disk = engine(subject, checkpoint, None if phase == "fresh" else root)
    same = checked_loads(disk, eng.memory.kv) if phase == "resume" else []
    eng.start()
    try:
        if phase == "write":
            result: dict = {"requests": write(eng)}
        else:
            asked = json.loads(requests.read_text())
            replies = [ask(eng, r["name"], r["prompt"], r["starts"]) for r in asked]
            result = {"replies": [reply for reply, _ in replies], "cached": [done.cached_tokens for _, done in replies]}
    finally:
        eng.close()
    if disk is not None:
        result |= {"disk": disk.describe(), "identity": disk.store.identity, "restored_equal": same}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]),
         Path(sys.argv[5]) if len(sys.argv) > 5 else None)
