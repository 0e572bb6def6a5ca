"""What the engine tests of kept states share: a tiny chat driven through a real engine, and the fresh run each
reply must equal; stream memory and a client collecting a request's events, which test_concurrency uses too."""

from __future__ import annotations

import queue

from tensorfold.engine.api import DoneEvent, ErrorEvent, KeepMarks, Request, Sampling, TokenEvent
from tensorfold.engine.memory import StreamMemory
from tensorfold.engine.runner import Engine
from tensorfold.kv import PagedStore, WindowStore
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.tiers import DeviceTier, HostTier

CONTEXT = 256
CHUNK, MIN_CHUNK, PAGE_ROWS = 32, 8, 16
REPLY = 10
USERS = (45, 30, 27)  # each turn's new user message, in tokens


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 13) % 500 + 3 for i in range(n))


def memory(subject, parallel: int = 2, pages: bool = True, total: int | None = None, context: int = CONTEXT,
           poison: bool = True) -> StreamMemory:
    """Memory for `parallel` streams of `context` rows: pages of PAGE_ROWS (`total` of them, default enough for
    every stream), or windows; NaN-poisoned unless `poison` is False, so a row read before it is written shows."""
    layout = subject.declarations.layout
    if not pages:
        return StreamMemory(WindowStore(layout, parallel, context, poison=poison), SlotPool(parallel), None)
    total = total or parallel * -(-context // PAGE_ROWS)
    return StreamMemory(PagedStore(layout, parallel, total, PAGE_ROWS, poison=poison), SlotPool(parallel),
                        PagePool(total, PAGE_ROWS))


class Client:
    """Collects one request's events; can cancel after a number of tokens."""

    def __init__(self, name: str, prompt: tuple[int, ...], sampling: Sampling, starts=(), cancel_after=None,
                 marks: KeepMarks | None = None):
        self.tokens: list[int] = []
        self.done: queue.Queue = queue.Queue()
        self.cancel_after = cancel_after
        self.request = Request(name, prompt, sampling, self.on_event, starts=starts,
                               marks=marks or KeepMarks())

    def on_event(self, event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token_id)
            if self.cancel_after is not None and len(self.tokens) >= self.cancel_after:
                self.request.cancel()
        else:
            self.done.put(event)

    def result(self, timeout: float = 120.0) -> DoneEvent:
        event = self.done.get(timeout=timeout)
        assert not isinstance(event, ErrorEvent), event
        return event


def engine(subject, mem: StreamMemory, tier: DeviceTier | None, host: HostTier | None = None) -> Engine:
    return Engine(subject.model, mem, prefill_chunk=CHUNK, context=CONTEXT, max_waiting=8, min_chunk=MIN_CHUNK,
                  tier=tier, host=host)


def ask(eng: Engine, client: Client) -> DoneEvent:
    eng.submit(client.request)
    return client.result()


def fresh(subject, prompt, sampling, starts) -> list[int]:
    """The same request on a fresh engine with no prompt cache."""
    eng = engine(subject, memory(subject), None)
    eng.start()
    try:
        client = Client("fresh", prompt, sampling, starts)
        assert ask(eng, client).cached_tokens == 0
        return client.tokens
    finally:
        eng.close()


def converse(eng: Engine, sampling: Sampling, salt: int = 0, cancel_turn: int | None = None):
    """Three turns, each prompt the last prompt + its reply + a new user message; starts at every message, the
    history end at the prompt end and the rewind mark at the new user message."""
    prompt: tuple[int, ...] = ()
    starts: tuple[int, ...] = ()
    turns = []
    for k, user in enumerate(USERS):
        if prompt:
            starts += (len(prompt),)  # the reply's start (the generated turn)
            prompt += tuple(turns[-1][2])
        starts += (len(prompt),) if prompt else ()
        marks = KeepMarks(rewind=len(prompt) or None)
        prompt += tokens(user, salt + k)
        client = Client(f"t{k}", prompt, sampling, starts, cancel_after=3 if k == cancel_turn else None,
                        marks=marks)
        done = ask(eng, client)
        turns.append((prompt, starts, client.tokens, done))
    return turns
