"""A conversation's next turn resumes from a kept state: each turn's reply is bitwise the reply a fresh engine
with no prompt cache gives, `cached_tokens` is the resume row, and memory comes back exactly."""

from __future__ import annotations

import pytest
import torch
from resume_cases import (
    CHUNK,
    CONTEXT,
    MIN_CHUNK,
    PAGE_ROWS,
    REPLY,
    RIG,
    USERS,
    Client,
    ask,
    converse,
    engine,
    fresh,
    memory,
    tokens,
)

from tensorfold.engine.api import Request, Sampling
from tensorfold.testing import engine_gates, kit
from tensorfold.tiers import DeviceTier


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0, max_tokens=REPLY),
                                      Sampling(temperature=0.9, top_p=0.95, seed=7, max_tokens=REPLY)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_each_turn_resumes_and_equals_a_fresh_run(subject, sampling, pages):
    engine_gates.check_device_resume(subject, RIG, sampling, tokens, USERS, pages=pages)


def test_a_resume_shares_the_kept_pages_and_restores_them_byte_equal(subject):
    """Admission by hand: the resumer's slot holds, at the resume row, exactly the rows the source held."""
    from tensorfold.engine.scheduler import Scheduler

    mem = memory(subject)
    tier = DeviceTier(mem, budget=1 << 30)
    eng = engine(subject, mem, tier)
    eng.start()
    try:
        turns = converse(eng, Sampling(temperature=0.0, max_tokens=REPLY))[:1]
    finally:
        eng.close()
    prompt, starts, reply, _ = turns[0]
    scheduler = Scheduler(mem, CONTEXT, CHUNK, MIN_CHUNK, tier)
    longer = prompt + tuple(reply) + tokens(20, 9)
    scheduler.waiting.append(Request("r", longer, Sampling(max_tokens=4), lambda e: None,
                                     starts=starts + (len(prompt), len(prompt) + len(reply))))
    (stream,) = scheduler.admit()
    # turn 2 kept its rewind cut at its user message's start: the longest prefix this prompt may resume from
    assert stream.position == stream.cached == len(prompt) + len(reply)
    state = next(s for s in tier.states if s.at == stream.cached)
    assert stream.claim.lease.pages[: len(state.pages)] == list(state.pages)
    kv = mem.kv
    for i, layer in enumerate(kv.layout.layers):
        for spec in layer.rows:
            restored = kv.rows(i, spec.name, stream.claim.slot, state.at)[state.tail_start:]
            kept = next(t for j, n, t in state.tail if (j, n) == (i, spec.name))
            assert restored.reshape(-1).view(torch.uint8).equal(kept.reshape(-1).view(torch.uint8))
    scheduler.finish(stream)
    mem.check_integrity()
    tier.check_integrity()


def test_a_budget_too_small_to_keep_anything_prefills_in_full_with_the_same_replies(subject):
    sampling = Sampling(temperature=0.0, max_tokens=REPLY)
    mem = memory(subject)
    tier = DeviceTier(mem, budget=1)
    eng = engine(subject, mem, tier)
    eng.start()
    try:
        turns = converse(eng, sampling, salt=3)
    finally:
        eng.close()
    for prompt, starts, reply, done in turns:
        assert done.cached_tokens == 0 and reply == fresh(subject, prompt, sampling, starts)
    assert len(tier) == 0 and tier.hits == 0
    mem.check_integrity()
    assert mem.pool.free == mem.pool.total


def test_kept_states_give_way_when_a_lease_does_not_fit(subject):
    """A pool just big enough for one stream: kept pages are evicted so the next request is admitted, and the
    replies do not change."""
    sampling = Sampling(temperature=0.0, max_tokens=REPLY)
    total = -(-(sum(USERS) + 3 * REPLY) // PAGE_ROWS) + 1
    mem = memory(subject, parallel=1, total=total)
    tier = DeviceTier(mem, budget=1 << 30)
    eng = engine(subject, mem, tier)
    eng.start()
    try:
        turns = converse(eng, sampling, salt=5)
        other = Client("other", tokens(sum(USERS) + 2 * REPLY, 77), sampling)
        assert ask(eng, other).cached_tokens == 0
    finally:
        eng.close()
    for prompt, starts, reply, _ in turns:
        assert reply == fresh(subject, prompt, sampling, starts)
    assert other.tokens == fresh(subject, other.request.prompt, sampling, ())
    assert tier.evicted > 0
    mem.check_integrity()
    tier.check_integrity()
    assert mem.pool.free + mem.pool.kept == mem.pool.total


def test_a_cancelled_resuming_stream_gives_back_only_its_own_hold(subject):
    sampling = Sampling(temperature=0.0, max_tokens=REPLY)
    mem = memory(subject)
    tier = DeviceTier(mem, budget=1 << 30)
    eng = engine(subject, mem, tier)
    eng.start()
    try:
        turns = converse(eng, sampling, salt=2, cancel_turn=1)
        assert turns[1][3].finish_reason == "cancelled" and turns[1][3].cached_tokens == len(turns[0][0])
        mem.check_integrity()
        tier.check_integrity()
        again = Client("again", turns[1][0], sampling, turns[1][1])  # turn 2 asked again resumes once more
        done = ask(eng, again)
    finally:
        eng.close()
    assert done.cached_tokens >= len(turns[0][0])
    assert again.tokens == fresh(subject, turns[1][0], sampling, turns[1][1])
    assert turns[1][2] == again.tokens[: len(turns[1][2])]
    mem.check_integrity()
    tier.check_integrity()
    assert mem.pool.free + mem.pool.kept == mem.pool.total
    tier.clear()
    assert mem.pool.free == mem.pool.total
