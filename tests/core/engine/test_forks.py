"""Forks (Request.forks, the API's `n`) through the real engine on the template family: n seeded forks give the
tokens of n separate requests with their seeds, the prompt is prefilled once, greedy forks are equal, grammars and
penalties hold per fork, a request ended before its fork point ends its forks, a group waits for room for all of
its streams, and the other streams of the engine are served as they are alone."""

from __future__ import annotations

import json
import threading

import attrs
import pytest
import torch

from tensorfold.engine.api import DoneEvent, ErrorEvent, Event, Request, Sampling, TokenEvent
from tensorfold.engine.grammar import Grammars, GrammarSpec
from tensorfold.engine.runner import Engine
from tensorfold.kv import KvStore
from tensorfold.memory import StreamMemory
from tensorfold.plan import StepPlan
from tensorfold.settings import DEFAULT_MIN_CHUNK
from tensorfold.testing import engine_gates, kit
from tensorfold.testing.engine_gates import Client, Rig, running
from tensorfold.testing.fixtures import one_thread  # noqa: F401  (autouse: a tiny model gains nothing from threads)
from tensorfold.tiers import DeviceTier
from tensorfold.tokenizer import ChatTokenizer

RIG = Rig(context=160, chunk=32, min_chunk=DEFAULT_MIN_CHUNK, page_rows=16, max_waiting=16)
SEEDED = Sampling(temperature=1.0, top_p=0.95, seed=41, max_tokens=12)
PROMPT_LEN = 70  # three prefill chunks of 32 on the rig's grid


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 31 + salt * 17) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def group(name: str, tokens: tuple[int, ...], sampling: Sampling, n: int) -> list[Client]:
    """n clients of one prompt, the first with the others as its forks: choice i with seed s + i (when seeded)."""
    clients = [Client(f"{name}{i}", tokens, choice_sampling(sampling, i)) for i in range(n)]
    clients[0].request.forks = tuple(client.request for client in clients[1:])
    return clients


def choice_sampling(sampling: Sampling, i: int) -> Sampling:
    return sampling if sampling.seed is None else attrs.evolve(sampling, seed=sampling.seed + i)


def serve(subject, clients: list[Client], parallel: int, pages: bool = True, model: object | None = None,
          submit: list[Client] | None = None) -> tuple[list[Event], StreamMemory]:
    """`submit` (default: the first client, the others being its forks) into one engine; every client's last
    event; memory checked whole after."""
    mem = RIG.memory(subject, parallel, pages=pages)
    engine = Engine(model if model is not None else subject.model, mem, prefill_chunk=RIG.chunk,
                    context=RIG.context, max_waiting=16, min_chunk=RIG.min_chunk)
    submitted = submit if submit is not None else [clients[0]]
    with running(engine):
        for client in submitted:
            engine.submit(client.request)
        events = [client.done.get(timeout=120) for client in clients]
    check_whole(mem)
    return events, mem


def check_whole(mem: StreamMemory) -> None:
    mem.check_integrity()
    assert mem.slots.free == mem.slots.count
    assert mem.pool is None or mem.pool.free == mem.pool.total


def alone(subject, tokens: tuple[int, ...], sampling: Sampling) -> list[int]:
    return engine_gates.serve_all(subject, RIG, [(tokens, sampling)], 1)[0]


class Counting:
    """The model, counting the rows each forward is fed: prompt rows (shares starting inside the prompt) apart."""

    def __init__(self, model: object, prompt_len: int) -> None:
        self.model, self.prompt_len = model, prompt_len
        self.prefill_rows = self.rows = 0

    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        for share in plan.streams:
            self.rows += len(share.tokens)
            if share.start < self.prompt_len:
                self.prefill_rows += len(share.tokens)
        return self.model.forward(plan, kv)


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_seeded_forks_equal_separate_requests(subject, pages):
    tokens = prompt(PROMPT_LEN, 1)
    clients = group("g", tokens, SEEDED, 3)
    events, _ = serve(subject, clients, 3, pages=pages)
    for i, (client, done) in enumerate(zip(clients, events, strict=True)):
        assert client.tokens == alone(subject, tokens, attrs.evolve(SEEDED, seed=41 + i)), f"choice {i}"
        assert done == DoneEvent("length", PROMPT_LEN, 12, 0)
    assert len({tuple(c.tokens) for c in clients}) == 3


def test_the_prompt_is_prefilled_once(subject):
    tokens = prompt(PROMPT_LEN, 2)
    model = Counting(subject.model, PROMPT_LEN)
    clients = group("p", tokens, SEEDED, 3)
    serve(subject, clients, 3, model=model)
    assert model.prefill_rows == PROMPT_LEN
    assert model.rows == PROMPT_LEN + 3 * (SEEDED.max_tokens - 1)  # each choice's first token came from the prefill


def test_forks_count_as_requests_in_the_stats(subject):
    mem = RIG.memory(subject, 3)
    engine = Engine(subject.model, mem, prefill_chunk=RIG.chunk, context=RIG.context, max_waiting=16)
    clients = group("s", prompt(PROMPT_LEN, 3), SEEDED, 3)
    with running(engine):
        engine.submit(clients[0].request)
        for client in clients:
            client.result()
    snap = engine.stats.snapshot()
    assert snap.prompt_tokens == 3 * PROMPT_LEN and snap.generation_tokens == 3 * SEEDED.max_tokens
    assert snap.finished["length"] == 3 and snap.ttft.count == 3 and snap.queue.count == 3


def test_greedy_forks_are_equal(subject):
    tokens = prompt(PROMPT_LEN, 4)
    greedy = Sampling(temperature=0.0, max_tokens=10)
    clients = group("q", tokens, greedy, 4)
    serve(subject, clients, 4)
    assert [c.tokens for c in clients] == [alone(subject, tokens, greedy)] * 4


def test_forks_with_penalties_equal_separate_requests(subject):
    tokens = prompt(PROMPT_LEN, 5)
    penalized = attrs.evolve(SEEDED, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    clients = group("f", tokens, penalized, 3)
    serve(subject, clients, 3)
    for i, client in enumerate(clients):
        assert client.tokens == alone(subject, tokens, choice_sampling(penalized, i)), f"choice {i}"


def test_forks_each_follow_their_own_grammar(subject, tiny_dir):
    chat = ChatTokenizer(tiny_dir)
    grammars = Grammars(chat.tokenizer, subject.model.vocab_size, chat.eos_ids, json_whitespace=1)
    spec = GrammarSpec("choice", json.dumps(["Paris", "Berlin", "New York"]))
    sampling = Sampling(temperature=1.0, seed=7, max_tokens=40, stop_token_ids=chat.eos_ids)
    tokens = prompt(PROMPT_LEN, 6)
    clients = group("m", tokens, sampling, 3)
    for client in clients:
        client.request.grammar = grammars.matcher(spec)
    events, _ = serve(subject, clients, 3)
    for i, (client, done) in enumerate(zip(clients, events, strict=True)):
        assert done.finish_reason == "stop" and chat.decode(client.tokens) in ("Paris", "Berlin", "New York")
        single = Client("one", tokens, choice_sampling(sampling, i))
        single.request.grammar = grammars.matcher(spec)
        serve(subject, [single], 1, submit=[single])
        assert client.tokens == single.tokens, f"choice {i}"


class CancelAtFirstStep:
    """The model; on its first forward it cancels a request (still prefilling: its fork point is steps away)."""

    def __init__(self, model: object, request: Request) -> None:
        self.model, self.request = model, request

    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        self.request.cancel()
        return self.model.forward(plan, kv)


class FailAtFirstStep:
    """The model; its first forward raises (the step fails its streams), the later ones run."""

    def __init__(self, model: object) -> None:
        self.model, self.calls = model, 0

    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected")
        return self.model.forward(plan, kv)


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_a_parent_cancelled_before_its_fork_point_ends_every_fork(subject, pages):
    clients = group("c", prompt(PROMPT_LEN, 7), SEEDED, 3)
    events, _ = serve(subject, clients, 3, pages=pages, model=CancelAtFirstStep(subject.model, clients[0].request))
    assert events == [DoneEvent("cancelled", PROMPT_LEN, 0, 0)] * 3
    assert all(c.tokens == [] for c in clients)


def test_a_parent_cancelled_while_waiting_ends_every_fork(subject):
    clients = group("w", prompt(PROMPT_LEN, 8), SEEDED, 3)
    clients[0].request.cancel()
    events, _ = serve(subject, clients, 3)
    assert events == [DoneEvent("cancelled", PROMPT_LEN, 0, 0)] * 3


def test_a_parent_failed_before_its_fork_point_fails_every_fork(subject):
    clients = group("x", prompt(PROMPT_LEN, 9), SEEDED, 3)
    events, _ = serve(subject, clients, 3, model=FailAtFirstStep(subject.model))
    assert all(isinstance(e, ErrorEvent) and "injected" in e.message for e in events)
    assert events[0] == events[1] == events[2]


def test_a_fork_cancelled_before_the_fork_point_ends_alone(subject):
    tokens = prompt(PROMPT_LEN, 10)
    clients = group("k", tokens, SEEDED, 3)
    clients[1].request.cancel()
    events, _ = serve(subject, clients, 3)
    assert events[1] == DoneEvent("cancelled", PROMPT_LEN, 0, 0) and clients[1].tokens == []
    assert clients[2].tokens == alone(subject, tokens, choice_sampling(SEEDED, 2))


def test_a_group_waits_for_room_for_all_its_streams(subject):
    order: list[str] = []
    lock = threading.Lock()

    def recorder(client: Client, name: str):
        inner = client.on_event

        def on_event(event: Event) -> None:
            with lock:
                order.append(f"{name}:{'token' if isinstance(event, TokenEvent) else 'done'}")
            inner(event)
        client.request.on_event = on_event

    first = Client("first", prompt(30, 11), Sampling(temperature=0.0, max_tokens=30))
    recorder(first, "first")
    tokens = prompt(PROMPT_LEN, 12)
    clients = group("g", tokens, SEEDED, 3)
    for i, client in enumerate(clients):
        recorder(client, f"g{i}")
    serve(subject, [first, *clients], 3, submit=[first, clients[0]])
    assert order.index("first:done") < min(order.index(f"g{i}:token") for i in range(3))
    for i, client in enumerate(clients):
        assert client.tokens == alone(subject, tokens, choice_sampling(SEEDED, i)), f"choice {i}"


def test_a_group_larger_than_the_engine_fails_at_once(subject):
    clients = group("big", prompt(PROMPT_LEN, 13), SEEDED, 3)
    events, _ = serve(subject, clients, 2)
    assert all(isinstance(e, ErrorEvent) and "3 streams of one prompt need as many slots" in e.message
               for e in events)


@pytest.mark.parametrize("parallel, pages", [(11, True), (5, False)], ids=["all-at-once", "windows-waiting"])
def test_other_streams_are_served_as_alone(subject, parallel, pages):
    requests = engine_gates.mixed_requests(prompt)
    solo = engine_gates.alone(subject, RIG, requests)
    others = [Client(f"r{i}", p, sampling) for i, (p, sampling) in enumerate(requests)]
    tokens = prompt(PROMPT_LEN, 14)
    clients = group("g", tokens, SEEDED, 3)
    mixed = [*others[:4], clients[0], *others[4:]]
    serve(subject, [*others, *clients], parallel, pages=pages, submit=mixed)
    assert [c.tokens for c in others] == solo
    for i, client in enumerate(clients):
        assert client.tokens == alone(subject, tokens, choice_sampling(SEEDED, i)), f"choice {i}"


def test_forks_of_a_resumed_request_share_its_cached_tokens(subject):
    rig = attrs.evolve(RIG, min_chunk=8)  # keep points closer than the default min_chunk apart
    mem = rig.memory(subject, 3)
    tier = DeviceTier(mem, budget=1 << 30)
    head = prompt(64, 15)  # two whole chunks: a kept state at 64 is one the longer prompt's own pass makes
    tokens = head + prompt(10, 16)
    clients = group("r", tokens, SEEDED, 3)
    with running(rig.engine(subject, mem, tier)) as engine:
        engine_gates.ask(engine, Client("head", head, SEEDED))
        engine.submit(clients[0].request)
        events = [client.result() for client in clients]
    assert events == [DoneEvent("length", len(tokens), 12, 64)] * 3
    for i, client in enumerate(clients):
        assert client.tokens == rig.fresh(subject, tokens, choice_sampling(SEEDED, i)), f"choice {i}"
    engine_gates.check_memory(mem, (tier,))
