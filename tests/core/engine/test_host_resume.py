"""States the device tier lets go move to the host tier, and a turn resumed from there gives the reply a fresh
engine with no kept states gives, token for token (pages poisoned with NaN); the keep policy's points land where
it says; both tiers pass check_integrity after every run; the log says where each request resumed and what it
kept."""

from __future__ import annotations

import logging

import pytest
from resume_cases import (
    CHUNK,
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

from tensorfold.engine.api import KeepMarks, Sampling
from tensorfold.engine.runner import Engine
from tensorfold.plugins import load_families
from tensorfold.testing import engine_gates, kit
from tensorfold.testing.engine_gates import Chat
from tensorfold.tiers import DeviceTier, HostTier
from tensorfold.tiers.policy import HISTORY, REWIND, SYSTEM

BIG = 1 << 30
GREEDY = Sampling(temperature=0.0, max_tokens=REPLY)
SEEDED = Sampling(temperature=0.9, top_p=0.95, seed=7, max_tokens=REPLY)
SCHEDULER_LOG = "tensorfold.engine.scheduler"


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def check_fresh(subject, conversations, sampling) -> None:
    for conversation in conversations:
        conversation.check_fresh(subject, RIG, sampling)


def check_memory(mem, eng: Engine) -> None:
    engine_gates.check_memory(mem, eng.tiers)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_two_chats_on_a_small_device_tier_resume_from_the_host_as_fresh_runs(subject, pages, sampling, caplog):
    caplog.set_level(logging.INFO, logger=SCHEDULER_LOG)
    mem, device, host, one, two = engine_gates.chats_through_host(subject, RIG, sampling, tokens, pages, last=27)
    assert host.hits >= 3 and host.kept_total >= 3 and device.refused >= 1  # an 85-row state is too large there
    assert host.stats().cached_tokens + device.stats().cached_tokens == 45 + 45 + len(one.turns[1][0])
    assert f"one1: resumed at 45 of {len(one.turns[1][0])} from host" in caplog.text
    assert "one0: no kept state; prefilling 45 rows" in caplog.text
    assert "two0: kept at 45 (history end) on device" in caplog.text
    assert f"one1: kept at {len(one.turns[1][0])} (history end) on host" in caplog.text


def test_a_host_tier_alone_resumes_every_turn(subject):
    mem = memory(subject)
    host = HostTier(mem, budget=BIG)
    eng = engine(subject, mem, None, host)
    eng.start()
    try:
        turns = converse(eng, GREEDY, salt=11)
        check_memory(mem, eng)
    finally:
        eng.close()
    previous = 0
    for prompt, starts, reply, done in turns:
        assert done.cached_tokens == previous and reply == fresh(subject, prompt, GREEDY, starts)
        previous = len(prompt)
    assert host.hits == 2 and eng.tiers == (host,) and mem.pool.kept == 0  # a host state holds no page
    assert [s.tier for s in (t.stats() for t in eng.tiers)] == ["host"]


def test_admission_pressure_moves_kept_states_to_the_host_instead_of_dropping_them(subject):
    """A pool just big enough for one stream: kept pages are let go so the next request is admitted, into the host
    tier, and the conversation's next turn resumes from there."""
    total = -(-(sum(USERS) + 3 * REPLY + 20) // PAGE_ROWS) + 1
    mem = memory(subject, parallel=1, total=total)
    device, host = DeviceTier(mem, budget=BIG), HostTier(mem, budget=BIG)
    eng = engine(subject, mem, device, host)
    chat = Chat(tokens, 5, "chat")
    eng.start()
    try:
        for user in USERS:
            chat.turn(eng, GREEDY, user)
        other = Client("other", tokens(sum(USERS) + 2 * REPLY, 77), GREEDY)
        assert ask(eng, other).cached_tokens == 0
        assert device.evicted > 0 and len(host) == device.evicted and device.refused == 0
        last = len(chat.turns[-1][0])
        assert chat.turn(eng, GREEDY, 20).cached_tokens == last  # from the host
        check_memory(mem, eng)
    finally:
        eng.close()
    check_fresh(subject, (chat,), GREEDY)
    assert other.tokens == fresh(subject, other.request.prompt, GREEDY, ())
    assert host.hits >= 1


def test_keep_points_are_the_history_end_the_system_end_and_the_rewind_cut(subject):
    """A chat rendered as tokens: system 40, user 30, the generated turn's header 3; then the reply, a user
    message and a header again. States land on the marks' cuts with their reasons, and moved-past ones are marked."""
    system, user1, header = tokens(40, 1), tokens(30, 2), tokens(3, 3)
    first = system + user1 + header
    mem = memory(subject)
    device = DeviceTier(mem, budget=BIG)
    eng = engine(subject, mem, device)
    eng.start()
    try:
        client = Client("t0", first, GREEDY, starts=(40, 70), marks=KeepMarks(history=70, system=40, rewind=40))
        assert ask(eng, client).cached_tokens == 0
        assert {s.at: s.why for s in device.states} == {40: {SYSTEM, REWIND}, 70: {HISTORY}}
        second = first + tuple(client.tokens) + tokens(25, 4) + header
        rewind = len(first) + REPLY
        starts = (40, 70, rewind, len(second) - 3)
        again = Client("t1", second, GREEDY, starts=starts,
                       marks=KeepMarks(history=len(second) - 3, system=40, rewind=rewind))
        assert ask(eng, again).cached_tokens == 70  # the first turn's history end
        assert {s.at: s.why for s in device.states} == {40: {SYSTEM, REWIND}, 70: {HISTORY}, rewind: {REWIND},
                                                          len(second) - 3: {HISTORY}}
        assert {s.at: s.passed for s in device.states} == {40: False, 70: True, rewind: False, len(second) - 3: False}
        edited = first[:40] + tokens(33, 9) + header  # the first message edited: resumes at the system end
        assert ask(eng, Client("t2", edited, GREEDY, starts=(40, 73), marks=KeepMarks(73, 40, 40))).cached_tokens == 40
        check_memory(mem, eng)
    finally:
        eng.close()
    assert client.tokens == fresh(subject, first, GREEDY, (40, 70))
    assert again.tokens == fresh(subject, second, GREEDY, starts)
    assert CHUNK == 32 and MIN_CHUNK == 8  # the cuts above: 32, 40, 70, 73; and 32 past each start after


def test_qwen_fixed_states_come_back_from_the_host_as_a_fresh_run_has_them(tmp_path):
    """The qwen family's recurrent (fixed) states through device → host → resume: replies equal fresh runs."""
    pytest.importorskip("tensorfold_qwen")
    family = load_families(["qwen"])["qwen"]
    family.make_tiny(tmp_path, seed=3)
    subject = kit.load(family, tmp_path)
    mem = memory(subject)
    device = DeviceTier(mem, budget=subject.declarations.layout.stream_bytes(60))
    host = HostTier(mem, budget=BIG, piece_bytes=4096)
    eng = engine(subject, mem, device, host)
    one, two = Chat(tokens, 0, "one"), Chat(tokens, 50, "two")
    eng.start()
    try:
        for user in (41, 22):
            one.turn(eng, SEEDED, user)
            two.turn(eng, SEEDED, user)
        check_memory(mem, eng)
    finally:
        eng.close()
    assert [turn[3].cached_tokens for turn in one.turns] == [0, 41]
    assert [turn[3].cached_tokens for turn in two.turns] == [0, 41]
    assert host.hits == 2 and all(state.fixed for state in host.states)
    check_fresh(subject, (one, two), SEEDED)
