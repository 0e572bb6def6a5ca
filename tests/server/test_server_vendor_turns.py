"""Multi-turn chats through real servers rendering real vendor chat templates (issue 17): Qwen3.5-4B's on the qwen
family, GLM-4.7-Flash's on glm and Nemotron-3-Nano's on nemotron, each served on the family's tiny checkpoint by
two `tensorfold serve` processes with default flags: one that keeps states and one with every tier off.

Every scenario runs on both: the replies (greedy, fixed max_tokens) are the same, the tier-off server resumes
nothing, and each request on the keeping server resumes (usage.prompt_tokens_details.cached_tokens) at least at
the last message start its prompt shares with an earlier prompt sent to that server, worked out from the prompts
through /tokenize (vendor_turns.py). Each scenario also pins where that start is (the previous turn's history end,
the rewind cut, the system prompt's end), so a template change that moves it shows up here too."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
from vendor_turns import (
    NO_TIERS,
    TEMPLATES,
    VENDORS,
    Session,
    Turn,
    Vendor,
    agent,
    chat,
    edit,
    make_checkpoint,
    regenerate,
    serving_all,
    shared_system,
    tool_calls,
)

from tensorfold.settings import DEFAULT_MIN_CHUNK
from tensorfold.testing.process import tail

pytestmark = pytest.mark.slow

NO_THINKING = {"enable_thinking": False}
LONG_SYSTEM = "You are a careful assistant who answers every question in a few plain words. " * 9


@attrs.frozen
class Pair:
    """A vendor's two servers: `kept` keeps states (its turns measured), `off` has every tier off."""

    vendor: Vendor
    kept: Session
    off: Session
    log: Path


@pytest.fixture(scope="module", params=list(VENDORS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Both servers of one vendor, shared by every test of the module for that vendor."""
    vendor = VENDORS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(vendor, root / "tiny")
    common = [str(model), "--family", vendor.family, "--chat-template", str(TEMPLATES / vendor.template)]
    with serving_all([(common, root / "kept.log"), ([*common, *NO_TIERS], root / "off.log")]) as (kept, off):
        both = Pair(vendor, Session(kept, measure=True), Session(off, measure=False), root / "kept.log")
        yield both
        both.kept.close()
        both.off.close()


def run(pair: Pair, scenario: Callable[..., list[Turn]], *args: Any) -> list[Turn]:
    """The scenario on both servers at once: equal replies, no resume tiers off, every kept turn resumed enough."""
    with ThreadPoolExecutor(2) as pool:
        kept_run, off_run = pool.submit(scenario, pair.kept, *args), pool.submit(scenario, pair.off, *args)
        kept, off = kept_run.result(), off_run.result()
    assert [t.reply for t in kept] == [t.reply for t in off]
    assert [t.cached for t in off] == [0] * len(off)
    short = [(t.name, t.cached, t.expected) for t in kept if t.cached < t.expected]
    assert not short, f"resumed short of the shared start (name, cached, expected): {short}\n{tail(pair.log)}"
    return kept


def resumes_each_history_end(turns: list[Turn]) -> None:
    """Each turn shares the previous turn's history end (its generated turn's start), and nothing further."""
    for before, after in zip(turns, turns[1:], strict=False):
        assert before.history_end is not None and after.expected == before.history_end > 0, after.name


def test_a_plain_chat(pair):
    turns = run(pair, chat, "cat", "field", NO_THINKING)
    resumes_each_history_end(turns)


def test_reasoning_sent_back_in_reasoning_content(pair):
    turns = run(pair, chat, "owl", "field")
    assert all(t.reasoning for t in turns)  # every template opens the think block in its generation prompt
    resumes_each_history_end(turns)


def test_reasoning_sent_back_inside_the_content(pair):
    turns = run(pair, chat, "fox", "content")
    assert all(t.reasoning for t in turns)
    resumes_each_history_end(turns)


@pytest.mark.parametrize("arguments", ["string", "object"])
def test_tool_calls_sent_back_with_string_or_object_arguments(pair, arguments):
    first, answer, again = run(pair, tool_calls, f"sailor {arguments}", arguments)
    assert [name for name, _ in first.calls] == ["lookup"] and [name for name, _ in again.calls] == ["lookup"]
    assert answer.expected == first.history_end > 0  # the tool result extends the call's prompt
    # after the answer, a user message: the call's reply becomes older history (Qwen3.5 drops the empty think
    # block it had after the latest user message), so at least the first request's history end is shared
    assert again.expected >= first.history_end


def test_an_agent_with_several_calls_per_user_turn(pair):
    turns = run(pair, agent, "travel")
    assert [len(t.calls) for t in turns] == [1, 0, 0, 1, 0] and turns[1].reasoning
    resumes_each_history_end(turns[:3])
    resumes_each_history_end(turns[3:])
    # the new user message turns the first turn's steps into older history: each template drops their reasoning
    # by default, so the resume stops before the step that reasoned, and at least at the first user message's end
    new_user = turns[3]
    assert turns[2].latest_user_start < turns[0].history_end <= new_user.expected < turns[2].history_end


def test_an_agent_that_keeps_its_reasoning_resumes_every_step(pair):
    if pair.vendor.keep_reasoning is None:
        pytest.skip(f"{pair.vendor.template} has no switch that keeps earlier turns' reasoning")
    turns = run(pair, agent, "hiking", pair.vendor.keep_reasoning)
    assert turns[1].reasoning
    resumes_each_history_end(turns)


def test_a_system_prompt_shared_by_two_conversations(pair):
    ann, ann_next, bob, bob_next = run(pair, shared_system, "harbour", LONG_SYSTEM)
    assert bob.starts[1] >= DEFAULT_MIN_CHUNK  # long enough for the default --min-chunk to keep its end
    assert bob.expected == bob.starts[1] == ann.starts[1]
    resumes_each_history_end([ann, ann_next])
    resumes_each_history_end([bob, bob_next])


def test_an_edited_last_user_message_resumes_at_its_start(pair):
    first, second, edited = run(pair, edit, "moon")
    resumes_each_history_end([first, second])
    assert edited.expected == second.latest_user_start > first.history_end


def test_a_regenerated_reply_resumes_at_the_history_end(pair):
    first, second, again = run(pair, regenerate, "stars")
    resumes_each_history_end([first, second])
    assert again.reply == second.reply
    assert again.expected == second.history_end
