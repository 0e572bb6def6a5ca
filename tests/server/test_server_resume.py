"""Chat over HTTP with the prompt cache on: the next turn resumes from the state kept at the previous turn's
generated-turn start (usage.prompt_tokens_details.cached_tokens > 0), and every reply equals the reply of a server
with --prompt-cache-gib 0."""

from __future__ import annotations

from starlette.testclient import TestClient

from tensorfold.boot import boot
from tensorfold.server import build_app
from tensorfold.settings import read_settings


def chat_three_turns(example_family, tiny_checkpoint, prompt_cache_gib: float):
    settings = read_settings({}, [("TF_EXAMPLE_REQUEST_STARTS", True)], family="example", model=tiny_checkpoint,
                             context=512, prefill_chunk=64, min_chunk=16, page_rows=16,
                             prompt_cache_gib=prompt_cache_gib)
    loaded = boot(settings, example_family)
    loaded.engine.start()
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in full sentences."}]
    out = []
    try:
        with TestClient(build_app(loaded.service)) as http:
            for question in ("What is the capital of France, and why is it famous?",
                             "Tell me a story about a cat who lives in Paris.",
                             "Now tell it again, but shorter."):
                messages.append({"role": "user", "content": question})
                reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12,
                                                                "temperature": 0.7, "seed": 3})
                assert reply.status_code == 200, reply.text
                body = reply.json()
                text = body["choices"][0]["message"]["content"]
                out.append((text, body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]))
                messages.append({"role": "assistant", "content": text})
        snapshot = loaded.engine.snapshot()
    finally:
        loaded.engine.close()
    return out, snapshot


def test_chat_turns_resume_and_equal_a_server_without_the_cache(example_family, tiny_checkpoint):
    cached, snapshot = chat_three_turns(example_family, tiny_checkpoint, 1.0)
    plain, _ = chat_three_turns(example_family, tiny_checkpoint, 0)
    assert [text for text, _, _ in cached] == [text for text, _, _ in plain]
    assert [n for _, n, _ in cached] == [n for _, n, _ in plain]
    hits = [details["cached_tokens"] for _, _, details in cached]
    assert hits[0] == 0 and all(0 < hit < n for hit, (_, n, _) in zip(hits[1:], cached[1:], strict=True)), hits
    assert all(details["cached_tokens"] == 0 for _, _, details in plain)
    assert snapshot["prompt_cache_hits"] == 2 and snapshot["integrity_when_idle"] == "ok"
