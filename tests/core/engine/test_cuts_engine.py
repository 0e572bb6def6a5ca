"""Prefill cut at request starts: the scheduler's shares land exactly on plan_cuts, and the reply is the reply
the grid alone gives (bitwise for the template family, whose forward runs each stream's rows on their own)."""

from __future__ import annotations

import queue
import threading

import pytest

from tensorfold.cuts import plan_cuts
from tensorfold.engine.api import ErrorEvent, Request, Sampling, TokenEvent
from tensorfold.engine.runner import Engine
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.plan import StepPlan
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.testing import kit

CONTEXT = 160

CHUNK, MIN_CHUNK = 32, 8
LENGTH = 130
STARTS = (3, 20, 26, 41, 44, 90, 97, 126, 200)  # close ones (each a cut), off-grid ones, one past the prompt


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 31 + salt * 17) % 500 + 3 for i in range(n))


def memory(subject, parallel: int, page_rows: int = 16) -> StreamMemory:
    total = parallel * -(-CONTEXT // page_rows)
    return StreamMemory(PagedStore(subject.declarations.layout, parallel, total, page_rows, poison=True),
                        SlotPool(parallel), PagePool(total, page_rows))


class Client:
    """One request's tokens and the event that ended it."""

    def __init__(self, name: str, tokens: tuple[int, ...], sampling: Sampling, starts=()) -> None:
        self.tokens: list[int] = []
        self.done: queue.Queue = queue.Queue()
        self.request = Request(name, tokens, sampling, self.on_event, starts=starts)

    def on_event(self, event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token_id)
        else:
            self.done.put(event)


def run_all(engine: Engine, clients: list[Client]) -> None:
    engine.start()
    try:
        for client in clients:
            engine.submit(client.request)
        for client in clients:
            assert not isinstance(client.done.get(timeout=120), ErrorEvent)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


class RecordingModel:
    """The real model, noting every StepPlan it is given."""

    def __init__(self, model) -> None:
        self.model = model
        self.plans: list[StepPlan] = []
        self._lock = threading.Lock()

    def forward(self, plan, kv):
        with self._lock:
            self.plans.append(plan)
        return self.model.forward(plan, kv)

    def prefill_ends(self, slot: int, prompt_len: int) -> list[int]:
        return [s.end for plan in self.plans for s in plan.streams if s.slot == slot and s.start < prompt_len]


def serve(subject, clients: list[Client], parallel: int = 1, min_chunk: int = MIN_CHUNK) -> RecordingModel:
    model = RecordingModel(subject.model)
    engine = Engine(model, memory(subject, parallel), prefill_chunk=CHUNK, context=CONTEXT, max_waiting=8,
                    min_chunk=min_chunk)
    run_all(engine, clients)
    return model


def with_starts(name: str, tokens, sampling: Sampling, starts) -> Client:
    return Client(name, tokens, sampling, starts)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0, max_tokens=12),
                                      Sampling(temperature=0.9, top_p=0.95, seed=7, max_tokens=12)],
                         ids=["greedy", "seeded"])
def test_starts_change_the_cuts_but_not_the_reply(subject, sampling):
    tokens = prompt(LENGTH, 4)
    cuts = plan_cuts(LENGTH, STARTS, CHUNK, MIN_CHUNK)
    assert cuts == (3, 20, 26, 41, 44, 76, 90, 97, 126, 130) and cuts != (32, 64, 96, 128, 130)
    plain = Client("plain", tokens, sampling)
    grid_model = serve(subject, [plain])
    cut = with_starts("cut", tokens, sampling, STARTS)
    cut_model = serve(subject, [cut])
    assert grid_model.prefill_ends(0, LENGTH) == [32, 64, 96, 128, 130]
    assert cut_model.prefill_ends(0, LENGTH) == list(cuts)
    assert len(cut.tokens) == 12 and cut.tokens == plain.tokens


def test_no_starts_is_the_grid_whatever_min_chunk(subject):
    sampling = Sampling(temperature=0.0, max_tokens=3)
    model = serve(subject, [Client("plain", prompt(LENGTH, 1), sampling)], min_chunk=1000)
    assert model.prefill_ends(0, LENGTH) == [32, 64, 96, 128, 130]


def test_concurrent_streams_each_cut_at_their_own_starts(subject):
    sampling = Sampling(temperature=0.0, max_tokens=6)
    specs = [(LENGTH, STARTS), (70, (10, 50, 52)), (45, ())]
    alone = []
    for i, (length, starts) in enumerate(specs):
        client = with_starts(f"alone{i}", prompt(length, 10 + i), sampling, starts)
        serve(subject, [client])
        alone.append(client.tokens)
    clients = [with_starts(f"r{i}", prompt(length, 10 + i), sampling, starts)
               for i, (length, starts) in enumerate(specs)]
    model = serve(subject, clients, parallel=3)
    slots = {}
    for plan in model.plans:  # each stream's slot: the slot of its first prefill share
        for share in plan.streams:
            if share.start == 0:
                slots[len(slots)] = share.slot
    for i, (length, starts) in enumerate(specs):
        assert model.prefill_ends(slots[i], length) == list(plan_cuts(length, starts, CHUNK, MIN_CHUNK))
        assert clients[i].tokens == alone[i]
    for plan in model.plans:  # the step budget still holds: beyond the oldest share, one chunk's worth of rows
        assert sum(len(s.tokens) for s in plan.streams) <= CHUNK + len(plan.streams)


def test_starts_at_or_past_the_prompt_end_leave_the_grid(subject):
    client = with_starts("past", prompt(40, 2), Sampling(temperature=0.0, max_tokens=2), (40, 41, 500))
    model = serve(subject, [client])
    assert model.prefill_ends(0, 40) == [32, 40] and len(client.tokens) == 2
