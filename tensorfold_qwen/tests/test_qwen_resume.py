"""The device tier on the qwen family (GDN fixed states + gated attention rows): a three-turn conversation whose
turns resume from kept states gives each turn the reply of a fresh engine with no prompt cache, bitwise, and a
kept state's fixed states and rows are byte-equal to those a cold pass holds at the same row."""

from __future__ import annotations

import queue

import pytest
import torch

from tensorfold.engine.api import ErrorEvent, Request, Sampling, TokenEvent
from tensorfold.engine.memory import StreamMemory
from tensorfold.engine.runner import Engine
from tensorfold.kv import PagedStore
from tensorfold.plugins import load_families
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.testing import kit
from tensorfold.tiers import DeviceTier
from tensorfold_qwen import plugin

CONTEXT, CHUNK, MIN_CHUNK, PAGE_ROWS, REPLY = 192, 32, 8, 16, 8
USERS = (41, 22, 30)


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 41 + salt * 11) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module", params=["dense", "moe"])
def subject(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"qwen-resume-{request.param}")
    plugin.write_tiny(directory, seed=3, moe=request.param == "moe")
    return kit.load(load_families(["qwen"])["qwen"], directory)


def memory(subject) -> StreamMemory:
    total = 2 * -(-CONTEXT // PAGE_ROWS)
    return StreamMemory(PagedStore(subject.declarations.layout, 2, total, PAGE_ROWS, poison=True), SlotPool(2),
                        PagePool(total, PAGE_ROWS))


def engine(subject, mem, tier) -> Engine:
    return Engine(subject.model, mem, prefill_chunk=CHUNK, context=CONTEXT, max_waiting=4, min_chunk=MIN_CHUNK,
                  tier=tier)


def ask(eng: Engine, prompt, sampling, starts):
    got: list[int] = []
    done: queue.Queue = queue.Queue()
    eng.submit(Request("r", prompt, sampling, lambda e: got.append(e.token_id) if isinstance(e, TokenEvent)
                       else done.put(e), starts=starts))
    event = done.get(timeout=120)
    assert not isinstance(event, ErrorEvent), event
    return got, event


def fresh(subject, prompt, sampling, starts) -> list[int]:
    eng = engine(subject, memory(subject), None)
    eng.start()
    try:
        return ask(eng, prompt, sampling, starts)[0]
    finally:
        eng.close()


def cold_state_at(subject, prompt, starts, at: int):
    """Drive a fresh engine's steps by hand until its one stream stands at `at`; its fixed states and rows."""
    mem = memory(subject)
    eng = engine(subject, mem, None)
    eng.submit(Request("cold", prompt, Sampling(temperature=0.0, max_tokens=1), lambda e: None, starts=starts))
    with torch.inference_mode():
        eng._take_inbox(block=False)
        eng._step()
        (stream,) = eng.scheduler.running
        while stream.position < at:
            eng._step()
    assert stream.position == at
    kv, slot = mem.kv, stream.claim.slot
    fixed = {(i, s.name): kv.fixed(i, s.name, slot).clone() for i, layer in enumerate(kv.layout.layers)
             for s in layer.fixed}
    rows = {(i, s.name): kv.rows(i, s.name, slot, at).clone() for i, layer in enumerate(kv.layout.layers)
            for s in layer.rows}
    return fixed, rows


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0, max_tokens=REPLY),
                                      Sampling(temperature=0.8, top_p=0.9, seed=5, max_tokens=REPLY)],
                         ids=["greedy", "seeded"])
def test_three_turns_resume_and_equal_fresh_runs(subject, sampling):
    mem = memory(subject)
    tier = DeviceTier(mem, budget=1 << 30)
    eng = engine(subject, mem, tier)
    eng.start()
    prompt: tuple[int, ...] = ()
    starts: tuple[int, ...] = ()
    turns = []
    try:
        for k, user in enumerate(USERS):
            if prompt:
                starts += (len(prompt), len(prompt) + len(turns[-1][2]))
                prompt += tuple(turns[-1][2])
            prompt += tokens(user, k)
            reply, done = ask(eng, prompt, sampling, starts)
            turns.append((prompt, starts, reply, done))
    finally:
        eng.close()
    previous = 0
    for k, (prompt, starts, reply, done) in enumerate(turns):
        assert len(reply) == REPLY and reply == fresh(subject, prompt, sampling, starts), f"turn {k} differs"
        assert done.cached_tokens == previous
        previous = len(prompt)
    mem.check_integrity()
    tier.check_integrity()
    assert mem.pool.free + mem.pool.kept == mem.pool.total
    # the state kept at the end of turn 1's prompt is what a cold pass of turn 3 holds at that row
    prompt, starts = turns[2][0], turns[2][1]
    state = next(s for s in tier.states if s.at == len(turns[0][0]))
    assert state.fixed, "the qwen family declares fixed states"
    fixed, rows = cold_state_at(subject, prompt, starts, state.at)
    for i, name, tensor in state.fixed:
        assert same(tensor, fixed[i, name]), f"fixed state {i} {name}"
    layers = mem.kv.layout.layers
    for i, name, tail in state.tail:
        every = next(s.every for s in layers[i].rows if s.name == name)
        pages = mem.kv.row_pages(i, name)[list(state.pages)]
        kept = torch.cat([pages.reshape(-1, *pages.shape[2:]), tail])
        assert same(kept, rows[i, name]), f"rows {i} {name}"
        assert tail.shape[0] == state.at // every - state.tail_start // every
    tier.clear()
    mem.check_integrity()
    assert mem.pool.free == mem.pool.total
