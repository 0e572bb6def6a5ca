"""Many streams in one step loop: each reply equals the reply it gets alone; memory comes back whole."""

from __future__ import annotations

import threading

import pytest

from tensorfold.engine.api import DoneEvent, Sampling
from tensorfold.settings import DEFAULT_MIN_CHUNK
from tensorfold.testing import engine_gates, kit
from tensorfold.testing.engine_gates import Client, Rig, serve

RIG = Rig(context=160, chunk=32, min_chunk=DEFAULT_MIN_CHUNK, page_rows=16, max_waiting=16)
CONTEXT = RIG.context


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 31 + salt * 17) % 500 + 3 for i in range(n))


REQUESTS = engine_gates.mixed_requests(prompt)


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


memory = RIG.memory  # pages of 16 rows, poisoned unless poison=False


def run_all(subject, mem, clients: list[Client], stagger_s: float = 0.0) -> None:
    serve(engine_gates.serving_engine(subject, RIG, mem), clients, stagger_s)


def clients_for(cancel_every: int | None = None) -> list[Client]:
    return [Client(f"r{i}", p, sampling, cancel_after=3 if cancel_every and i % cancel_every == 1 else None)
            for i, (p, sampling) in enumerate(REQUESTS)]


@pytest.fixture(scope="module")
def alone(subject):
    return engine_gates.alone(subject, RIG, REQUESTS)


@pytest.mark.parametrize("parallel, pages, stagger_s", engine_gates.SHAPES, ids=engine_gates.SHAPE_IDS)
def test_concurrent_equals_solo(subject, alone, parallel, pages, stagger_s):
    engine_gates.check_concurrent_equals_solo(subject, RIG, REQUESTS, alone, parallel, pages, stagger_s)


def test_cancelled_streams_leave_nothing_behind_and_others_are_unchanged(subject, alone):
    mem = memory(subject, 4)
    clients = clients_for(cancel_every=3)
    run_all(subject, mem, clients)
    for i, client in enumerate(clients):
        if i % 3 == 1:
            assert client.tokens == alone[i][: len(client.tokens)] and len(client.tokens) <= 4
        else:
            assert client.tokens == alone[i]
    mem.check_integrity()
    assert mem.pool.free == mem.pool.total and mem.slots.free == 4


def test_a_request_cancelled_while_waiting_is_answered_and_freed(subject):
    mem = memory(subject, 1)
    first = Client("first", prompt(60, 1), Sampling(temperature=0.0, max_tokens=60))
    second = Client("second", prompt(20, 2), Sampling(temperature=0.0, max_tokens=5))
    second.request.cancel()
    run_all(subject, mem, [first, second])
    mem.check_integrity()
    assert mem.pool.free == mem.pool.total


def test_admission_waits_for_pages_in_order(subject, alone):
    page_rows = 16
    total = -(-(120 + 16) // page_rows)
    mem = memory(subject, 4, total=total)
    order: list[str] = []
    lock = threading.Lock()
    clients = clients_for()
    for client in clients:
        inner = client.on_event

        def on_event(event, inner=inner, name=client.request.id):
            if isinstance(event, DoneEvent):
                with lock:
                    order.append(name)
            inner(event)

        client.request.on_event = on_event
    run_all(subject, mem, clients)
    assert [c.tokens for c in clients] == alone
    assert order.index("r7") > order.index("r0")
    mem.check_integrity()


def test_poison_changes_nothing(subject, alone):
    mem = memory(subject, 8, poison=False)
    clients = clients_for()
    run_all(subject, mem, clients)
    assert [c.tokens for c in clients] == alone
