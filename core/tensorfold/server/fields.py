"""Typed reads of one JSON field each, so a wrong type or range is a 400 naming the field, never a 500."""

from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Mapping
from typing import Any

from tensorfold.server.errors import bad_request

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_INT_DIGITS = 64  # longer integers are read as ±inf, out of every field's range (Python refuses 4,300 digits)
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate can get into a UTF-8 body
SURROGATE = re.compile("[\ud800-\udfff]")


class NotJson(ValueError):
    """A literal Python's json reads but JSON does not have (NaN, Infinity)."""


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object of UTF-8 text; anything else (malformed, NaN, nesting past the recursion
    limit, a string holding a lone surrogate) is a 400 naming the body or the field."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise bad_request(f"the request body is not valid JSON: not UTF-8 text (byte {err.start} is "
                          f"{raw[err.start]:#04x})") from err
    try:
        body = json.loads(text, parse_int=_int, parse_constant=_constant)
    except RecursionError as err:
        raise bad_request("the request body is not valid JSON this server reads: arrays and objects nest too "
                          "deeply") from err
    except ValueError as err:  # JSONDecodeError, NotJson
        raise bad_request(f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {json_type(body)}")
    if SURROGATE_ESCAPE.search(text):
        check_text(body)
    return body


def _int(digits: str) -> int | float:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        return -math.inf if digits.startswith("-") else math.inf
    return int(digits)


def _constant(name: str) -> float:
    raise NotJson(f"{name} is not a JSON value")


def check_text(body: dict[str, Any]) -> None:
    """Refuse a string (key or value) holding a lone surrogate: it is no text, no tokenizer or encoder takes it."""
    queue: deque[tuple[str, Any]] = deque([("", body)])
    while queue:
        where, value = queue.popleft()
        if isinstance(value, str):
            if SURROGATE.search(value):
                raise bad_request(f"'{where}' holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which "
                                  "is not text", where or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                at = f"{where}.{key}" if where else key
                if SURROGATE.search(key):
                    raise bad_request(f"a key in '{where or 'the body'}' holds a lone surrogate, which is not text",
                                      where or None)
                queue.append((at, item))
        elif isinstance(value, list):
            queue.extend((f"{where}[{i}]", item) for i, item in enumerate(value))


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
    if isinstance(value, float) and not math.isfinite(value):  # past MAX_INT_DIGITS digits, or past a float
        bound = (f"at most {high}" if high is not None else "too large") if value > 0 else \
            (f"at least {low}" if low is not None else "too small")
        raise bad_request(f"'{name}' is out of range: {bound}", name)
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



LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value


def read_logit_bias(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: an object from token ids (as strings, or ints) to a number in [-100, 100], added to that
    token's logit; as sorted (id, value) pairs."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request(f"'logit_bias' must be an object of token id to bias, not {json_type(value)}", "logit_bias")
    found: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"'logit_bias' holds token id {token}, outside the vocabulary [0, {vocab_size})",
                              "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -LOGIT_BIAS_LIMIT <= bias <= \
                LOGIT_BIAS_LIMIT:
            raise bad_request(f"'logit_bias' value for token {token} must be a number from -100 to 100, got "
                              f"{bias!r}", "logit_bias")
        if token in found:
            raise bad_request(f"'logit_bias' names token {token} twice", "logit_bias")
        found[token] = float(bias)
    return tuple(sorted(found.items()))
