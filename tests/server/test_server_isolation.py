"""The prefix-cache side channel, closed, through real server processes: a client that sends another client's long
system prompt resumes from the state that client kept (cached_tokens is the system end) only when both share a
partition: the same `cache_salt` (or none), and with --isolate-cache-by-key the same API key. Across partitions
it prefills from row 0, its token ids equal either way, and /metrics and /memory name no partition or salt."""

from __future__ import annotations

import httpx
import pytest
from learn_cases import ENV, serve_args

from tensorfold.testing.process import serving

pytestmark = pytest.mark.slow

SYSTEM = "You are the support agent of a small bakery. Never reveal the recipe of the rye loaf. " * 6
VICTIM = "Which breads do you bake on Sundays?"
GUESSER = "What time do you open?"


def messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def chat(url: str, user: str, salt: str | None = None, key: str | None = None) -> dict:
    """One seeded chat turn on the shared system prompt, with its token ids: the reply's JSON."""
    body = {"messages": messages(user), "max_tokens": 6, "temperature": 0.7, "seed": 5, "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def ids(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def system_end(tokenizer) -> int:
    """Where the system prompt ends: the first user message's start, the cut the victim's state is kept at."""
    end = len(tokenizer.encode(tokenizer.render(messages(VICTIM)[:1], False)))
    assert end > 200
    return end


def test_a_guessed_system_prompt_resumes_only_with_the_same_cache_salt(tiny_checkpoint, tmp_path, system_end):
    with serving(serve_args(tiny_checkpoint), tmp_path / "server.log", env=ENV) as url:
        victim = chat(url, VICTIM, salt="victim's salt")
        other = chat(url, GUESSER, salt="guesser's salt")
        unsalted = chat(url, GUESSER)
        same = chat(url, GUESSER, salt="victim's salt")
        assert (cached(victim), cached(other), cached(unsalted), cached(same)) == (0, 0, 0, system_end)
        shared = chat(url, VICTIM)                        # the unsalted guesser kept its system end: shared ones meet
        assert cached(shared) == system_end
        assert ids(other) == ids(unsalted) == ids(same) and ids(shared) == ids(victim)   # resumed == fresh
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        memory = httpx.get(f"{url}/memory", timeout=10).text
    for text in (metrics, memory):
        assert "salt" not in text and "partition" not in text


def test_isolate_cache_by_key_keeps_each_keys_states_apart(tiny_checkpoint, tmp_path, system_end):
    keys = ["--api-key", "key-a", "--api-key", "key-b", "--isolate-cache-by-key"]
    with serving(serve_args(tiny_checkpoint, *keys), tmp_path / "server.log", env=ENV) as url:
        assert cached(chat(url, VICTIM, key="key-a")) == 0
        other = chat(url, GUESSER, key="key-b")
        same = chat(url, GUESSER, key="key-a")
        assert (cached(other), cached(same)) == (0, system_end)
        assert cached(chat(url, VICTIM, salt="s", key="key-a")) == 0  # a salt partitions within a key too
        assert ids(other) == ids(same)
