"""On a CUDA device, the real engine with the decode runner's graphs: greedy and seeded requests (every filter)
served together, in decode steps padded to the captured sizes, each get the tokens they get alone. Skipped
without CUDA; run in device sessions (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from tensorfold.engine.api import Sampling
from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.engine.runner import Engine
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.plugins import load_families
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.testing import kit
from tensorfold.testing.engine_gates import Client, running
from tensorfold_qwen import plugin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CONTEXT, PAGE_ROWS, CHUNK, PARALLEL = 256, 16, 64, 8
REQUESTS = [
    (20, Sampling(temperature=0.0, max_tokens=24)),
    (7, Sampling(temperature=1.0, seed=11, max_tokens=30)),
    (33, Sampling(temperature=0.8, top_p=0.9, seed=3, max_tokens=18)),
    (16, Sampling(temperature=1.2, top_k=20, seed=5, max_tokens=27)),
    (5, Sampling(temperature=0.7, min_p=0.05, seed=2**64 - 1, max_tokens=21)),
    (40, Sampling(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02, seed=-7, max_tokens=25)),
]  # (prompt length, sampling): requests end at different steps, so the padded batch shrinks


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 11) % 500 + 3 for i in range(n))


def replies(subject, requests: list[tuple[int, Sampling, int]]) -> list[list[int]]:
    """Each request's tokens from one engine over graph-replayed decode, all submitted at once."""
    pages = PARALLEL * -(-CONTEXT // PAGE_ROWS)
    kv = PagedStore(subject.declarations.layout, PARALLEL, pages, PAGE_ROWS, "cuda", poison=True)
    mem = StreamMemory(kv, SlotPool(PARALLEL), PagePool(pages, PAGE_ROWS))
    runner = DecodeRunner(subject.model, kv, batch_sizes(PARALLEL), CONTEXT, graphs=True)
    runner.capture()
    clients = [Client(f"r{salt}", prompt(n, salt), sampling) for n, sampling, salt in requests]
    with running(Engine(runner, mem, CHUNK, CONTEXT, 16)) as eng:
        for client in clients:
            eng.submit(client.request)
        for client in clients:
            client.result()
    assert runner.replays > 0
    return [client.tokens for client in clients]


def test_seeded_and_greedy_replies_are_the_same_alone_and_together_on_cuda(tmp_path):
    plugin.write_tiny(tmp_path, seed=7)
    subject = kit.load(load_families(["qwen"])["qwen"], tmp_path, dtype=torch.bfloat16, device="cuda")
    requests = [(n, sampling, salt) for salt, (n, sampling) in enumerate(REQUESTS)]
    together = replies(subject, requests)
    alone = [replies(subject, [request])[0] for request in requests]
    assert [len(r) for r in together] == [s.max_tokens for _, s, _ in requests]
    assert together == alone
