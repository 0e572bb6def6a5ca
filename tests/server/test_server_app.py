"""The app in-process over the real engine on a tiny checkpoint: shapes, stop strings, engine failures, a full
queue, disconnects. Expected replies come from the model itself (greedy, or a seed), never from a script."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterator

import attrs
import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient

from tensorfold.boot import Loaded, boot, build_memory, memory_plan
from tensorfold.engine.api import DoneEvent, ErrorEvent, Event, Request, Sampling, TokenEvent
from tensorfold.engine.runner import Engine
from tensorfold.server import build_app
from tensorfold.settings import read_settings

HI = [{"role": "user", "content": "Hello!"}]
BOOM = "the engine failed this request: RuntimeError: boom"
LONG_CONTEXT = 4096  # for the disconnect tests: a reply of LONG tokens takes seconds on the CPU
LONG = LONG_CONTEXT - 96


class Recording:
    """The real engine behind a submit that keeps each accepted request and the event that ended it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.requests: list[Request] = []
        self.ended: dict[str, DoneEvent | ErrorEvent] = {}
        self._changed = threading.Condition()

    def submit(self, request: Request) -> None:
        """Note how the engine ends the request (before the server hears of it), then hand it to the engine."""
        forward = request.on_event

        def on_event(event: Event) -> None:
            if isinstance(event, (DoneEvent, ErrorEvent)):
                with self._changed:
                    self.ended[request.id] = event
                    self._changed.notify_all()
            forward(event)

        request.on_event = on_event
        self.engine.submit(request)
        self.requests.append(request)

    def snapshot(self) -> dict:
        """The engine's own numbers for /memory."""
        return self.engine.snapshot()

    @property
    def failure(self) -> str | None:
        """The engine's own state, for /health."""
        return self.engine.failure

    def wait_ended(self, request_id: str, timeout: float = 10.0) -> DoneEvent | ErrorEvent:
        """The event the engine ended `request_id` with, waiting for it if need be."""
        with self._changed:
            assert self._changed.wait_for(lambda: request_id in self.ended, timeout), f"{request_id} never ended"
            return self.ended[request_id]


class FailingModel:
    """The real model, except that its `fail_at`-th forward (1-based) raises RuntimeError("boom")."""

    def __init__(self, model, fail_at: int) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, plan, kv):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("boom")
        return self.model.forward(plan, kv)


def second_engine(loaded: Loaded, model, max_waiting: int) -> Engine:
    """Another real engine over `model`, on stream memory of its own that boot's plan sizes; not started."""
    settings, layout = loaded.settings, loaded.declarations.layout
    plan, refusals = memory_plan(settings, layout, loaded.checkpoint, loaded.device, loaded.dtype)
    assert plan is not None, refusals
    memory = build_memory(plan, layout, settings, loaded.device)
    return Engine(model, memory, settings.prefill_chunk, settings.context, max_waiting)


@contextlib.contextmanager
def running(engine: Engine) -> Iterator[Engine]:
    """The engine's step loop for the length of the block."""
    engine.start()
    try:
        yield engine
    finally:
        engine.close()


def app_over(loaded: Loaded, engine) -> TestClient:
    """The app over the loaded service with another engine behind it."""
    return TestClient(build_app(attrs.evolve(loaded.service, engine=engine)))


@pytest.fixture
def recording(loaded):
    return Recording(loaded.engine)


@pytest.fixture
def http(loaded, recording):
    with app_over(loaded, recording) as client:
        yield client


def sse(response) -> list:
    """The data events of an SSE body, JSON-decoded ([DONE] kept as a string)."""
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def usage_of(event: DoneEvent, completion_tokens: int | None = None) -> dict:
    """The usage object the server owes for what the engine reported (a stop string cuts the completion's count)."""
    completion = event.completion_tokens if completion_tokens is None else completion_tokens
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": completion,
            "total_tokens": event.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}


def stop_inside(text: str) -> str:
    """Two characters from the second half of `text` (none of them undecodable), to use as a stop string."""
    found = next((text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i:i + 2]),
                 None)
    assert found, f"no usable stop string in {text!r}"
    return found


def greedy_ids(http: TestClient, prompt, n: int) -> list[int]:
    """The first `n` tokens the model picks greedily after `prompt`."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]


def test_chat(http, recording, tokenizer):
    body = {"messages": HI, "temperature": 0, "max_tokens": 8}
    got = http.post("/v1/chat/completions", json=body).json()
    assert got["object"] == "chat.completion" and got["model"] == "tiny" and got["id"].startswith("chatcmpl-")
    prompt = tokenizer.encode(tokenizer.render(HI, add_generation_prompt=True))
    same = http.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 8}).json()
    choice = got["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": same["choices"][0]["text"]}
    assert choice["finish_reason"] == same["choices"][0]["finish_reason"] in ("stop", "length")
    ended = recording.wait_ended(got["id"])
    assert got["usage"] == usage_of(ended) and ended.prompt_tokens == len(prompt)
    assert 1 <= got["usage"]["completion_tokens"] <= 8
    assert "prompt_token_ids" not in got and "token_ids" not in choice


def test_stop_string_cancels_and_reports_stop(http, recording):
    body = {"messages": HI, "temperature": 0, "ignore_eos": True, "max_tokens": 16}
    full = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    stop = stop_inside(full)
    got = http.post("/v1/chat/completions", json={**body, "stop": [stop]}).json()
    assert got["choices"][0]["message"]["content"] == full[:full.find(stop)]
    assert got["choices"][0]["finish_reason"] == "stop"
    assert recording.requests[1].cancelled.is_set()


def test_length(http, tokenizer):
    got = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True,
                                             "return_token_ids": True}).json()
    choice = got["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 2
    assert choice["text"] == tokenizer.decode(choice["token_ids"])
    assert got["prompt_token_ids"] == tokenizer.encode("Hello")
    assert got["object"] == "text_completion" and got["usage"]["completion_tokens"] == 2


def test_chat_stream_with_usage(http, recording, tokenizer):
    body = {"messages": HI, "temperature": 0, "ignore_eos": True, "max_tokens": 16}
    whole = http.post("/v1/chat/completions", json={**body, "return_token_ids": True}).json()["choices"][0]
    full, ids = whole["message"]["content"], whole["token_ids"]
    stop = stop_inside(full)
    through_stop = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    response = http.post("/v1/chat/completions", json={**body, "stream": True, "stop": stop,
                                                       "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == full[:full.find(stop)]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == usage_of(recording.wait_ended(chunks[0]["id"]), completion_tokens=through_stop)


def seeded_reply_ending_with_eos(http: TestClient, prompt: list[int]) -> tuple[int, dict]:
    """A seed whose sampled reply to `prompt` ends with the end token, and that reply (random weights: search)."""
    for seed in range(64):
        got = http.post("/v1/completions", json={"prompt": prompt, "temperature": 1, "seed": seed,
                                                 "return_token_ids": True}).json()
        if got["choices"][0]["finish_reason"] == "stop":
            return seed, got
    pytest.fail(f"no seed in 0..63 makes the tiny model end its reply to {prompt} with the end token")


def test_completion_stream_token_ids(http, tokenizer):
    seed, whole = seeded_reply_ending_with_eos(http, [42, 348])
    ids = whole["choices"][0]["token_ids"]
    assert ids[-1] in tokenizer.eos_ids and whole["choices"][0]["text"] == tokenizer.decode(ids)
    response = http.post("/v1/completions", json={"prompt": [42, 348], "stream": True, "temperature": 1,
                                                  "seed": seed, "return_token_ids": True})
    chunks = sse(response)[:-1]
    assert chunks[0]["prompt_token_ids"] == [42, 348]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids  # the end token's id included
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("usage" in c for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_error_before_output_is_500(loaded, stream):
    failing = FailingModel(loaded.engine.model, fail_at=1)  # the prefill
    with running(second_engine(loaded, failing, 64)) as engine, app_over(loaded, engine) as client:
        response = client.post("/v1/chat/completions", json={"messages": HI, "stream": stream})
        assert response.status_code == 500
        assert response.json()["error"] == {"message": BOOM, "type": "server_error", "param": None, "code": None}
        again = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "stream": stream})
        assert again.status_code == 200, "the engine stopped serving after a failed request"


def test_engine_error_mid_stream_is_an_error_event(http, loaded, tokenizer):
    first_three = greedy_ids(http, "Hello", 3)
    failing = FailingModel(loaded.engine.model, fail_at=4)  # the prefill and two decodes work: three tokens
    body = {"prompt": "Hello", "stream": True, "temperature": 0, "ignore_eos": True, "max_tokens": 8,
            "return_token_ids": True}
    with running(second_engine(loaded, failing, 64)) as engine, app_over(loaded, engine) as client:
        events = sse(client.post("/v1/completions", json=body))
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": BOOM, "type": "server_error", "param": None, "code": None}}
    assert [t for e in events[:-2] for t in e["choices"][0]["token_ids"]] == first_three
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == tokenizer.decode(first_three)


def test_queue_full_is_503_with_retry_after(loaded):
    engine = second_engine(loaded, loaded.engine.model, max_waiting=1)  # not started: nothing leaves its queue
    ended: queue.Queue[Event] = queue.Queue()
    engine.submit(Request("first", [42, 348], Sampling(max_tokens=1, temperature=0),
                          lambda event: ended.put(event) if not isinstance(event, TokenEvent) else None))
    with app_over(loaded, engine) as client:
        response = client.post("/v1/completions", json={"prompt": "Hello"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert "retry" in response.json()["error"]["message"]
    with running(engine):  # the request that filled the queue is still there, and is served
        done = ended.get(timeout=10)
    assert isinstance(done, DoneEvent) and (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
        "length", 2, 1)


def test_not_found_and_wrong_method_in_envelope(http):
    response = http.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
    assert "POST" in response.headers["allow"]


def test_bad_json_is_400(http):
    response = http.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_small_endpoints(http, tokenizer):
    assert http.get("/health").json() == {"status": "ok"}
    card = http.get("/v1/models").json()["data"][0]
    assert (card["id"], card["owned_by"], card["max_model_len"]) == ("tiny", "tensorfold", 64)
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert http.get("/v1/models/other").status_code == 404
    tokens = http.post("/tokenize", json={"prompt": "Hello!"}).json()
    assert tokens == {"tokens": tokenizer.encode("Hello!"), "count": 4, "max_model_len": 64}
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello!"}


def test_memory_reports_the_plan_and_a_clean_pool(http, loaded):
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3}).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the engine has ended every stream of this and earlier tests
        memory = http.get("/memory").json()
        if memory["now"]["running"] == memory["now"]["waiting"] == 0:
            break
        time.sleep(0.01)
    plan, now = memory["plan"], memory["now"]
    assert plan == loaded.service.plan and plan["context"] == 64 and plan["pages_on"]
    assert now["running"] == now["waiting"] == 0 and now["integrity_when_idle"] == "ok"
    assert now["slots_free"] == now["slots"] == plan["parallel"]
    assert now["free"] == now["pages"] == plan["pages"] and now["leases"] == 0


@pytest.fixture
def live(example_family, tiny_checkpoint):
    """The app under a real uvicorn in this process, over the real engine with a long context (slow replies)."""
    settings = read_settings({}, [("TF_EXAMPLE_REQUEST_STARTS", True)], family="example",
                             model=tiny_checkpoint, context=LONG_CONTEXT)
    booted = boot(settings, example_family)
    booted.engine.start()
    recording = Recording(booted.engine)
    config = uvicorn.Config(build_app(attrs.evolve(booted.service, engine=recording)), host="127.0.0.1", port=0,
                            log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield recording, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)
    booted.engine.close()


def assert_cancelled_and_engine_free(recording: Recording, url: str) -> None:
    """The engine ended the abandoned request as cancelled, well short of its length, and serves the next one."""
    abandoned = recording.requests[0]
    ended = recording.wait_ended(abandoned.id)
    assert abandoned.cancelled.is_set()
    assert isinstance(ended, DoneEvent) and ended.finish_reason == "cancelled" and ended.completion_tokens < LONG
    after = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
                       timeout=10)
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"


def test_disconnect_mid_stream_cancels(live):
    recording, url = live
    body = {"prompt": "Hello", "stream": True, "max_tokens": LONG, "ignore_eos": True}
    with httpx.Client() as client, client.stream("POST", url + "/v1/completions", json=body) as response:
        assert next(response.iter_lines()).startswith("data: ")
    assert_cancelled_and_engine_free(recording, url)


def test_disconnect_while_waiting_cancels(live):
    recording, url = live
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": LONG, "ignore_eos": True},
                   timeout=0.3)
    assert_cancelled_and_engine_free(recording, url)
