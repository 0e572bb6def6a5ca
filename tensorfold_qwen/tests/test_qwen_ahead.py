"""Decode steps launched ahead (engine/ahead.py) through the real engine and the Qwen family's decode runner: the
same tokens and finish reasons as the loop that reads every step back before planning the next, with greedy and
seeded requests ending at different steps by stop token, max_tokens and the context; and no token is ever handed
out past a stop token, a max_tokens or a cancel. On the CPU the runner is eager; on CUDA it replays graphs."""

from __future__ import annotations

import pytest
import torch

from tensorfold.engine.api import DoneEvent, Sampling
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

CONTEXT, PAGE_ROWS, CHUNK, PARALLEL = 96, 16, 32, 6
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]
REQUESTS = [  # (prompt length, sampling): ends at different steps, so rows are dropped from full and shrinking steps
    (20, Sampling(temperature=0.0, max_tokens=24)),
    (7, Sampling(temperature=1.0, seed=11, max_tokens=30)),
    (33, Sampling(temperature=0.8, top_p=0.9, seed=3, max_tokens=18)),
    (16, Sampling(temperature=1.2, top_k=20, seed=5, max_tokens=27)),
    (80, Sampling(temperature=0.0, max_tokens=40)),  # the context (96) ends it first
    (5, Sampling(temperature=0.7, min_p=0.05, seed=2**64 - 1, max_tokens=1)),
]


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 11) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module", params=DEVICES)
def subject(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"qwen-ahead-{request.param}")
    plugin.write_tiny(directory, seed=7)
    return kit.load(load_families(["qwen"])["qwen"], directory, dtype=torch.float32, device=request.param)


def serve(subject, clients: list[Client], overlap: bool) -> tuple[list[DoneEvent], int]:
    """The clients' requests submitted at once to one engine; their last events and the steps launched ahead."""
    pages = PARALLEL * -(-CONTEXT // PAGE_ROWS)
    kv = PagedStore(subject.declarations.layout, PARALLEL, pages, PAGE_ROWS, subject.device, poison=True)
    memory = StreamMemory(kv, SlotPool(PARALLEL), PagePool(pages, PAGE_ROWS))
    runner = DecodeRunner(subject.model, kv, batch_sizes(PARALLEL), CONTEXT, graphs=kv.device.type == "cuda")
    runner.capture()
    with running(Engine(runner, memory, CHUNK, CONTEXT, 16, overlap=overlap)) as engine:
        for client in clients:
            engine.submit(client.request)
        done = [client.result() for client in clients]
    return done, runner.ahead


def clients_of(stops: dict[int, int] | None = None, cancels: dict[int, int] | None = None) -> list[Client]:
    stops, cancels = stops or {}, cancels or {}
    out = []
    for salt, (n, sampling) in enumerate(REQUESTS):
        if salt in stops:
            sampling = Sampling(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                min_p=sampling.min_p, seed=sampling.seed, max_tokens=sampling.max_tokens,
                                stop_token_ids=(stops[salt],))
        out.append(Client(f"r{salt}", prompt(n, salt), sampling, cancel_after=cancels.get(salt)))
    return out


def test_steps_launched_ahead_give_the_tokens_of_steps_read_back_first(subject):
    plain = clients_of()
    serve(subject, plain, overlap=False)
    assert [len(c.tokens) for c in plain] == [24, 30, 18, 27, CONTEXT - 80, 1]
    # each of the first four stops on the token it made at an index of its own: the stop comes mid-stream
    at = {0: 5, 1: 11, 2: 2, 3: 20}
    stops = {salt: plain[salt].tokens[index] for salt, index in at.items()}
    for overlap in (False, True):
        clients = clients_of(stops)
        done, ahead = serve(subject, clients, overlap)
        assert (ahead > 0) == overlap
        for salt, client in enumerate(clients):
            first = plain[salt].tokens.index(stops[salt]) if salt in stops else None
            expected = plain[salt].tokens[: first + 1] if first is not None else plain[salt].tokens
            assert client.tokens == expected, (overlap, salt)
            reason = "stop" if first is not None else "length"
            assert (done[salt].finish_reason, done[salt].completion_tokens) == (reason, len(expected))


def test_a_cancel_from_the_handler_ends_the_stream_at_that_token(subject):
    cancels = {0: 3, 1: 1, 3: 9}
    clients = clients_of(cancels=cancels)
    done, ahead = serve(subject, clients, overlap=True)
    assert ahead > 0
    for salt, after in cancels.items():
        assert len(clients[salt].tokens) == after
        assert (done[salt].finish_reason, done[salt].completion_tokens) == ("cancelled", after)
    assert [len(clients[s].tokens) for s in (2, 4, 5)] == [18, CONTEXT - 80, 1]


class FailingAhead(DecodeRunner):
    """A runner whose `fail_at`-th step launched ahead raises, once."""

    fail_at = 3

    def forward_ahead(self, plan, kv, source):
        self.fail_at -= 1
        if self.fail_at == 0:
            raise RuntimeError("a forward launched ahead failed")
        return super().forward_ahead(plan, kv, source)


class NanAhead(DecodeRunner):
    """A runner whose steps launched ahead give NaN logits to the row of slot `poisoned` from the 2nd on."""

    poisoned, seen = 0, 0

    def forward_ahead(self, plan, kv, source):
        out = super().forward_ahead(plan, kv, source)
        self.seen += 1
        if out is not None and self.seen >= 2:
            for row, share in enumerate(plan.streams):
                if share.slot == self.poisoned:
                    out[row] = float("nan")
        return out


def engine_of(subject, runner_type):
    pages = PARALLEL * -(-CONTEXT // PAGE_ROWS)
    kv = PagedStore(subject.declarations.layout, PARALLEL, pages, PAGE_ROWS, subject.device, poison=True)
    memory = StreamMemory(kv, SlotPool(PARALLEL), PagePool(pages, PAGE_ROWS))
    runner = runner_type(subject.model, kv, batch_sizes(PARALLEL), CONTEXT, graphs=kv.device.type == "cuda")
    runner.capture()
    return Engine(runner, memory, CHUNK, CONTEXT, 16, overlap=True), runner


def ended(client: Client, timeout: float = 120.0):
    return client.done.get(timeout=timeout)


def test_a_step_launched_ahead_that_raises_fails_its_streams_and_the_engine_goes_on(subject):
    engine, runner = engine_of(subject, FailingAhead)
    with running(engine):
        first = clients_of()[:3]
        for client in first:
            engine.submit(client.request)
        events = [ended(client) for client in first]
        assert all(type(e).__name__ == "ErrorEvent" and "a forward launched ahead failed" in e.message
                   for e in events), events
        later = clients_of()[:2]             # the same requests again: their solo tokens, from a running engine
        for client in later:
            engine.submit(client.request)
        assert [ended(client).finish_reason for client in later] == ["length", "length"]
    plain = clients_of()[:2]
    serve(subject, plain, overlap=False)
    assert [c.tokens for c in later] == [c.tokens for c in plain]
    assert engine.integrity == "ok" and runner.ahead > 0


def test_nan_logits_in_a_step_launched_ahead_fail_that_stream_alone(subject):
    engine, runner = engine_of(subject, NanAhead)
    clients = clients_of()[:3]
    with running(engine):
        for client in clients:
            engine.submit(client.request)
        events = [ended(client) for client in clients]
    plain = clients_of()[:3]
    serve(subject, plain, overlap=False)
    failed = [i for i, e in enumerate(events) if type(e).__name__ == "ErrorEvent"]
    assert len(failed) == 1 and "NaN" in events[failed[0]].message
    for i, (client, reference) in enumerate(zip(clients, plain, strict=True)):
        if i in failed:
            assert client.tokens == reference.tokens[: len(client.tokens)]   # what it had before is exact
        else:
            assert client.tokens == reference.tokens and events[i].finish_reason == "length"
    assert engine.integrity == "ok"
