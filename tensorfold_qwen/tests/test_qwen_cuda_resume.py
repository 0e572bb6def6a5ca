"""On a CUDA device, the real engine with the decode runner's graphs, a device tier too small for two states and a
pinned host tier: a conversation resumed from the host replies exactly as a fresh engine does. Skipped without
CUDA; run in device sessions (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from cuda_disk_turns import ask

from tensorfold.engine.api import KeepMarks
from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.engine.runner import Engine
from tensorfold.kernels import linear_norm
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.plugins import load_families
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.testing import kit
from tensorfold.tiers import DeviceTier, HostTier
from tensorfold_qwen import decode, plugin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CONTEXT, PAGE_ROWS, CHUNK, MIN_CHUNK, PARALLEL = 512, 16, 64, 16, 2


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 41 + salt * 7) % 500 + 3 for i in range(n))


def engine(subject, device_budget: int | None, host: bool) -> tuple[Engine, StreamMemory]:
    pages = PARALLEL * -(-CONTEXT // PAGE_ROWS)
    kv = PagedStore(subject.declarations.layout, PARALLEL, pages, PAGE_ROWS, "cuda", poison=True)
    mem = StreamMemory(kv, SlotPool(PARALLEL), PagePool(pages, PAGE_ROWS))
    runner = DecodeRunner(subject.model, kv, batch_sizes(PARALLEL), CONTEXT, graphs=True)
    runner.capture()
    tier = DeviceTier(mem, device_budget) if device_budget else None
    lower = HostTier(mem, 1 << 30) if host else None
    return Engine(runner, mem, CHUNK, CONTEXT, 8, min_chunk=MIN_CHUNK, tier=tier, host=lower), mem


@pytest.mark.parametrize("wide", [False, True], ids=["library-inputs", "gemv-inputs"])
def test_resumed_from_pinned_host_equals_fresh_on_cuda(tmp_path, monkeypatch, wide):
    """gemv-inputs: the tiny model's projections counted wide, so its decode runs the input projections in
    linear_norm's one-launch GEMV, as the real shapes do."""
    if wide:
        monkeypatch.setattr(linear_norm, "ONE_SLICE_FROM", 64)
        monkeypatch.setattr(decode, "INPUT_GEMV", True)
    plugin.write_tiny(tmp_path, seed=6)
    subject = kit.load(load_families(["qwen"])["qwen"], tmp_path, dtype=torch.bfloat16, device="cuda")
    layout = subject.declarations.layout
    eng, mem = engine(subject, layout.stream_bytes(70), host=True)
    chats = {name: [tokens(60, salt), (), None] for name, salt in (("one", 1), ("two", 2))}
    replies = []
    eng.start()
    try:
        for turn in range(3):
            for name, chat in chats.items():
                prompt, starts, rewind = chat
                reply, done = ask(eng, f"{name}{turn}", prompt, starts, KeepMarks(rewind=rewind))
                replies.append((prompt, starts, rewind, reply, done.cached_tokens))
                grown = prompt + tuple(reply) + tokens(20, turn + 5)
                chat[:] = [grown, starts + (len(prompt), len(prompt) + len(reply)), len(prompt) + len(reply)]
        mem.check_integrity()
        for tier in eng.tiers:
            tier.check_integrity()
    finally:
        eng.close()
    host = next(t for t in eng.tiers if t.name == "host")
    assert host.stats().hits >= 1 and host.pin
    assert any(cached > 0 for *_, cached in replies[2:])
    fresh_eng, _ = engine(subject, None, host=False)
    fresh_eng.start()
    try:
        for k, (prompt, starts, rewind, reply, _) in enumerate(replies):
            again, done = ask(fresh_eng, f"fresh{k}", prompt, starts, KeepMarks(rewind=rewind))
            assert done.cached_tokens == 0 and again == reply, f"request {k} differs from a fresh run"
    finally:
        fresh_eng.close()
