"""Input that once reached a 500 is a 400 naming the field (or the body) on every JSON route of a real server:
nesting past the recursion limit, integers past Python's 4,300 digits, lone surrogates, NaN and Infinity, numbers
too large for a float; and /health answers while a burst of large bodies is refused and parsed."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from raw_http import head, send_and_read

CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
NESTED = "[" * 5000 + "]" * 5000
HUGE_INT = "7" * 5000
SURROGATE = '"a\\ud800b"'
JSON = {"content-type": "application/json"}


def post_raw(server, path: str, body: str) -> httpx.Response:
    """POST a JSON text written by hand (what json.dumps will not write)."""
    return httpx.post(server.base_url + path, content=body.encode(), headers=JSON, timeout=60)


def refusal(reply: httpx.Response) -> dict:
    """The envelope of a 400."""
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("path, body", [
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "x": %s}'), (COMPLETIONS, '{"prompt": %s}'),
    (TOKENIZE, '{"prompt": %s}'), (DETOKENIZE, '{"tokens": %s}'),
])
def test_deep_nesting_is_400(server, path, body):
    error = refusal(post_raw(server, path, body % NESTED))
    assert error["param"] is None and "nest too deeply" in error["message"]


@pytest.mark.parametrize("path, body, param", [
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}', "max_tokens"),
    (COMPLETIONS, '{"prompt": "hi", "seed": %s}', "seed"), (COMPLETIONS, '{"prompt": [1, %s]}', "prompt"),
    (TOKENIZE, '{"prompt": %s}', "prompt"), (DETOKENIZE, '{"tokens": [1, %s]}', "tokens"),
])
def test_a_5000_digit_integer_is_400(server, path, body, param):
    assert refusal(post_raw(server, path, body % HUGE_INT))["param"] == param


@pytest.mark.parametrize("path, body, param", [
    (CHAT, '{"messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
     "messages[0].content[0].text"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "stop": [%s]}', "stop[0]"),
    (COMPLETIONS, '{"prompt": %s}', "prompt"), (COMPLETIONS, '{"prompt": "hi", "cache_salt": %s}', "cache_salt"),
    (TOKENIZE, '{"prompt": %s}', "prompt"), (DETOKENIZE, '{"tokens": [%s]}', "tokens[0]"),
])
def test_a_lone_surrogate_is_400(server, path, body, param):
    error = refusal(post_raw(server, path, body % SURROGATE))
    assert error["param"] == param and "lone surrogate" in error["message"]


def test_a_surrogate_pair_is_text(server):
    reply = post_raw(server, TOKENIZE, '{"prompt": "\\ud83d\\ude00"}')
    assert reply.status_code == 200 and reply.json()["count"] > 0


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE])
def test_nan_and_infinity_are_not_json(server, path, literal):
    error = refusal(post_raw(server, path, '{"prompt": "hi", "temperature": ' + literal + "}"))
    assert error["param"] is None
    assert error["message"] == f"the request body is not valid JSON: {literal} is not a JSON value"


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, '{"prompt": "hi", "temperature": 1e999}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 1%s}' % ("0" * 400), "max_tokens"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "top_k": -1%s}' % ("0" * 400), "top_k"),
    (DETOKENIZE, '{"tokens": [1e400]}', "tokens"),
])
def test_numbers_past_a_float_are_400(server, path, body, param):
    assert refusal(post_raw(server, path, body))["param"] == param


@pytest.mark.parametrize("raw", [b"\xff\xfe{}", b'{"prompt": "\xed\xa0\x80"}', b"[]", b"{", b""])
def test_bodies_that_are_no_json_object_are_400(server, raw):
    reply = httpx.post(server.base_url + TOKENIZE, content=raw, headers=JSON)
    assert refusal(reply)["param"] is None


def test_health_answers_through_a_burst_of_large_bodies(server, context):
    limit = 64 * context if 64 * context > 1 << 20 else 1 << 20
    large = json.dumps({"prompt": "the quick brown fox " * (limit // 25), "max_tokens": 1}).encode()
    assert len(large) < limit
    over = head("POST", COMPLETIONS, {"Host": "localhost", **JSON, "content-length": str(limit + 1)}) + large

    def parse_large() -> int:
        return httpx.post(server.base_url + COMPLETIONS, content=large, headers=JSON, timeout=120).status_code

    with ThreadPoolExecutor(8) as pool:
        parsed = [pool.submit(parse_large) for _ in range(4)]
        refused = [pool.submit(send_and_read, server.base_url, over) for _ in range(4)]
        health = httpx.get(server.base_url + "/health", timeout=60)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert [f.result() for f in parsed] == [400] * 4  # tokenized: a prompt longer than the context
        assert [f.result().status for f in refused] == [413] * 4
