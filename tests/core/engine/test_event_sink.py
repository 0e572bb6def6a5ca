"""Events through a sink (engine/outbox.py, server/handoff.py): the real engine on the template family hands each
step's events to each event loop in one `call_soon_threadsafe`, every request hears its tokens in order and
exactly one last event, also when it is cancelled (waiting or running), stopped by an end token, refused, failed
by its logits, or when the engine dies; a sink that raises costs only its own requests their events."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tensorfold.engine.api import DeviceLost, DoneEvent, ErrorEvent, Event, EventSink, Request, Sampling, TokenEvent
from tensorfold.engine.runner import Engine
from tensorfold.server.handoff import dispatch, sink_for
from tensorfold.testing import kit
from tensorfold.testing.engine_gates import Rig

RIG = Rig(context=128, chunk=32, min_chunk=8, page_rows=16, max_waiting=16)
TRIGGER = 499  # a prompt that starts with this token is the one a fault picks


def prompt(n: int, salt: int, first: int | None = None) -> tuple[int, ...]:
    body = tuple((i * 31 + salt * 17) % 490 + 3 for i in range(n))
    return body if first is None else (first, *body[1:])


def greedy(max_tokens: int, stop: tuple[int, ...] = ()) -> Sampling:
    return Sampling(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop)


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


class LoopThread:
    """An event loop running in a thread of its own; counts the sink's hand-offs to it (`hops`)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.hops = 0
        self._plain = self.loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            self.hops += callback is dispatch
            return self._plain(callback, *args, **kwargs)

        self.loop.call_soon_threadsafe = counting
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def settle(self) -> None:
        """Wait until every callback handed to the loop so far has run."""
        done = threading.Event()
        self._plain(done.set)
        assert done.wait(60)

    def close(self) -> None:
        self._plain(self.loop.stop)
        self.thread.join(60)
        self.loop.close()


class Heard:
    """One request's events as its handler heard them, and the threads it heard them on; it can cancel its
    request on its `cancel_after`-th token, from the handler (as the server does on a stop string)."""

    def __init__(self, name: str, tokens: tuple[int, ...], sampling: Sampling, sink: EventSink,
                 cancel_after: int | None = None) -> None:
        self.events: list[Event] = []
        self.threads: set[str] = set()
        self.ended = threading.Event()
        self.cancel_after = cancel_after
        self.request = Request(name, tokens, sampling, self.on_event, sink=sink)

    def on_event(self, event: Event) -> None:
        self.events.append(event)
        self.threads.add(threading.current_thread().name)
        if isinstance(event, TokenEvent) and len(self.tokens) == self.cancel_after:
            self.request.cancel()
        if not isinstance(event, TokenEvent):
            self.ended.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEvent)]

    def last(self) -> DoneEvent | ErrorEvent:
        """The one last event, after every token (a second one, or a token after it, would be a bug)."""
        *tokens, last = self.events
        assert all(isinstance(e, TokenEvent) for e in tokens), self.events
        assert isinstance(last, (DoneEvent, ErrorEvent)), self.events
        return last


class Counting:
    """The real model, counting its steps; a step whose plan starts a prompt with TRIGGER gets a NaN row for it,
    or raises `error` when one is given."""

    def __init__(self, model, error: BaseException | None = None) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.error = error
        self.steps = 0

    def forward(self, plan, kv):
        self.steps += 1
        triggered = [share.start == 0 and share.tokens[0] == TRIGGER for share in plan.streams if share.sample]
        if self.error is not None and any(triggered):
            raise self.error
        logits = self.model.forward(plan, kv)
        for row, hit in enumerate(triggered):
            if hit:
                logits[row] = float("nan")
        return logits


def engine_of(subject, model, parallel: int) -> Engine:
    return Engine(model, RIG.memory(subject, parallel=parallel), prefill_chunk=RIG.chunk, context=RIG.context,
                  max_waiting=RIG.max_waiting, min_chunk=RIG.min_chunk)


def run(engine: Engine, clients: list[Heard], loops: list[LoopThread], waited: list[Heard] | None = None) -> None:
    """Queue every request, then start the engine (so they share its first step), wait until each (or each of
    `waited`) ended, close the engine and let every loop run what it was handed."""
    for client in clients:
        engine.submit(client.request)
    engine.start()
    try:
        for client in clients if waited is None else waited:
            assert client.ended.wait(60), f"{client.request.id} never ended"
    finally:
        engine.close()
    for loop in loops:
        loop.settle()


@pytest.fixture
def loops():
    made: list[LoopThread] = []
    yield lambda name: made.append(LoopThread(name)) or made[-1]
    for loop in made:
        loop.close()


def test_one_hand_off_per_step_per_loop(subject, loops):
    one, two = loops("loop-one"), loops("loop-two")
    model = Counting(subject.model)
    # 8-token prompts, 4 streams: the first step prefills all four (32 rows, the step's budget) and samples each
    clients = [Heard("a3", prompt(8, 1), greedy(3), sink_for(one.loop)),
               Heard("a5", prompt(8, 2), greedy(5), sink_for(one.loop)),
               Heard("b2", prompt(8, 3), greedy(2), sink_for(two.loop)),
               Heard("b7", prompt(8, 4), greedy(7), sink_for(two.loop))]
    run(engine_of(subject, model, 4), clients, [one, two])
    for client, count in zip(clients, (3, 5, 2, 7), strict=True):
        assert client.last() == DoneEvent("length", 8, count, 0)
        assert len(client.tokens) == count
    assert {name for c in clients[:2] for name in c.threads} == {"loop-one"}
    assert {name for c in clients[2:] for name in c.threads} == {"loop-two"}
    assert model.steps == 7            # every step samples a token for each stream still running
    assert (one.hops, two.hops) == (5, 7)  # one hand-off per step that had events for the loop, not one per token


def test_every_request_hears_its_tokens_then_one_last_event(subject, loops):
    one = loops("loop-one")
    sink = sink_for(one.loop)
    plain = Heard("plain", prompt(10, 5), greedy(6), sink)
    run(engine_of(subject, subject.model, 1), [plain], [one])
    assert plain.last() == DoneEvent("length", 10, 6, 0)
    end_token = plain.tokens[2]
    waiting = Heard("cancelled-waiting", prompt(10, 6), greedy(6), sink)
    waiting.request.cancel()
    clients = [Heard("stop-token", prompt(10, 5), greedy(50, stop=(end_token,)), sink),
               Heard("cancelled-running", prompt(12, 7), greedy(60), sink, cancel_after=3),
               Heard("nan", prompt(10, 8, first=TRIGGER), greedy(6), sink),
               Heard("too-long", prompt(RIG.context, 9), greedy(6), sink),
               waiting,
               Heard("other", prompt(12, 10), greedy(6), sink)]
    engine = engine_of(subject, Counting(subject.model), 2)
    run(engine, clients, [one])
    assert engine.failure is None
    stop, cancelled, nan, too_long, waited, other = (c.last() for c in clients)
    assert stop == DoneEvent("stop", 10, 3, 0) and clients[0].tokens == plain.tokens[:3]
    assert isinstance(cancelled, DoneEvent) and cancelled.finish_reason == "cancelled"
    assert cancelled.completion_tokens == len(clients[1].tokens) >= 3
    assert nan == ErrorEvent("the engine failed this request: NonFiniteLogits: the model's logits hold NaN for "
                             f"{subject.model.vocab_size} of {subject.model.vocab_size} tokens")
    assert too_long == ErrorEvent(f"prompt of {RIG.context} tokens does not fit the context of {RIG.context}")
    assert waited == DoneEvent("cancelled", 10, 0, 0)
    assert other == DoneEvent("length", 12, 6, 0)
    assert all(c.threads == {"loop-one"} for c in clients)


def test_a_dying_engine_ends_every_request_once_in_one_hand_off(subject, loops):
    one = loops("loop-one")
    sink = sink_for(one.loop)
    clients = [Heard("running", prompt(8, 11), greedy(6), sink),
               Heard("trigger", prompt(8, 12, first=TRIGGER), greedy(6), sink),
               Heard("waiting", prompt(8, 13), greedy(6), sink)]  # two slots: it waits behind the other two
    engine = engine_of(subject, Counting(subject.model, DeviceLost("the test device is gone")), 2)
    run(engine, clients, [one])
    reason = "the device is lost: DeviceLost: the test device is gone"
    assert engine.failure == reason
    assert [c.events for c in clients] == [[ErrorEvent(f"the engine stopped: {reason}")]] * 3
    assert one.hops == 1


class Broken:
    """A sink whose every delivery raises."""

    def deliver(self, events) -> None:
        raise RuntimeError("the sink broke")


def test_a_sink_that_raises_loses_only_its_own_events(subject, loops):
    one = loops("loop-one")
    lost = Heard("lost", prompt(8, 14), greedy(4), Broken())
    heard = Heard("heard", prompt(8, 15), greedy(4), sink_for(one.loop))
    engine = engine_of(subject, subject.model, 2)
    run(engine, [lost, heard], [one], waited=[heard])
    assert heard.last() == DoneEvent("length", 8, 4, 0)
    assert lost.events == [] and engine.failure is None
