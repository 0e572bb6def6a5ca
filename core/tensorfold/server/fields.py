"""Typed reads of one JSON field each, so a wrong type or range is a 400 naming the field, never a 500."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from tensorfold.server.errors import bad_request

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; anything else is a 400."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {json_type(body)}")
    return body


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def read_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, not {json_type(value)}", name)
    return value


def read_int(body: Mapping[str, Any], name: str, low: int | None = None, high: int | None = None) -> int | None:
    """An integer field within [low, high]; None when absent. 3.0 counts as 3, as JSON does not tell them apart."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, not {json_type(value)}", name)
    if low is not None and value < low:
        raise bad_request(f"'{name}' must be at least {low}, got {value}", name)
    if high is not None and value > high:
        raise bad_request(f"'{name}' must be at most {high}, got {value}", name)
    return value


def read_float(body: Mapping[str, Any], name: str, low: float | None = None, high: float | None = None,
               low_open: bool = False) -> float | None:
    """A finite number field within its range (`low_open` excludes `low` itself); None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"'{name}' must be a number, not {json_type(value)}", name)
    value = float(value)
    if not math.isfinite(value):
        raise bad_request(f"'{name}' must be a finite number", name)
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"greater than {low:g}" if low_open else f"at least {low:g}"
        raise bad_request(f"'{name}' must be {bound}, got {value:g}", name)
    if high is not None and value > high:
        raise bad_request(f"'{name}' must be at most {high:g}, got {value:g}", name)
    return value


def read_str(body: Mapping[str, Any], name: str) -> str | None:
    """A string field; None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, not {json_type(value)}", name)
    return value


def read_object(body: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A JSON object field; {} when absent."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object, not {json_type(value)}", name)
    return value


def read_stop(body: Mapping[str, Any], name: str = "stop") -> tuple[str, ...]:
    """`stop`: a string or a list of strings; empty strings are dropped (they would stop at once)."""
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request(f"'{name}' must be a string or an array of strings", name)
    return tuple(dict.fromkeys(s for s in items if s))


def read_token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    """A list of token ids, each a known id."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"'{name}' must be an array of integer token ids", name)
    for token in value:
        if not 0 <= token < vocab_size:
            raise bad_request(f"'{name}' holds token id {token}, outside the vocabulary [0, {vocab_size})", name)
    return list(value)

