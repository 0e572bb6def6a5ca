"""The step loop on the template family: same tokens as the kit's driver, grid-invariant, cancellable."""

from __future__ import annotations

import queue

import pytest

from tensorfold.engine.api import DoneEvent, ErrorEvent, Request, Sampling, TokenEvent
from tensorfold.engine.runner import Engine
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.service import QueueFull
from tensorfold.testing import kit

PROMPT = tuple((i * 29 + 5) % 500 + 3 for i in range(40))


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def memory_for(subject, context=128, parallel=1, page_rows=16, pages=None) -> StreamMemory:
    layout = subject.declarations.layout
    pages = pages or parallel * -(-context // page_rows)
    store = PagedStore(layout, parallel, pages, page_rows, poison=True)
    return StreamMemory(store, SlotPool(parallel), PagePool(pages, page_rows))


def engine_for(subject, chunk=16, context=128, max_waiting=8, parallel=1) -> Engine:
    engine = Engine(subject.model, memory_for(subject, context, parallel), prefill_chunk=chunk, context=context,
                    max_waiting=max_waiting)
    engine.start()
    return engine


def run(engine: Engine, prompt, sampling: Sampling, timeout=60.0):
    events: queue.Queue = queue.Queue()
    request = Request("r", prompt, sampling, events.put)
    engine.submit(request)
    tokens = []
    while True:
        event = events.get(timeout=timeout)
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        else:
            return tokens, event


def test_greedy_tokens_equal_the_kit_driver(subject):
    engine = engine_for(subject)
    try:
        tokens, done = run(engine, PROMPT, Sampling(temperature=0.0, max_tokens=12))
    finally:
        engine.close()
    kv = subject.store(1, 128)
    logits = kit.prefill(subject, kv, 0, PROMPT, 0, len(PROMPT), 16)
    expected, _ = kit.decode(subject, kv, 0, logits, len(PROMPT), 12)
    assert tokens == expected
    assert done == DoneEvent("length", len(PROMPT), 12, 0)


def test_the_grid_is_what_cuts_prefill(subject):
    outs = []
    for chunk in (8, 16, 2048):
        engine = engine_for(subject, chunk=chunk)
        try:
            outs.append(run(engine, PROMPT, Sampling(temperature=0.0, max_tokens=6))[0])
        finally:
            engine.close()
    assert outs[0] == outs[1] == outs[2]


def test_seeded_sampling_is_reproducible(subject):
    engine = engine_for(subject)
    try:
        first = run(engine, PROMPT, Sampling(temperature=1.0, seed=5, max_tokens=10))[0]
        second = run(engine, PROMPT, Sampling(temperature=1.0, seed=5, max_tokens=10))[0]
    finally:
        engine.close()
    assert first == second


def test_an_end_token_stops_with_reason_stop(subject):
    engine = engine_for(subject)
    try:
        greedy, _ = run(engine, PROMPT, Sampling(temperature=0.0, max_tokens=3))
        tokens, done = run(engine, PROMPT, Sampling(temperature=0.0, max_tokens=10, stop_token_ids=(greedy[1],)))
    finally:
        engine.close()
    assert tokens == greedy[:2] and done.finish_reason == "stop"


def test_context_limit_ends_with_length(subject):
    engine = engine_for(subject, context=44)
    try:
        tokens, done = run(engine, PROMPT, Sampling(temperature=0.0, max_tokens=100))
    finally:
        engine.close()
    assert len(PROMPT) + len(tokens) == 44 and done.finish_reason == "length"


def test_cancel_stops_at_the_next_step(subject):
    engine = engine_for(subject)
    events: queue.Queue = queue.Queue()
    request = Request("c", PROMPT, Sampling(temperature=0.0, max_tokens=1000), events.put)

    seen = []

    def on_event(event):
        seen.append(event)
        events.put(event)
        if len(seen) == 3:
            request.cancel()

    request.on_event = on_event
    try:
        engine.submit(request)
        while not isinstance(event := events.get(timeout=60), DoneEvent):
            pass
    finally:
        engine.close()
    assert event.finish_reason == "cancelled" and event.completion_tokens == 3


def test_a_prompt_over_the_context_is_an_error_event(subject):
    engine = engine_for(subject, context=16)
    try:
        tokens, event = run(engine, PROMPT, Sampling(max_tokens=2))
    finally:
        engine.close()
    assert tokens == [] and isinstance(event, ErrorEvent) and "context of 16" in event.message


def test_the_waiting_queue_is_bounded(subject):
    engine = Engine(subject.model, memory_for(subject, 64), prefill_chunk=16, context=64, max_waiting=2)
    def noop(event):
        return None

    engine.submit(Request("a", PROMPT, Sampling(), noop))
    engine.submit(Request("b", PROMPT, Sampling(), noop))
    with pytest.raises(QueueFull, match="2 requests are already waiting"):
        engine.submit(Request("c", PROMPT, Sampling(), noop))
