"""Every refusal over real HTTP: OpenAI's envelope, the right status, never a 500 or a hang for bad input."""

from __future__ import annotations

import httpx
import openai
import pytest

HI = [{"role": "user", "content": "Hello!"}]


def refused(call, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call(**kwargs)
    error = caught.value
    assert error.status_code == 400 and error.type == "invalid_request_error"
    assert set(error.body) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("field, value", [
    ("n", 17), ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0), ("top_k", -5),
    ("min_p", 2), ("seed", "x"), ("stop", 3), ("logprobs", "yes"),
])
def test_bad_fields(client, model, field, value):
    error = refused(client.chat.completions.create, model=model, messages=HI, extra_body={field: value})
    assert error.param == field


def test_empty_messages(client, model):
    assert refused(client.chat.completions.create, model=model, messages=[]).param == "messages"


def test_image_refused(client, model):
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    error = refused(client.chat.completions.create, model=model, messages=[{"role": "user", "content": content}])
    assert error.body["message"] == "images are not supported by this server"


def test_stream_options_without_stream(client, model):
    error = refused(client.chat.completions.create, model=model, messages=HI,
                    stream_options={"include_usage": True})
    assert error.param == "stream_options"


def test_prompt_over_context(client, model, context):
    error = refused(client.completions.create, model=model, prompt=[5] * (context + 3), max_tokens=4)
    assert error.code == "context_length_exceeded" and error.param == "prompt"
    assert error.body["message"].startswith(f"This server's maximum context length is {context} tokens. However, you "
                                    f"requested {context + 7} tokens ({context + 3} in the prompt, 4 in the "
                                    f"completion)")


def test_messages_over_context(client, model, context):
    long = [{"role": "user", "content": "one two three " * context}]
    error = refused(client.chat.completions.create, model=model, messages=long)
    assert error.code == "context_length_exceeded" and error.param == "messages"


def test_prompt_plus_max_tokens_over_context(client, model, context):
    error = refused(client.completions.create, model=model, prompt=[5, 6, 7], max_tokens=context)
    assert error.code == "context_length_exceeded"
    assert f"(3 in the prompt, {context} in the completion)" in error.body["message"]


def test_batch_prompt_refused(client, model):
    assert refused(client.completions.create, model=model, prompt=["a", "b"]).param == "prompt"
    assert refused(client.completions.create, model=model, prompt=[[1], [2]]).param == "prompt"


def test_token_outside_vocabulary(client, model):
    assert refused(client.completions.create, model=model, prompt=[10**6]).param == "prompt"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b"{not json"), ("/v1/completions", b"[1, 2]"), ("/tokenize", b""),
    ("/detokenize", b"\xff"),
])
def test_malformed_json(server, path, body):
    response = httpx.post(server.base_url + path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_path_is_404(server, client):
    response = httpx.post(server.api + "/embeddings", json={"input": "x"})
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="x", input="hi")


def test_wrong_method_is_405(server):
    response = httpx.get(server.api + "/chat/completions")
    assert response.status_code == 405 and "error" in response.json()
    assert httpx.put(server.base_url + "/health").status_code == 405


def test_server_still_serves_after_errors(client, model):
    reply = client.chat.completions.create(model=model, messages=HI, max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")
