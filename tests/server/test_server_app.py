"""The app in-process over a scripted engine: shapes, stop strings, engine failures, full queue, disconnects."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient

from server_fakes import FakeEngine, make_service
from tensorfold.server import build_app

HI = [{"role": "user", "content": "Hello!"}]


def reply(tokenizer, text: str, eos: bool = True):
    """A script that answers `text` (then the end token)."""
    ids = tokenizer.encode(text) + (list(tokenizer.eos_ids) if eos else [])
    return lambda request: ids


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(script=reply(tokenizer, "Paris is. The quick brown fox"))


@pytest.fixture
def client(tokenizer, engine):
    with TestClient(build_app(make_service(tokenizer, engine, context=64))) as c:
        yield c


def sse(response) -> list:
    """The data events of an SSE body, JSON-decoded ([DONE] kept as a string)."""
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_chat(client):
    got = client.post("/v1/chat/completions", json={"messages": HI}).json()
    assert got["object"] == "chat.completion" and got["model"] == "tiny" and got["id"].startswith("chatcmpl-")
    choice = got["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Paris is. The quick brown fox"}
    assert choice["finish_reason"] == "stop"
    usage = got["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens_details"] == {"cached_tokens": 3}
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "prompt_token_ids" not in got and "token_ids" not in choice


def test_stop_string_cancels_and_reports_stop(client, engine):
    got = client.post("/v1/chat/completions", json={"messages": HI, "stop": [" The"]}).json()
    assert got["choices"][0]["message"]["content"] == "Paris is."
    assert got["choices"][0]["finish_reason"] == "stop"
    assert engine.requests[0].cancelled.is_set()


def test_length(client, tokenizer):
    got = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2,
                                               "return_token_ids": True}).json()
    choice = got["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 2
    assert choice["text"] == tokenizer.decode(choice["token_ids"])
    assert got["prompt_token_ids"] == tokenizer.encode("Hello")
    assert got["object"] == "text_completion" and got["usage"]["completion_tokens"] == 2


def test_chat_stream_with_usage(client):
    response = client.post("/v1/chat/completions", json={"messages": HI, "stream": True, "stop": "fox",
                                                          "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "Paris is. The quick brown "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


def test_completion_stream_token_ids(client, tokenizer):
    response = client.post("/v1/completions", json={"prompt": [42, 348], "stream": True,
                                                     "return_token_ids": True})
    chunks = sse(response)[:-1]
    assert chunks[0]["prompt_token_ids"] == [42, 348]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == tokenizer.encode("Paris is. The quick brown fox") + list(tokenizer.eos_ids)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Paris is. The quick brown fox"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("usage" in c for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_error_before_output_is_500(tokenizer, stream):
    engine = FakeEngine(script=reply(tokenizer, "Paris"), fail_with="the engine failed this request: boom")
    with TestClient(build_app(make_service(tokenizer, engine))) as client:
        response = client.post("/v1/chat/completions", json={"messages": HI, "stream": stream})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "boom" in response.json()["error"]["message"]


def test_engine_error_mid_stream_is_an_error_event(tokenizer):
    engine = FakeEngine(script=reply(tokenizer, "Paris is. The quick"), fail_with="boom", fail_after=3)
    with TestClient(build_app(make_service(tokenizer, engine))) as client:
        events = sse(client.post("/v1/completions", json={"prompt": "Hello", "stream": True}))
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    first_three = tokenizer.decode(tokenizer.encode("Paris is. The quick")[:3])
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == first_three


def test_queue_full_is_503_with_retry_after(tokenizer):
    with TestClient(build_app(make_service(tokenizer, FakeEngine(full=True)))) as client:
        response = client.post("/v1/completions", json={"prompt": "Hello"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "retry" in response.json()["error"]["message"]


def test_not_found_and_wrong_method_in_envelope(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
    assert "POST" in response.headers["allow"]


def test_bad_json_is_400(client):
    response = client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_small_endpoints(client, tokenizer):
    assert client.get("/health").json() == {"status": "ok"}
    card = client.get("/v1/models").json()["data"][0]
    assert (card["id"], card["owned_by"], card["max_model_len"]) == ("tiny", "tensorfold", 64)
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.get("/v1/models/other").status_code == 404
    tokens = client.post("/tokenize", json={"prompt": "Hello!"}).json()
    assert tokens == {"tokens": tokenizer.encode("Hello!"), "count": 4, "max_model_len": 64}
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello!"}


@pytest.fixture
def live(tokenizer):
    """The app under a real uvicorn in this process, over a slow scripted engine."""
    engine = FakeEngine(script=lambda request: [42] * 1000, delay_s=0.02)
    config = uvicorn.Config(build_app(make_service(tokenizer, engine, context=2048,
                                                   defaults=None)), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield engine, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def test_disconnect_mid_stream_cancels(live):
    engine, url = live
    body = {"prompt": "Hello", "stream": True, "max_tokens": 1000}
    with httpx.Client() as http, http.stream("POST", url + "/v1/completions", json=body) as response:
        assert next(response.iter_lines()).startswith("data: ")
    assert engine.wait_finished(1) == ["cancelled"]
    assert engine.requests[0].cancelled.is_set()


def test_disconnect_while_waiting_cancels(live):
    engine, url = live
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1000}, timeout=0.3)
    assert engine.wait_finished(1) == ["cancelled"]
