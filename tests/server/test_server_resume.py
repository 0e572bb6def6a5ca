"""Chat over HTTP with kept states on: the next turn resumes from the state kept at the previous turn's history end
(its generated turn's start; usage.prompt_tokens_details.cached_tokens), from the device tier or the host tier,
and every reply equals the reply of a server with --prompt-cache-gib 0 --host-cache-gib 0. GET /memory shows both
tiers."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from tensorfold.boot import boot
from tensorfold.server import build_app
from tensorfold.settings import read_settings

QUESTIONS = ("What is the capital of France, and why is it famous?",
             "Tell me a story about a cat who lives in Paris.",
             "Now tell it again, but shorter.")


def chat_three_turns(example_family, tiny_checkpoint, prompt_cache_gib: float, host_cache_gib: float):
    settings = read_settings({}, [("TF_EXAMPLE_REQUEST_STARTS", True)], family="example", model=tiny_checkpoint,
                             context=512, prefill_chunk=64, min_chunk=16, page_rows=16,
                             prompt_cache_gib=prompt_cache_gib, host_cache_gib=host_cache_gib)
    loaded = boot(settings, example_family)
    loaded.engine.start()
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in full sentences."}]
    out = []
    try:
        with TestClient(build_app(loaded.service)) as http:
            for question in QUESTIONS:
                messages.append({"role": "user", "content": question})
                history = loaded.service.tokenizer.encode(loaded.service.tokenizer.render(messages, False))
                reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12,
                                                                "temperature": 0.7, "seed": 3})
                assert reply.status_code == 200, reply.text
                body = reply.json()
                text = body["choices"][0]["message"]["content"]
                out.append((text, body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"],
                            len(history)))
                messages.append({"role": "assistant", "content": text})
            memory = http.get("/memory").json()
    finally:
        loaded.engine.close()
    return out, memory


@pytest.fixture(scope="module")
def plain(example_family, tiny_checkpoint):
    """The replies of a server that keeps nothing."""
    out, memory = chat_three_turns(example_family, tiny_checkpoint, 0, 0)
    assert all(details["cached_tokens"] == 0 for _, _, details, _ in out)
    assert "tiers" not in memory["now"] and memory["plan"]["host_cache_bytes"] == 0
    return out


@pytest.mark.parametrize("device, host, serves", [(1.0, 0, "device"), (0, 0.05, "host"), (1e-6, 0.05, "host")],
                         ids=["device", "host-alone", "device-too-small"])
def test_chat_turns_resume_at_the_history_end_and_equal_a_server_without_kept_states(
        example_family, tiny_checkpoint, plain, device, host, serves, caplog):
    caplog.set_level(logging.INFO, logger="tensorfold.engine.scheduler")
    cached, memory = chat_three_turns(example_family, tiny_checkpoint, device, host)
    assert [text for text, _, _, _ in cached] == [text for text, _, _, _ in plain]
    assert [n for _, n, _, _ in cached] == [n for _, n, _, _ in plain]
    hits = [details["cached_tokens"] for _, _, details, _ in cached]
    # each turn resumes where the previous turn's history ended: its generated turn's start
    assert hits == [0] + [history for _, _, _, history in cached[:-1]], hits
    now = memory["now"]
    assert now["tiers"][serves]["hits"] == 2 and now["tiers"][serves]["cached_tokens"] == sum(hits)
    assert sorted(now["tiers"]) == sorted(name for name, gib in (("device", device), ("host", host)) if gib)
    assert now["integrity_when_idle"] == "ok"
    assert memory["plan"]["host_cache_bytes"] == int(host * 2**30) and memory["plan"]["host_cache_pinned"] is False
    assert f"resumed at {hits[1]} of {cached[1][1]} from {serves}" in caplog.text
    assert f"kept at {cached[1][3]} (history end) on {serves}" in caplog.text
    if serves == "device":
        assert now["prompt_cache_hits"] == 2
    else:
        assert now["host_cache_hits"] == 2 and now["host_cache_states"] > 0


def test_the_marks_are_the_system_end_the_latest_user_start_and_the_generated_turn_start(tokenizer):
    from tensorfold.engine.api import KeepMarks
    from tensorfold.server.starts import keep_marks, start_positions

    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me more."}]
    text = tokenizer.render(chat, add_generation_prompt=True)
    prompt = tokenizer.encode(text)
    positions = start_positions(tokenizer, chat, prompt, {}, text)

    def start(i: int) -> int:
        return len(tokenizer.encode(tokenizer.render(chat[:i], add_generation_prompt=False)))

    assert keep_marks(chat, positions) == KeepMarks(history=start(4), system=start(1), rewind=start(3))
    assert keep_marks(chat[1:], start_positions(tokenizer, chat[1:], tokenizer.encode(
        tokenizer.render(chat[1:], add_generation_prompt=True)), {})).system is None  # no system prompt
    assert keep_marks(chat, {}) == KeepMarks()  # nothing proven: the engine keeps at the prompt end
