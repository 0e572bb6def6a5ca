"""Structured output asked for in a request: OpenAI's `response_format` and vLLM's `structured_outputs` and
`guided_*` fields, read into one grammar spec (at most one source), checked by the served grammar engine."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tensorfold.engine.grammar import GrammarSpec
from tensorfold.server.errors import bad_request
from tensorfold.server.fields import json_type
from tensorfold.server.tooling import ToolChoice, forced_schema

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object"}


def read_grammar(body: Mapping[str, Any], tools: list[dict[str, Any]], choice: ToolChoice,
                 grammars: Any) -> GrammarSpec | None:
    """The request's one grammar (a forced tool call's, response_format's, structured_outputs' or a guided_*
    field's), or None; two sources, or one the grammar engine cannot build, are a 400 naming the field."""
    found: list[tuple[str, GrammarSpec]] = []
    schema = forced_schema(tools, choice)
    if schema is not None:
        found.append(("tool_choice", GrammarSpec("json_schema", json.dumps(schema))))
    response = _response_format(body)
    if response is not None:
        found.append(("response_format", response))
    structured = body.get("structured_outputs")
    if structured is not None:
        found.append(("structured_outputs", _structured(structured)))
    for field, kind in GUIDED.items():
        if body.get(field) is not None:
            found.append((field, _spec(kind, body[field], field)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _ in found)
        raise bad_request(f"give one kind of structured output, not {names} together", found[1][0])
    field, spec = found[0]
    if grammars is None:
        raise bad_request(f"'{field}': this server has no grammar engine installed (pip install llguidance)", field)
    problem = grammars.problem(spec)
    if problem is not None:
        raise bad_request(f"'{field}': {problem}", field)
    return spec


def _response_format(body: Mapping[str, Any]) -> GrammarSpec | None:
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "json_schema":
        wrapper = value.get("json_schema")
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON schema object",
                              "response_format.json_schema.schema")
        return GrammarSpec("json_schema", json.dumps(schema))
    raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema'; got {kind!r}",
                      "response_format")


def _structured(value: Any) -> GrammarSpec:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    if not isinstance(value, dict):
        raise bad_request(f"'structured_outputs' must be an object, not {json_type(value)}", "structured_outputs")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(given.keys() - STRUCTURED_KEYS)
    if unknown:
        raise bad_request(f"'structured_outputs.{unknown[0]}' is not supported by this server",
                          f"structured_outputs.{unknown[0]}")
    if len(given) != 1:
        raise bad_request("'structured_outputs' must give exactly one of json, regex, choice, grammar, json_object",
                          "structured_outputs")
    (key, item), = given.items()
    if key == "json_object":
        return GrammarSpec("json_object", "")
    return _spec(key, item, f"structured_outputs.{key}")


def _spec(kind: str, value: Any, field: str) -> GrammarSpec:
    """One grammar source: a JSON schema (object or its text), a regex, a list of choices, or a Lark grammar."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise bad_request(f"'{field}' is not valid JSON: {err}", field) from err
        if not isinstance(value, dict):
            raise bad_request(f"'{field}' must be a JSON schema object", field)
        return GrammarSpec("json_schema", json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"'{field}' must be a non-empty array of strings", field)
        return GrammarSpec("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{field}' must be a non-empty string", field)
    return GrammarSpec("regex" if kind == "regex" else "lark", value)
