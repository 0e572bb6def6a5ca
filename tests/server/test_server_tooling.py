"""A chat's tools, tool_choice, messages for the template and a request's own chat template, as parse_chat reads
them: what the template is given, and every refusal a 400 naming its field."""

from __future__ import annotations

import json

import attrs
import pytest

from tensorfold.engine.api import Sampling
from tensorfold.server.errors import ApiError
from tensorfold.server.messages import for_template
from tensorfold.server.params import parse_chat, parse_tokenize
from tensorfold.server.tooling import NAMED, REQUIRED, ToolChoice, forced_calls, forced_schema, read_tool_choice

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}
HI = [{"role": "user", "content": "Hello!"}]


@pytest.fixture
def service(loaded, tokenizer):
    return attrs.evolve(loaded.service, tokenizer=tokenizer,
                        defaults=Sampling(max_tokens=4, stop_token_ids=tokenizer.eos_ids))


class Recording:
    """A tokenizer that records what the template is given, then renders with the real one."""

    def __init__(self, real) -> None:
        self.real = real
        self.seen: list[tuple[list, dict]] = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def render(self, messages, add_generation_prompt=True, **kwargs):
        self.seen.append((list(messages), dict(kwargs)))
        return self.real.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def refused(body, service, parse=parse_chat) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, service)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(("tools", "param"), [
    ("x", "tools"), ([{"type": "retrieval"}], "tools[0]"), ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(service, tools, param):
    assert refused({"messages": HI, "tools": tools}, service).param == param


@pytest.mark.parametrize(("choice", "tools"), [
    ("sometimes", [WEATHER]), ("required", []), ({"type": "function", "function": {"name": "nope"}}, [WEATHER]),
    ({"type": "function"}, [WEATHER]),
])
def test_bad_tool_choice_names_the_field(service, choice, tools):
    body = {"messages": HI, "tool_choice": choice, **({"tools": tools} if tools else {})}
    assert refused(body, service).param == "tool_choice"


def test_tools_reach_the_template_and_the_request(service):
    recording = Recording(service.tokenizer)
    params = parse_chat({"messages": HI, "tools": [WEATHER, TIME]}, attrs.evolve(service, tokenizer=recording))
    _, kwargs = recording.seen[-1]
    assert [t["function"]["name"] for t in kwargs["tools"]] == ["weather", "time"]
    assert kwargs["tools"][1]["function"]["parameters"] == {"type": "object"}  # filled in for templates
    assert params.tool_choice == ToolChoice("auto") and len(params.tools) == 2 and params.grammar is None


def test_tool_choice_none_and_default(service):
    assert parse_chat({"messages": HI}, service).tool_choice.mode == "none"
    assert read_tool_choice({"tool_choice": "none"}, [WEATHER]).mode == "none"
    named = read_tool_choice({"tool_choice": {"type": "function", "function": {"name": "weather"}},
                              "parallel_tool_calls": False}, [WEATHER])
    assert named == ToolChoice(NAMED, "weather", parallel=False) and named.forced


def test_forced_schemas_and_calls_read_back():
    named = ToolChoice(NAMED, "weather")
    compact = {"x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}
    assert forced_schema([WEATHER, TIME], named) == {**WEATHER["function"]["parameters"], **compact}
    (call,) = forced_calls('{"city": "Paris"}', named)
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and len(call.id) == 29
    required = ToolChoice(REQUIRED, parallel=False)
    schema = forced_schema([WEATHER, TIME], required)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1 and schema["x-guidance"] == compact["x-guidance"]
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["weather"], ["time"]]
    calls = forced_calls('[{"name": "time", "parameters": {}}, {"name": "weather", "parameters": {"city": "Oslo"}}]',
                         ToolChoice(REQUIRED))
    assert [c.name for c in calls] == ["time", "weather"] and json.loads(calls[1].arguments) == {"city": "Oslo"}
    assert forced_calls('{"city": "Pa', named) == ()  # cut by max_tokens: no call


def test_messages_for_the_template():
    calls = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    fixed = for_template(messages, "{{ messages }}")
    assert fixed[0]["role"] == "system" and fixed[2]["content"] == ""
    assert fixed[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # the request is not changed
    assert for_template(messages, "{% if m.role == 'developer' %}{% endif %}")[0]["role"] == "developer"


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "robot", "content": "x"}, "messages[1].role"),
    ({"role": "assistant", "content": None, "tool_calls": "x"}, "messages[1].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[1].tool_calls"),
])
def test_bad_messages_name_the_field(service, message, param):
    assert refused({"messages": [*HI, message]}, service).param == param


def test_a_requests_own_chat_template(service):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    own = parse_chat({"messages": HI, "chat_template": template}, service)
    assert list(own.prompt) == service.tokenizer.encode("[user] Hello!\n")
    assert list(own.prompt) != list(parse_chat({"messages": HI}, service).prompt)
    assert parse_tokenize({"messages": HI, "chat_template": template}, service).tokens == own.prompt
    assert refused({"messages": HI, "chat_template": "{% for %}"}, service).param == "chat_template"
    assert refused({"messages": HI, "chat_template_kwargs": {"tools": []}}, service).param == "chat_template_kwargs"


def test_tools_are_for_chat_only(service):
    from tensorfold.server.params import parse_completion

    assert refused({"prompt": "Hi", "tools": [WEATHER]}, service, parse_completion).param == "tools"
