"""A chat request's tools and tool_choice, read and checked; and for `required` or a named function, the JSON schema
that structured generation forces (vLLM's way: the forced reply is JSON, whatever the family's own call format)
and the calls read back out of that JSON."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from tensorfold.chat.api import ToolCall
from tensorfold.server.errors import bad_request
from tensorfold.server.fields import json_type, read_bool

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# llguidance's per-schema options: a forced call is compact JSON (no whitespace between tokens), so a model cannot
# spend its tokens on indentation before the call is whole
COMPACT = {"x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}


@attrs.frozen
class ToolChoice:
    """What the request lets or makes the model do with its tools."""

    mode: str = AUTO             # none, auto, required or named
    name: str | None = None      # the function a named choice forces
    parallel: bool = True        # parallel_tool_calls: false keeps one call at most

    @property
    def forced(self) -> bool:
        """The reply must be a call: structured generation writes it."""
        return self.mode in (REQUIRED, NAMED)


def read_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`tools`: OpenAI's function tools, each checked ({"type": "function", "function": {"name", "parameters"}})."""
    value = body.get("tools")
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(f"'tools' must be an array of tools, not {json_type(value)}", "tools")
    names = set()
    tools = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            got = tool.get("type") if isinstance(tool, dict) else json_type(tool)
            raise bad_request(f"'{at}' must be a function tool {{\"type\": \"function\", \"function\": {{...}}}}; "
                              f"got {got!r}", at)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"'{at}.function' must be an object with a 'name'", f"{at}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{at}.function.name' must be a non-empty string", f"{at}.function.name")
        if name in names:
            raise bad_request(f"'{at}.function.name': two tools are named {name!r}", f"{at}.function.name")
        names.add(name)
        parameters = function.get("parameters", ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise bad_request(f"'{at}.function.parameters' must be a JSON schema object, not "
                              f"{json_type(parameters)}", f"{at}.function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"'{at}.function.description' must be a string", f"{at}.function.description")
        tools.append({"type": "function", "function": {**function, "parameters": parameters}})
    return tools


def read_tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]]) -> ToolChoice:
    """`tool_choice` and `parallel_tool_calls`: none, auto (the default with tools), required, or a named function."""
    parallel = read_bool(body, "parallel_tool_calls", default=True)
    value = body.get("tool_choice")
    if value is None:
        return ToolChoice(AUTO if tools else NONE, parallel=parallel)
    if isinstance(value, str):
        if value not in (NONE, AUTO, REQUIRED):
            raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or a named function; got {value!r}",
                              "tool_choice")
        if value != NONE and not tools:
            raise bad_request(f"'tool_choice' {value!r} needs 'tools'", "tool_choice")
        return ToolChoice(value, parallel=parallel)
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    if name not in {tool["function"]["name"] for tool in tools}:
        raise bad_request(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    return ToolChoice(NAMED, name, parallel)


def forced_schema(tools: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any] | None:
    """The JSON schema a forced reply follows, compact: a named function's parameters, or for `required` an array of
    {"name", "parameters"} objects, one of the tools each (one item at most without parallel calls)."""
    if choice.mode == NAMED:
        found = next(t["function"].get("parameters", ANY_OBJECT) for t in tools if t["function"]["name"] == choice.name)
        return {**found, **COMPACT}
    if choice.mode != REQUIRED:
        return None
    one = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                        "parameters": t["function"].get("parameters", ANY_OBJECT)},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": one, **COMPACT}
    if not choice.parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, choice: ToolChoice) -> tuple[ToolCall, ...]:
    """The calls in a forced reply's JSON text (none when it is not the JSON asked for: cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return ()
    if choice.mode == NAMED and isinstance(value, dict):
        return (new_call(choice.name or "", value),)
    if choice.mode == REQUIRED and isinstance(value, list):
        return tuple(new_call(item["name"], item.get("parameters", {})) for item in value
                     if isinstance(item, dict) and isinstance(item.get("name"), str))
    return ()


def new_call(name: str, arguments: Any) -> ToolCall:
    """A call with a fresh id, its arguments as JSON text."""
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))
