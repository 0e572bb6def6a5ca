"""A real `tensorfold serve` on a tiny `example` checkpoint, driven by the real openai client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tensorfold.testing.fuzz_http import idle_memory

HI = [{"role": "user", "content": "Hello! How are you today?"}]


def detokenize(server, ids: list[int]) -> str:
    return httpx.post(server.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def tokenize(server, **body) -> dict:
    return httpx.post(server.base_url + "/tokenize", json=body).json()


def test_models(client, server):
    models = client.models.list().data
    assert len(models) == 1
    card = models[0]
    assert card.id == server.model_dir.name and card.owned_by == "tensorfold"
    assert card.model_extra["max_model_len"] >= 64
    assert client.models.retrieve(card.id).id == card.id


def test_health(server):
    response = httpx.get(server.base_url + "/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_tokenize_and_detokenize(server, context):
    found = tokenize(server, prompt="Hello! How are you today?")
    assert found["count"] == len(found["tokens"]) > 0 and found["max_model_len"] == context
    assert detokenize(server, found["tokens"]) == "Hello! How are you today?"
    chat = tokenize(server, messages=HI)
    bare = tokenize(server, messages=HI, add_generation_prompt=False)
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and chat["count"] > bare["count"]


def test_chat(client, model, server):
    reply = client.chat.completions.create(model=model, messages=HI, max_tokens=8, temperature=0)
    assert reply.object == "chat.completion" and reply.model == model
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens == tokenize(server, messages=HI)["count"]
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    again = client.chat.completions.create(model=model, messages=HI, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == choice.message.content  # greedy is deterministic


def test_chat_stream_with_usage(client, model):
    whole = client.chat.completions.create(model=model, messages=HI, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=model, messages=HI, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_ends_with_done(server, model):
    body = {"model": model, "messages": HI, "max_tokens": 4, "stream": True}
    response = httpx.post(server.api + "/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n") and response.text.count("[DONE]") == 1


def test_completion_token_ids(client, model, server):
    prompt = tokenize(server, prompt="The quick brown fox")["tokens"]
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = reply.choices[0]
    assert reply.object == "text_completion" and choice.finish_reason == "length"
    assert reply.model_extra["prompt_token_ids"] == prompt
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 8 and reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens == len(prompt)
    assert choice.text == detokenize(server, ids)
    nested = client.completions.create(model=model, prompt=[prompt], max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert nested.choices[0].text == choice.text


def test_completion_stream(client, model):
    whole = client.completions.create(model=model, prompt="Paris is", max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=model, prompt="Paris is", max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seed_reproduces(client, model):
    def draw() -> str:
        return client.completions.create(model=model, prompt="one two", max_tokens=10, temperature=1.0,
                                         seed=1234, extra_body={"ignore_eos": True}).choices[0].text
    assert draw() == draw()


def test_stop_string(client, model):
    full = client.completions.create(model=model, prompt="Monday Tuesday", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    middle = len(full) // 2
    stop = next((full[i:i + 2] for i in range(middle, len(full) - 1) if "\ufffd" not in full[i:i + 2]), None)
    assert stop, f"no usable stop string in {full!r}"
    for stream, include in ((False, False), (True, False), (False, True), (True, True)):
        expected = full[:full.find(stop) + (len(stop) if include else 0)]
        kwargs = dict(model=model, prompt="Monday Tuesday", max_tokens=16, temperature=0, stop=[stop],
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(**kwargs).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert (text, reason) == (expected, "stop"), (stream, include, stop, full)


def test_concurrent_requests(client, model):
    def ask(i: int) -> str:
        reply = client.chat.completions.create(model=model, max_tokens=6,
                                               messages=[{"role": "user", "content": f"count {i}"}])
        return reply.choices[0].finish_reason
    with ThreadPoolExecutor(8) as pool:
        reasons = list(pool.map(ask, range(8)))
    assert len(reasons) == 8 and set(reasons) <= {"stop", "length"}


def served_after(server, model) -> None:
    """The engine ends the abandoned request (idle_memory's wait guards a hang), serves a short one in full, and
    then holds no lease or slot and its memory checks out."""
    with httpx.Client() as http:
        now = idle_memory(http, server.base_url)
        assert (now["running"], now["waiting"]) == (0, 0), now
        after = http.post(server.api + "/completions", timeout=30,
                          json={"model": model, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        assert after.status_code == 200
        reply = after.json()
        assert (reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]) == ("length", 4)
        now = idle_memory(http, server.base_url)  # a reply comes after its stream's pages and slot are back
    assert (now["running"], now["waiting"], now["leases"], now["slots_free"]) == (0, 0, 0, now["slots"]), now
    assert now["integrity_when_idle"] == "ok", now


# How soon the engine is free again after a client leaves is a timing: bench/abandon.py measures it. Here, what is
# exact: the server cancelled the abandoned request (its log names it), the engine went idle with every lease and
# slot back, and serves the next request in full. That the engine ends it as `cancelled` well short of max_tokens
# is asserted on the engine's own DoneEvent in test_server_app.py (test_disconnect_*_cancels).
def test_disconnect_mid_stream_frees_the_engine(server, model, context):
    long = {"model": model, "prompt": "Hello", "max_tokens": context - 8, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.api + "/completions", json=long) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: {")
    request_id = json.loads(first[len("data: "):])["id"]
    served_after(server, model)
    assert f"request {request_id} abandoned by its client; cancelling" in server.log.read_text()


def test_disconnect_while_waiting_frees_the_engine(server, model, context):
    long = {"model": model, "prompt": "Hello", "max_tokens": context - 8, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.api + "/completions", json=long, timeout=0.5)
    served_after(server, model)


def test_stop_token_ids_end_the_reply_at_that_token(client, model, server):
    prompt = tokenize(server, prompt="The quick brown fox")["tokens"]
    body = {"return_token_ids": True, "ignore_eos": True}
    ids = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body=body).choices[0].model_extra["token_ids"]
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # the first id not seen before
    choice = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={**body, "stop_token_ids": [ids[at]]}).choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["token_ids"] == ids[: at + 1]
    with pytest.raises(openai.BadRequestError, match="'bad_words' is not supported"):
        client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body={"bad_words": ["x"]})


def test_logit_bias_and_min_tokens_through_the_client(client, model, server):
    prompt = tokenize(server, prompt="The quick brown fox")["tokens"]
    body = {"return_token_ids": True, "ignore_eos": True}
    pushed = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                       logit_bias={"42": 100}, extra_body=body).choices[0]
    assert pushed.model_extra["token_ids"] == [42] * 5
    ids = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body=body).choices[0].model_extra["token_ids"]
    held = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={**body, "stop_token_ids": [ids[0]], "min_tokens": 6}).choices[0]
    assert held.finish_reason == "length" and ids[0] not in held.model_extra["token_ids"]
    with pytest.raises(openai.BadRequestError, match="'min_tokens' 9 is more than max_tokens 6"):
        client.completions.create(model=model, prompt=prompt, max_tokens=6, extra_body={"min_tokens": 9})


def test_continue_final_message_through_the_client(client, model, server):
    said = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "A city I like is"}]
    reply = client.chat.completions.create(model=model, messages=said, max_tokens=4, temperature=0, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True})
    prompt = reply.model_extra["prompt_token_ids"]
    turn = tokenize(server, messages=said, add_generation_prompt=False)["tokens"]
    assert prompt == turn[: len(prompt)] and len(prompt) < len(turn)  # the final turn left open
    assert detokenize(server, prompt).endswith("A city I like is")
