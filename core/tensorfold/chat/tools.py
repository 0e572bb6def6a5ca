"""The built-in tool-call parsers, each the format a model family was trained to write (docs/hooks.md):

    hermes       <tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>
                 Qwen2.5, Qwen3 (dense), the template family
    qwen3_coder  <tool_call>\n<function=N>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>
                 Qwen3.5, Qwen3-Coder, Nemotron-3-Nano
    glm47        <tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>
                 GLM-4.7 and GLM-5; GLM-4.5/4.6 write the same with a newline before each tag
    nemotron     <TOOLCALL>[{"name": N, "arguments": {...}}, ...]</TOOLCALL>
                 Nemotron-H and Nemotron-Nano-v2; and qwen3_coder's blocks, which Nemotron-3-Nano writes

Formats that write a value as bare text (qwen3_coder, glm47) type it by the request's tool schema: a string
unless the parameter is declared number, integer, boolean, object, array or null, and then JSON (Python's
True/False/None as the templates render them are read too), falling back to the string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tensorfold.chat.api import ToolParser
from tensorfold.chat.blocks import BlockParser, Decoded, Schemas, Syntax

TYPED = frozenset({"number", "integer", "boolean", "object", "array", "null"})


def arguments_json(arguments: Mapping[str, Any]) -> str:
    """A call's arguments as the JSON text OpenAI's clients get."""
    return json.dumps(arguments, ensure_ascii=False)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    """json.loads without NaN and Infinity, which would not survive as JSON text."""
    return json.loads(text, parse_constant=_no_constants)


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (its `type`, a list of them, or its anyOf/oneOf members')."""
    if not isinstance(schema, Mapping):
        return set()
    declared = schema.get("type")
    found = {declared} if isinstance(declared, str) else {t for t in declared or () if isinstance(t, str)}
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            found |= schema_types(option)
    return found


def typed_value(text: str, schema: Any) -> Any:
    """A bare-text value as its schema types it: a string unless declared otherwise, else JSON or the string."""
    types = schema_types(schema)
    word = text.strip()
    if "null" in types and word in ("null", "None"):
        return None
    if not types & TYPED or "string" in types:
        return text
    if "boolean" in types and word in ("True", "False"):
        return word == "True"
    try:
        return strict_json(word)
    except ValueError:
        return text


# ---------------------------------------------------------------- JSON bodies: hermes, nemotron

def json_call(found: Any) -> tuple[str, str] | None:
    """One {"name": ..., "arguments": {...}} object as a call; arguments may be JSON text; None when it is not one."""
    if not isinstance(found, dict) or not isinstance(found.get("name"), str) or not found["name"].strip():
        return None
    arguments = found.get("arguments", found.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = strict_json(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return found["name"].strip(), arguments_json(arguments)


def decode_hermes(body: str, schemas: Schemas) -> Decoded | None:
    """One JSON object per block."""
    try:
        call = json_call(strict_json(body))
    except ValueError:
        return None
    return None if call is None else [call]


def decode_toolcall_list(body: str, schemas: Schemas) -> Decoded | None:
    """A JSON list of call objects per block (one bare object is read too); every one must be a call."""
    try:
        found = strict_json(body)
    except ValueError:
        return None
    calls = [json_call(item) for item in (found if isinstance(found, list) else [found])]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def in_json_string(body: str) -> bool:
    """Whether JSON text ends inside a string literal (so an end marker met there is part of a value)."""
    inside = escaped = False
    for char in body:
        if escaped:
            escaped = False
        elif char == "\\" and inside:
            escaped = True
        elif char == '"':
            inside = not inside
    return inside


# ---------------------------------------------------------------- XML bodies: qwen3_coder

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def valid_name(name: str) -> bool:
    """A function or parameter name as written between markers: non-empty, one word, no angle brackets."""
    return bool(name) and not any(c.isspace() or c in "<>" for c in name)


def decode_qwen3_coder(body: str, schemas: Schemas) -> Decoded | None:
    """`<function=NAME>` and its `<parameter=KEY>\\nVALUE\\n</parameter>`s, one newline trimmed around each value."""
    text = body.strip()
    if not text.startswith(FUNCTION) or not text.endswith(FUNCTION_END):
        return None
    close = text.find(">")
    name = text[len(FUNCTION):close]
    if close == -1 or not valid_name(name):
        return None
    params = schemas.get(name, {})
    inner, at, arguments = text[close + 1:len(text) - len(FUNCTION_END)], 0, {}
    while (at := len(inner) - len(inner[at:].lstrip())) < len(inner):
        if not inner.startswith(PARAMETER, at) or (key_end := inner.find(">", at)) == -1:
            return None
        key = inner[at + len(PARAMETER):key_end]
        value_end = parameter_end(inner, key_end + 1)
        if not valid_name(key) or value_end == -1:
            return None
        value = inner[key_end + 1:value_end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = typed_value(value, params.get(key))
        at = value_end + len(PARAMETER_END)
    return [(name, arguments_json(arguments))]


def parameter_end(inner: str, start: int) -> int:
    """Where a value ends: the first `</parameter>` followed by another parameter or the function's end."""
    at = inner.find(PARAMETER_END, start)
    while at != -1:
        rest = inner[at + len(PARAMETER_END):].lstrip()
        if not rest or rest.startswith(PARAMETER):
            return at
        at = inner.find(PARAMETER_END, at + 1)
    return -1


def in_xml_function(body: str) -> bool:
    """Whether a `<function=...>` body is still open (an end marker met there is inside a parameter value)."""
    text = body.strip()
    return text.startswith(FUNCTION) and not text.endswith(FUNCTION_END)


# ---------------------------------------------------------------- XML bodies: glm47

ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


def decode_glm47(body: str, schemas: Schemas) -> Decoded | None:
    """`NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs, whitespace between tags ignored."""
    first = body.find(ARG_KEY)
    name = (body if first == -1 else body[:first]).strip()
    if not valid_name(name):
        return None
    params = schemas.get(name, {})
    arguments: dict[str, Any] = {}
    at = len(body) if first == -1 else first
    while (at := len(body) - len(body[at:].lstrip())) < len(body):
        key, at = tagged(body, at, ARG_KEY, ARG_KEY_END)
        if key is None or not key.strip():
            return None
        at = len(body) - len(body[at:].lstrip())
        value, at = tagged(body, at, ARG_VALUE, ARG_VALUE_END)
        if value is None:
            return None
        arguments[key.strip()] = typed_value(value, params.get(key.strip()))
    return [(name, arguments_json(arguments))]


def tagged(body: str, at: int, opener: str, closer: str) -> tuple[str | None, int]:
    """The text of `opener`TEXT`closer` starting at `at`, and where it ends; None when it is not there."""
    if not body.startswith(opener, at) or (end := body.find(closer, at + len(opener))) == -1:
        return None, at
    return body[at + len(opener):end], end + len(closer)


def in_glm_value(body: str) -> bool:
    """Whether an `<arg_value>` is still open (an end marker met there is part of the value)."""
    return body.count(ARG_VALUE) > body.count(ARG_VALUE_END)


# ---------------------------------------------------------------- the parsers

HERMES = Syntax("<tool_call>", "</tool_call>", decode_hermes, in_json_string)
QWEN3_CODER = Syntax("<tool_call>", "</tool_call>", decode_qwen3_coder, in_xml_function)
GLM47 = Syntax("<tool_call>", "</tool_call>", decode_glm47, in_glm_value)
TOOLCALL = Syntax("<TOOLCALL>", "</TOOLCALL>", decode_toolcall_list, in_json_string)

PARSERS: dict[str, ToolParser] = {
    "hermes": BlockParser("hermes", [HERMES]),
    "qwen3_coder": BlockParser("qwen3_coder", [QWEN3_CODER]),
    "glm47": BlockParser("glm47", [GLM47]),
    "nemotron": BlockParser("nemotron", [TOOLCALL, QWEN3_CODER]),
}


def tool_parser(name: str) -> ToolParser:
    """A built-in parser by name (what a family's `family_chat_format` puts in its ChatFormat)."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"no built-in tool parser {name!r} (built in: {', '.join(sorted(PARSERS))})") from None
