"""Many streams in one step loop: each reply equals the reply it gets alone; memory comes back whole."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import resume_cases
from resume_cases import Client

from tensorfold.engine.api import DoneEvent, ErrorEvent, Sampling
from tensorfold.engine.runner import Engine
from tensorfold.testing import kit

CONTEXT = 160


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 31 + salt * 17) % 500 + 3 for i in range(n))


REQUESTS = [  # (prompt length, sampling)
    (40, Sampling(temperature=0.0, max_tokens=12)),
    (7, Sampling(temperature=1.0, seed=11, max_tokens=20)),
    (90, Sampling(temperature=0.8, top_p=0.9, seed=3, max_tokens=9)),
    (33, Sampling(temperature=0.0, max_tokens=30)),
    (16, Sampling(temperature=1.2, top_k=20, seed=5, max_tokens=15)),
    (64, Sampling(temperature=0.0, max_tokens=5)),
    (5, Sampling(temperature=0.7, min_p=0.05, seed=9, max_tokens=25)),
    (120, Sampling(temperature=0.0, max_tokens=16)),
]


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


memory = functools.partial(resume_cases.memory, context=CONTEXT)  # pages of 16 rows, poisoned unless poison=False


def run_all(engine: Engine, clients: list[Client], stagger_s: float = 0.0) -> None:
    engine.start()
    try:
        for client in clients:
            engine.submit(client.request)
            time.sleep(stagger_s)
        for client in clients:
            assert not isinstance(client.result(), ErrorEvent)
    finally:
        engine.close()


def solo(subject, length: int, salt: int, sampling: Sampling) -> list[int]:
    client = Client("solo", prompt(length, salt), sampling)
    run_all(Engine(subject.model, memory(subject, 1), prefill_chunk=32, context=CONTEXT, max_waiting=4), [client])
    return client.tokens


@pytest.fixture(scope="module")
def alone(subject):
    return [solo(subject, length, salt, sampling) for salt, (length, sampling) in enumerate(REQUESTS)]


@pytest.mark.parametrize("parallel, pages, stagger_s", [(8, True, 0.0), (3, True, 0.002), (8, False, 0.001)],
                         ids=["all-at-once", "staggered-3-slots", "windows"])
def test_concurrent_equals_solo(subject, alone, parallel, pages, stagger_s):
    mem = memory(subject, parallel, pages=pages)
    clients = [Client(f"r{i}", prompt(length, i), sampling) for i, (length, sampling) in enumerate(REQUESTS)]
    run_all(Engine(subject.model, mem, prefill_chunk=32, context=CONTEXT, max_waiting=16), clients, stagger_s)
    for i, client in enumerate(clients):
        assert client.tokens == alone[i], f"request {i} differs when served with others"
    mem.check_integrity()
    assert mem.slots.free == parallel and (mem.pool is None or mem.pool.free == mem.pool.total)


def test_cancelled_streams_leave_nothing_behind_and_others_are_unchanged(subject, alone):
    mem = memory(subject, 4)
    clients = [Client(f"r{i}", prompt(length, i), sampling, cancel_after=3 if i % 3 == 1 else None)
               for i, (length, sampling) in enumerate(REQUESTS)]
    run_all(Engine(subject.model, mem, prefill_chunk=32, context=CONTEXT, max_waiting=16), clients)
    for i, client in enumerate(clients):
        if i % 3 == 1:
            assert client.tokens == alone[i][: len(client.tokens)] and len(client.tokens) <= 4
        else:
            assert client.tokens == alone[i]
    mem.check_integrity()
    assert mem.pool.free == mem.pool.total and mem.slots.free == 4


def test_a_request_cancelled_while_waiting_is_answered_and_freed(subject):
    mem = memory(subject, 1)
    engine = Engine(subject.model, mem, prefill_chunk=32, context=CONTEXT, max_waiting=8)
    first = Client("first", prompt(60, 1), Sampling(temperature=0.0, max_tokens=60))
    second = Client("second", prompt(20, 2), Sampling(temperature=0.0, max_tokens=5))
    second.request.cancel()
    run_all(engine, [first, second])
    mem.check_integrity()
    assert mem.pool.free == mem.pool.total


def test_admission_waits_for_pages_in_order(subject, alone):
    page_rows = 16
    total = -(-(120 + 16) // page_rows)
    mem = memory(subject, 4, total=total)
    order: list[str] = []
    lock = threading.Lock()
    clients = [Client(f"r{i}", prompt(length, i), sampling) for i, (length, sampling) in enumerate(REQUESTS)]
    for client in clients:
        inner = client.on_event

        def on_event(event, inner=inner, name=client.request.id):
            if isinstance(event, DoneEvent):
                with lock:
                    order.append(name)
            inner(event)

        client.request.on_event = on_event
    run_all(Engine(subject.model, mem, prefill_chunk=32, context=CONTEXT, max_waiting=16), clients)
    assert [c.tokens for c in clients] == alone
    assert order.index("r7") > order.index("r0")
    mem.check_integrity()


def test_poison_changes_nothing(subject, alone):
    mem = memory(subject, 8, poison=False)
    clients = [Client(f"r{i}", prompt(length, i), sampling) for i, (length, sampling) in enumerate(REQUESTS)]
    run_all(Engine(subject.model, mem, prefill_chunk=32, context=CONTEXT, max_waiting=16), clients)
    assert [c.tokens for c in clients] == alone
