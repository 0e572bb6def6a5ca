"""Agents' requests through the real clients against a real `tensorfold serve` (the template family's random
weights): forced tool calls whose arguments follow the tool's schema (openai, streamed and not; langchain-openai;
LiteLLM), `chat.completions.parse` with a pydantic schema, json_object, guided choice and regex. Each reply is
checked against its schema: the grammar, not the model, makes it valid."""

from __future__ import annotations

import json
import os
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 6},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                             "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo this week?"}]
MAX = 120
ROOMY = 480  # response_format JSON allows up to 20 whitespace characters between tokens, which a random model uses


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_a_named_tool_call_is_valid_streamed_and_not(client, model):
    reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice=named("weather"), max_tokens=MAX, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMS)
    stream = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice=named("weather"), max_tokens=MAX, temperature=0, stream=True)
    pieces, names, finish = [], [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or ():
            assert part.index == 0
            names += [part.function.name] if part.function.name else []
            pieces.append(part.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["weather"] and finish == "tool_calls"
    assert json.loads("".join(pieces)) == arguments  # greedy: the same call


def test_required_picks_among_the_tools_and_parallel_false_keeps_one(client, model, server):
    close = httpx.post(server.base_url + "/tokenize", json={"prompt": "]"}).json()["tokens"]
    for parallel in (True, False):
        # a random model may add calls forever; a bias on "]" (where the grammar allows it) ends the array
        reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                               tool_choice="required", parallel_tool_calls=parallel,
                                               max_tokens=MAX, temperature=0.8, seed=3,
                                               logit_bias={str(close[0]): 5} if len(close) == 1 else None)
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
        for call in calls:
            schema = {"weather": WEATHER_PARAMS, "time": TIME["function"]["parameters"]}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_tool_round_trip_renders_and_answers(client, model):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 3, "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 12 degrees"}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=8,
                                           temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=1).usage.prompt_tokens


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=5)
    rain: bool
    level: int = pydantic.Field(ge=0, le=3)


def test_parse_with_a_pydantic_schema(client, model):
    reply = client.chat.completions.parse(model=model, messages=ASK, response_format=Forecast, max_tokens=ROOMY,
                                          temperature=0)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and reply.choices[0].finish_reason == "stop"
    assert parsed == Forecast.model_validate_json(reply.choices[0].message.content)


def test_json_object_choice_and_regex(client, model):
    shown = client.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                           max_tokens=MAX, temperature=0.7, seed=5)
    if shown.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(shown.choices[0].message.content), dict)
    else:  # a random model may write one long string: what came is a prefix of a JSON object
        assert shown.choices[0].message.content.lstrip().startswith("{")
    picked = client.chat.completions.create(model=model, messages=ASK, max_tokens=MAX, temperature=1.0, seed=9,
                                            extra_body={"guided_choice": ["sunny", "rainy", "foggy"]})
    assert picked.choices[0].message.content in ("sunny", "rainy", "foggy")
    assert picked.choices[0].finish_reason == "stop"
    dated = client.completions.create(model=model, prompt="Today is", max_tokens=MAX, temperature=0,
                                      extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", dated.choices[0].text)


def test_bad_schemas_and_two_grammars_are_400s(client, model):
    with pytest.raises(openai.BadRequestError, match="response_format") as caught:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}})
    assert caught.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, tools=[WEATHER],
                                       tool_choice="required", response_format={"type": "json_object"})
    assert caught.value.body["param"] == "response_format"


def test_langchain_bind_tools_and_structured_output(server, model):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=model, base_url=server.api, api_key="unused", temperature=0, max_tokens=MAX,
                      max_retries=0, timeout=60)
    message = chat.bind_tools([WEATHER], tool_choice="weather").invoke("Weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "weather"
    jsonschema.validate(call["args"], WEATHER_PARAMS)
    roomy = ChatOpenAI(model=model, base_url=server.api, api_key="unused", temperature=0, max_tokens=ROOMY,
                       max_retries=0, timeout=60)
    forecast = roomy.with_structured_output(Forecast, method="json_schema").invoke("Forecast for Oslo?")
    assert isinstance(forecast, Forecast)


def test_litellm_tools(server, model):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    import litellm

    reply = litellm.completion(model=f"openai/{model}", api_base=server.api, api_key="unused", messages=ASK,
                               tools=[WEATHER], tool_choice=named("weather"), max_tokens=MAX, temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)


def test_an_auto_call_in_the_reply_is_parsed_streamed_and_not(client, model):
    """tool_choice auto: the parser reads calls out of whatever the model writes; a regex makes this random model
    write one (the family's hermes format) after a little text, so the path a real model takes is the one run."""
    written = r'Let me check\.\n<tool_call>\n\{"name": "weather", "arguments": \{"city": "Oslo", "days": [1-7], ' \
              r'"unit": "celsius"\}\}\n</tool_call>'
    fields = {"tools": [WEATHER, TIME], "max_tokens": MAX, "temperature": 0, "extra_body": {"guided_regex": written}}
    reply = client.chat.completions.create(model=model, messages=ASK, **fields)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content.strip() == "Let me check."
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "weather" and arguments["city"] == "Oslo" and 1 <= arguments["days"] <= 7
    jsonschema.validate(arguments, WEATHER_PARAMS)
    content, names, pieces, finish = [], [], [], None
    for chunk in client.chat.completions.create(model=model, messages=ASK, stream=True, **fields):
        delta = chunk.choices[0].delta
        content += [delta.content] if delta.content else []
        for part in delta.tool_calls or ():
            names += [part.function.name] if part.function.name else []
            pieces.append(part.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(content).strip() == "Let me check." and names == ["weather"] and finish == "tool_calls"
    assert json.loads("".join(pieces)) == arguments
