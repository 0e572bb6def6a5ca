"""The startup warm-up: contiguous plans per slot, every slot and page given back, and no state left behind."""

from __future__ import annotations

import queue

import pytest

from tensorfold.engine.api import Request, Sampling, TokenEvent
from tensorfold.engine.runner import Engine
from tensorfold.engine.warmup import warm_forward, warm_plans
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.testing import kit

PROMPT = tuple((i * 31 + 7) % 400 + 3 for i in range(37))


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def memory_for(subject, parallel, context=512, page_rows=16) -> StreamMemory:
    pages = parallel * -(-context // page_rows)
    store = PagedStore(subject.declarations.layout, parallel, pages, page_rows, poison=True)
    return StreamMemory(store, SlotPool(parallel), PagePool(pages, page_rows))


@pytest.mark.parametrize("streams", [1, 2, 3])
@pytest.mark.parametrize("rows", [40, 160, 511])
def test_each_slots_shares_follow_on_and_both_row_patterns_occur(streams, rows):
    plans = warm_plans(streams, rows)
    position = dict.fromkeys(range(streams), 0)
    totals = []
    for shares in plans:
        assert len({index for index, _, _ in shares}) == len(shares)
        for index, start, end in shares:
            assert start == position[index] and end > start
            position[index] = end
        totals.append(sum(end - start for _, start, end in shares))
    if rows >= 64:
        assert any(total % 16 == 0 for total in totals) and any(total % 2 for total in totals)
    assert max(len(shares) for shares in plans) == streams


def greedy(engine: Engine) -> list[int]:
    events: queue.Queue = queue.Queue()
    engine.submit(Request("r", PROMPT, Sampling(temperature=0.0, max_tokens=6), events.put))
    tokens = []
    while isinstance(event := events.get(timeout=60), TokenEvent):
        tokens.append(event.token_id)
    return tokens


def test_warm_up_gives_everything_back_and_leaves_no_state(subject):
    fresh = Engine(subject.model, memory_for(subject, 3), prefill_chunk=16, context=512, max_waiting=4)
    fresh.start()
    try:
        expected = greedy(fresh)
    finally:
        fresh.close()
    memory = memory_for(subject, 3)
    assert warm_forward(subject.model, memory, 512) == 5
    memory.check_integrity()
    assert memory.slots.free == 3 and memory.pool.free == memory.pool.total
    warmed = Engine(subject.model, memory, prefill_chunk=16, context=512, max_waiting=4)
    warmed.start()
    try:
        assert greedy(warmed) == expected
    finally:
        warmed.close()


def test_too_little_room_runs_nothing(subject):
    memory = memory_for(subject, 1, context=32)
    assert warm_forward(subject.model, memory, 32) == 0
    assert memory.slots.free == 1 and memory.pool.free == memory.pool.total
