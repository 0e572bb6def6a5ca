"""Anthropic Messages requests translated into OpenAI chat bodies: every field's mapping, and every refusal
naming the Anthropic field at fault (pure functions, no server)."""

from __future__ import annotations

import json

import pytest

from tensorfold.server.anthropic_request import to_chat
from tensorfold.server.errors import ApiError

BASE = {"model": "tiny", "max_tokens": 16}


def chat(**fields) -> dict:
    """The OpenAI body for BASE plus `fields`."""
    return to_chat({**BASE, **fields})


def refused(body: dict, count: bool = False) -> ApiError:
    """The 400 a body gets."""
    with pytest.raises(ApiError) as caught:
        to_chat(body, count)
    assert caught.value.status == 400
    return caught.value


def test_text_system_sampling_and_stops_map_to_openai_fields():
    body = chat(system="Be brief.", messages=[{"role": "user", "content": "Hi"}], temperature=0, top_p=0.9,
                top_k=5, stop_sequences=["\n\n", "END"], stream=True, metadata={"user_id": "u-1"},
                cache_control={"type": "ephemeral"})
    assert body == {"model": "tiny", "max_tokens": 16, "temperature": 0, "top_p": 0.9, "top_k": 5, "stream": True,
                    "stop": ["\n\n", "END"],
                    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}


def test_text_blocks_join_and_system_blocks_become_one_system_message():
    body = chat(system=[{"type": "text", "text": "One."}, {"type": "text", "text": "Two.",
                                                           "cache_control": {"type": "ephemeral"}}],
                messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert body["messages"] == [{"role": "system", "content": "One.\nTwo."}, {"role": "user", "content": "a\nb"}]


def test_consecutive_turns_of_one_role_are_combined():
    body = chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}])
    assert body["messages"] == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"},
                                {"role": "user", "content": "d"}]


def test_tool_use_and_tool_result_become_tool_calls_and_tool_messages():
    body = chat(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "Thanks."}]},
    ])
    assert body["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny", "name": "weather"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timeout", "name": "weather"},
        {"role": "user", "content": "Thanks."},
    ]


def test_a_final_assistant_message_is_a_prefill_the_reply_continues():
    body = chat(messages=[{"role": "user", "content": "Pick"}, {"role": "assistant", "content": "The answer is ("}])
    assert body["add_generation_prompt"] is False and body["continue_final_message"] is True
    assert "add_generation_prompt" not in chat(messages=[{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("choice, mapped", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "weather"}, {"tool_choice": {"type": "function", "function": {"name": "weather"}}}),
    ({"type": "any", "disable_parallel_tool_use": True}, {"tool_choice": "required", "parallel_tool_calls": False}),
    ({"type": "auto", "disable_parallel_tool_use": False}, {"tool_choice": "auto"}),
])
def test_tools_and_tool_choice_map_to_openai_functions(choice, mapped):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = chat(messages=[{"role": "user", "content": "Hi"}], tool_choice=choice,
                tools=[{"name": "weather", "description": "Forecast.", "input_schema": schema,
                        "cache_control": {"type": "ephemeral"}}, {"name": "noop", "input_schema": {"type": "object"},
                                                                  "type": "custom"}])
    assert body["tools"] == [
        {"type": "function", "function": {"name": "weather", "parameters": schema, "description": "Forecast."}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
    assert {k: body[k] for k in ("tool_choice", "parallel_tool_calls") if k in body} == mapped


@pytest.mark.parametrize("thinking, enabled", [({"type": "enabled", "budget_tokens": 8}, True),
                                               ({"type": "adaptive"}, True), ({"type": "disabled"}, False)])
def test_thinking_sets_the_templates_enable_thinking(thinking, enabled):
    body = chat(messages=[{"role": "user", "content": "Hi"}], thinking=thinking)
    assert body["chat_template_kwargs"] == {"enable_thinking": enabled}


def test_count_tokens_bodies_have_no_max_tokens():
    body = to_chat({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "system": "S"}, count=True)
    assert body == {"model": "tiny", "messages": [{"role": "system", "content": "S"},
                                                  {"role": "user", "content": "Hi"}]}
    assert "count_tokens" in refused({**BASE, "messages": [{"role": "user", "content": "Hi"}]}, count=True).message


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body, param", [
    ({**BASE, "messages": HI, "frequency_penalty": 1}, "frequency_penalty"),
    ({**BASE, "messages": HI, "service_tier": "auto"}, "service_tier"),
    ({"model": "tiny", "messages": HI}, "max_tokens"),
    ({"max_tokens": 4, "messages": HI}, "model"),
    ({**BASE}, "messages"),
    ({**BASE, "messages": []}, "messages"),
    ({**BASE, "messages": "Hi"}, "messages"),
    ({**BASE, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({**BASE, "messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ({**BASE, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "messages[0].content[0]"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0]"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}]},
     "messages[0].content[0].extra"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n",
                                                         "input": {}}]}]}, "messages[0].content[0]"),
    ({**BASE, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n",
                                                              "input": "{}"}]}, *HI]}, "messages[0].content[0].input"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                         "content": [{"type": "image", "source": {}}]}]}]},
     "messages[0].content[0].content[0]"),
    ({**BASE, "messages": [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": "x",
                                                                   "signature": ""}]}]}, "messages"),
    ({**BASE, "messages": HI, "system": 5}, "system"),
    ({**BASE, "messages": HI, "stop_sequences": "END"}, "stop_sequences"),
    ({**BASE, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({**BASE, "messages": HI, "tools": [{"name": "x"}]}, "tools[0].input_schema"),
    ({**BASE, "messages": HI, "tools": [{"name": "x", "input_schema": {}, "description": 1}]},
     "tools[0].description"),
    ({**BASE, "messages": HI, "tools": [{"name": "x", "input_schema": {}, "strict": True}]}, "tools[0].strict"),
    ({**BASE, "messages": HI, "tool_choice": "auto"}, "tool_choice"),
    ({**BASE, "messages": HI, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({**BASE, "messages": HI, "tool_choice": {"type": "none", "disable_parallel_tool_use": True}},
     "tool_choice.disable_parallel_tool_use"),
    ({**BASE, "messages": HI, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({**BASE, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 16}}, "thinking.budget_tokens"),
    ({**BASE, "messages": HI, "thinking": {"type": "sometimes"}}, "thinking"),
    ({**BASE, "messages": HI, "metadata": "u-1"}, "metadata"),
])
def test_refusals_name_the_anthropic_field(body, param):
    err = refused(body)
    assert err.param == param and param.split(".")[0].split("[")[0] in err.message
