"""Short turns resume under the default --min-chunk (issue 17): every history end is a cut and a kept state, and the
next turn or tool step resumes exactly there, with the reply a fresh engine with no kept states gives.

Prompts are rendered chats as raw tokens: a message is a header (HEADER tokens) and its content; a request's
prompt ends with the generated turn's header, so its history end (the generated turn's start) is HEADER rows
before the prompt end, as the server finds it (server/starts.py). The next request's prompt is this one's + the
reply + the next message(s), so the history end is a plain message start there (the reply's)."""

from __future__ import annotations

import pytest

from tensorfold.cuts import plan_cuts
from tensorfold.engine.api import KeepMarks, Sampling
from tensorfold.settings import DEFAULT_MIN_CHUNK
from tensorfold.testing import kit
from tensorfold.testing.engine_gates import Client, Rig, ask, check_memory, running
from tensorfold.tiers import DeviceTier
from tensorfold.tiers.policy import HISTORY, REWIND, SYSTEM

RIG = Rig(context=512, chunk=32, min_chunk=DEFAULT_MIN_CHUNK, page_rows=16, max_waiting=8)
HEADER = 3
REPLY = 10
GREEDY = Sampling(temperature=0.0, max_tokens=REPLY)


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 41 + salt * 17) % 500 + 3 for i in range(n))


class Convo:
    """One conversation's requests: the prompt so far, its proven starts and its keep marks."""

    def __init__(self) -> None:
        self.prompt: tuple[int, ...] = ()
        self.starts: list[int] = []
        self.system: int | None = None  # the first non-system message's start, unless it is the first message
        self.spoke = False  # a non-system message came
        self.rewind: int | None = None
        self.salt = 0

    def message(self, role: str, size: int) -> None:
        """Append a message of `size` tokens, header included."""
        assert size > HEADER
        if self.prompt:
            self.starts.append(len(self.prompt))
        if role != "system" and not self.spoke:
            self.spoke = True
            self.system = len(self.prompt) or None
        if role == "user" and self.prompt:
            self.rewind = len(self.prompt)
        self.salt += 1
        self.prompt += tokens(size, self.salt)

    def ask(self, eng, name: str) -> tuple[tuple[int, ...], tuple[int, ...], list[int], int]:
        """Ask for the generated turn: prompt + its header; returns prompt, starts, reply, cached_tokens. The reply
        joins the history (an assistant message whose header is the generated turn's)."""
        history = len(self.prompt)
        prompt = self.prompt + (1,) * HEADER
        starts = (*self.starts, history)
        client = Client(name, prompt, GREEDY, starts,
                        marks=KeepMarks(history=history, system=self.system, rewind=self.rewind))
        done = ask(eng, client)
        assert done.prompt_tokens == len(prompt)
        self.starts.append(history)
        self.prompt = prompt + tuple(client.tokens)
        return prompt, starts, client.tokens, done.cached_tokens


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def run(subject, steps):
    """Run `steps` (each a list of (role, size) messages before a generated turn) as one conversation; the
    requests (prompt, starts, reply, cached) and the tier's kept states."""
    mem = RIG.memory(subject)
    tier = DeviceTier(mem, budget=1 << 30)
    eng = RIG.engine(subject, mem, tier)
    convo = Convo()
    asked = []
    with running(eng):
        for k, messages in enumerate(steps):
            for role, size in messages:
                convo.message(role, size)
            asked.append(convo.ask(eng, f"r{k}"))
    kept = {s.at: s.why for s in tier.states}
    check_memory(mem, (tier,))
    tier.clear()
    mem.check_integrity()
    return asked, kept


def check(subject, asked):
    """Request k resumes at request k-1's history end, a cut of its own pass, with the fresh reply."""
    previous = 0
    for k, (prompt, starts, reply, cached) in enumerate(asked):
        assert cached == previous, f"request {k} resumed at {cached}, not {previous}"
        assert previous == 0 or previous in plan_cuts(len(prompt), starts, RIG.chunk, RIG.min_chunk)
        assert reply == RIG.fresh(subject, prompt, GREEDY, starts), f"request {k} differs from a fresh run"
        previous = len(prompt) - HEADER


def test_a_chat_of_51_114_175_token_turns_resumes_at_each_history_end(subject):
    assert DEFAULT_MIN_CHUNK == 256  # each turn is shorter than the default min chunk
    asked, kept = run(subject, [[("user", 48)], [("user", 50)], [("user", 48)]])
    assert [len(p) for p, *_ in asked] == [51, 114, 175]
    check(subject, asked)
    # each request kept its history end; turns 2 and 3 their rewind cut (the new user message) as well
    assert kept == {48: {HISTORY}, 61: {REWIND}, 111: {HISTORY}, 124: {REWIND}, 172: {HISTORY}}


def test_an_edited_last_user_message_resumes_at_its_rewind_cut(subject):
    mem = RIG.memory(subject)
    tier = DeviceTier(mem, budget=1 << 30)
    eng = RIG.engine(subject, mem, tier)
    convo = Convo()
    with running(eng):
        for k, size in enumerate((48, 50)):
            convo.message("user", size)
            convo.ask(eng, f"t{k}")
        rewind = len(convo.prompt)
        edited = convo.prompt + tokens(30, 99) + (1,) * HEADER
        starts = (*convo.starts, rewind, rewind + 30)
        client = Client("edit", edited, GREEDY, starts,
                        marks=KeepMarks(history=rewind + 30, rewind=rewind))
        convo.message("user", 40)
        convo.ask(eng, "t2")  # the original last turn: it keeps its rewind cut 13 rows past where it resumed
        done = ask(eng, client)
    assert done.cached_tokens == rewind
    assert client.tokens == RIG.fresh(subject, edited, GREEDY, starts)
    check_memory(mem, (tier,))
    tier.clear()


def test_tool_steps_of_80_to_130_tokens_each_resume(subject):
    # a system prompt and a user message, then tool steps: the reply (a tool call) and a tool result per step
    steps = [[("system", 20), ("user", 20)]] + [[("tool", size - REPLY - HEADER)] for size in (80, 105, 130, 95)]
    asked, kept = run(subject, steps)
    sizes = [len(asked[0][0])] + [len(b) - len(a) for (a, *_), (b, *_) in zip(asked, asked[1:], strict=False)]
    assert sizes == [43, 80, 105, 130, 95]
    check(subject, asked)
    # the system end and the rewind cut share the user message's start; every step kept its history end
    ends = [len(p) - HEADER for p, *_ in asked]
    assert kept == {20: {SYSTEM, REWIND}, **{end: {HISTORY} for end in ends}}
