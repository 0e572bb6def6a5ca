"""Anthropic's Messages API through real `tensorfold serve` processes (both asking for an API key) and the real
anthropic client: create, stream, count_tokens, a second turn resumed from the kept state (equal to a server
that keeps nothing), tool turns, and refusals in Anthropic's error envelope."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from learn_cases import ENV, NO_TIERS, serve_args

from tensorfold.testing.process import serving

pytestmark = pytest.mark.slow

KEY = "anthropic-test-key"
SYSTEM = "You are a helpful assistant who answers in full sentences."
ASK = [{"role": "user", "content": "What is the capital of France, and why?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # this client has no sampling arguments; the API still takes them
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                             "days": {"type": "integer", "minimum": 1,
                                                                      "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def cached_url(tiny_checkpoint, tmp_path_factory) -> Iterator[str]:
    """A server with kept states on, asking for KEY."""
    root = tmp_path_factory.mktemp("anthropic")
    with serving(serve_args(tiny_checkpoint, "--api-key", KEY), root / "server.log", env=ENV) as url:
        yield url


@pytest.fixture(scope="module")
def plain_url(tiny_checkpoint, tmp_path_factory) -> Iterator[str]:
    """A server that keeps no states, asking for KEY."""
    root = tmp_path_factory.mktemp("anthropic-plain")
    with serving(serve_args(tiny_checkpoint, "--api-key", KEY, *NO_TIERS), root / "server.log", env=ENV) as url:
        yield url


def client_on(url: str, key: str = KEY) -> anthropic.Anthropic:
    """The real anthropic client, failing at once rather than retrying."""
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(cached_url) -> anthropic.Anthropic:
    return client_on(cached_url)


@pytest.fixture(scope="module")
def plain(plain_url) -> anthropic.Anthropic:
    return client_on(plain_url)


@pytest.fixture(scope="module")
def oai(cached_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cached_url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def text_of(message) -> str:
    """A reply's text (the tiny model's family has no think markers or call format: text blocks only)."""
    return "".join(block.text for block in message.content if block.type == "text")


def prompt_total(usage) -> int:
    """Every prompt token: prefilled (input_tokens) and resumed (cache reads)."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_create_answers_as_the_chat_route_does(claude, oai, model):
    reply = claude.messages.create(model=model, max_tokens=8, system=SYSTEM, messages=ASK, **GREEDY)
    same = oai.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                       messages=[{"role": "system", "content": SYSTEM}, *ASK])
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == model and reply.stop_sequence is None
    assert text_of(reply) == same.choices[0].message.content and len(reply.content) <= 1
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[same.choices[0].finish_reason]
    assert reply.usage.output_tokens == same.usage.completion_tokens
    assert prompt_total(reply.usage) == same.usage.prompt_tokens
    assert reply.usage.cache_creation_input_tokens == 0


def test_max_tokens_ends_the_reply(claude, model):
    reply = claude.messages.create(model=model, max_tokens=3, messages=ASK, **GREEDY)
    longer = claude.messages.create(model=model, max_tokens=12, messages=ASK, **GREEDY)
    assert reply.usage.output_tokens == 3 and reply.stop_reason == "max_tokens"
    assert text_of(longer).startswith(text_of(reply))


def test_stop_sequences_cut_the_reply_and_name_the_sequence(claude, model):
    whole = text_of(claude.messages.create(model=model, max_tokens=16, messages=ASK, **GREEDY))
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    assert stop.strip(), whole
    reply = claude.messages.create(model=model, max_tokens=16, messages=ASK, **GREEDY,
                                   stop_sequences=["never in this reply", stop])
    assert text_of(reply) == whole[:whole.find(stop)]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)


def test_a_stream_is_anthropics_event_sequence_and_ends_as_create_does(plain, model):
    asked = {"model": model, "max_tokens": 8, "system": SYSTEM, "messages": ASK, **GREEDY}
    created = plain.messages.create(**asked)
    kinds = [event.type for event in plain.messages.create(**asked, stream=True)]
    deltas = len(kinds) - 5
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas >= 1
    with plain.messages.stream(**asked) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == text_of(created)
    assert final.model_dump(exclude={"id"}) == created.model_dump(exclude={"id"})


def test_the_raw_stream_names_each_event(cached_url, model):
    body = {"model": model, "max_tokens": 4, "messages": ASK, "stream": True, "temperature": 0}   # no EOS by chance
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{cached_url}/v1/messages", json=body, headers=headers, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    events = [block.split("\n") for block in raw.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    datas = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert all(len(lines) == 2 and lines[0].startswith("event: ") for lines in events)
    assert [data["type"] for data in datas] == names
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert datas[-2]["usage"]["output_tokens"] == 4 and datas[-2]["delta"]["stop_reason"] == "max_tokens"


def test_count_tokens_is_the_prompt_the_engine_reports(claude, model):
    asked = {"model": model, "system": SYSTEM, "messages": ASK}
    counted = claude.messages.count_tokens(**asked)
    reply = claude.messages.create(**asked, max_tokens=2)
    assert counted.input_tokens == prompt_total(reply.usage) > 0


def test_a_second_turn_resumes_and_equals_a_server_that_keeps_nothing(claude, plain, model, tokenizer):
    system = "You are a patient tutor who explains rivers, seas and weather to children. " * 3
    first = [{"role": "user", "content": "Tell me everything about rivers. " * 4}]
    turns = []
    for client in (claude, plain):
        one = client.messages.create(model=model, max_tokens=8, system=system, messages=first, **GREEDY)
        second = [*first, {"role": "assistant", "content": one.content},
                  {"role": "user", "content": "Now tell it again, but shorter."}]
        two = client.messages.create(model=model, max_tokens=8, system=system, messages=second, **GREEDY)
        turns.append((one, two))
    (one, two), (plain_one, plain_two) = turns
    history_end = len(tokenizer.encode(tokenizer.render([{"role": "system", "content": system}, *first], False)))
    assert two.usage.cache_read_input_tokens == history_end > 0
    assert plain_two.usage.cache_read_input_tokens == 0 and plain_one.usage.cache_read_input_tokens == 0
    assert (text_of(one), text_of(two)) == (text_of(plain_one), text_of(plain_two))
    assert prompt_total(two.usage) == prompt_total(plain_two.usage)


def test_a_tool_result_turn_renders_as_the_chat_route_renders_it_and_answers(claude, cached_url, model):
    messages = [*ASK, {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris",
                                                                                           "days": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                              "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    counted = claude.messages.count_tokens(model=model, system=SYSTEM, messages=messages, tools=[WEATHER])
    chat = [{"role": "system", "content": SYSTEM}, *ASK,
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "toolu_01", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "toolu_01", "name": "get_weather", "content": "Sunny, 21 C"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    tokens = httpx.post(f"{cached_url}/tokenize", json={"messages": chat, "tools": tools},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert tokens.status_code == 200, tokens.text
    assert counted.input_tokens == tokens.json()["count"]
    reply = claude.messages.create(model=model, max_tokens=6, system=SYSTEM, messages=messages, tools=[WEATHER],
                                   **GREEDY)
    assert prompt_total(reply.usage) == counted.input_tokens and reply.stop_reason in ("max_tokens", "end_turn")


def valid_weather(value: dict) -> bool:
    """Whether a tool_use input follows WEATHER's input_schema."""
    return set(value) == {"city", "days"} and value["city"] in ("Paris", "Rome") and \
        isinstance(value["days"], int) and not isinstance(value["days"], bool) and 1 <= value["days"] <= 7


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_forced_tool_choice_returns_a_tool_use_block_valid_against_its_schema(claude, model, choice):
    noop = {"name": "noop", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
    reply = claude.messages.create(model=model, max_tokens=500, messages=ASK, tools=[WEATHER, noop],
                                   tool_choice=choice, **GREEDY)
    assert reply.stop_reason == "tool_use", reply
    assert reply.content and all(block.type == "tool_use" for block in reply.content)
    if choice.get("disable_parallel_tool_use") or choice["type"] == "tool":
        assert len(reply.content) == 1
    for block in reply.content:
        assert block.input == {} if block.name == "noop" else valid_weather(block.input), block
    if choice["type"] == "tool":
        assert reply.content[0].name == "get_weather"
    with claude.messages.stream(model=model, max_tokens=500, messages=ASK, tools=[WEATHER, noop],
                                tool_choice=choice, **GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in reply.content]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == reply.usage.output_tokens


def error_of(caught: pytest.ExceptionInfo) -> dict:
    """The Anthropic envelope's error object, after checking the envelope."""
    body = caught.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


@pytest.mark.parametrize("extra, field", [
    ({"extra_body": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 10**6}, "maximum context length is 1024 tokens"),
    ({"extra_body": {"temperature": -1}}, "temperature"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "missing"}}, "tool_choice"),
])
def test_a_bad_field_is_a_400_invalid_request_error_naming_it(claude, model, extra, field):
    asked = {"model": model, "max_tokens": 4, "messages": ASK, **extra}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(**asked)
    error = error_of(caught)
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert field in error["message"], error


def test_an_unknown_model_is_a_404_not_found_error(claude):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-no-such-model", max_tokens=4, messages=ASK)
    assert error_of(caught)["type"] == "not_found_error" and "claude-no-such-model" in error_of(caught)["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.count_tokens(model="claude-no-such-model", messages=ASK)
    assert error_of(caught)["type"] == "not_found_error"


def test_a_wrong_key_is_a_401(cached_url, model):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client_on(cached_url, "sk-wrong").messages.create(model=model, max_tokens=4, messages=ASK)
    assert caught.value.status_code == 401


def test_a_wrong_key_is_an_authentication_error_in_anthropics_envelope(cached_url, model):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client_on(cached_url, "sk-wrong").messages.create(model=model, max_tokens=4, messages=ASK)
    assert error_of(caught)["type"] == "authentication_error"


def test_the_openai_routes_keep_their_envelope(oai, model):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=model, max_tokens=4, messages=ASK, temperature=-1)
    assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["param"] == "temperature"
