"""Fuzzed requests for the HTTP API, seeded so that every failure it finds can be sent again byte for byte.

Each case is a valid request of one endpoint put through one mutation (its `kind`): wrong types, missing and
extra fields, extreme numbers, deep nesting, integers past Python's 4,300-digit limit, lone surrogates, odd
unicode, special-token strings, long strings, bad content types, garbage bodies, early disconnects. Pure: no I/O
(tensorfold.testing.fuzz_http sends them).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import attrs

CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
ENDPOINTS = (CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE)
JSON = "application/json"
RUN = re.compile(r"(.{1,12}?)\1{15,}", re.DOTALL)  # a unit repeated 16 times or more, for short reproducers
SLOT = "\x00tensorfold-fuzz-slot\x00"  # replaced by a raw JSON fragment after json.dumps
WORDS = ("the", "quick", "brown", "fox", "kept", "state", "resume", "Hello", "Paris", "sea", "cat", "model", "7")
SPECIAL_STRINGS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>system\n", "<|im_end|>\n<|im_start|>",
                   "<|im_", "|>", "<|im_start|>assistant\n")
ODD_UNICODE = ("\u2028", "\u2029", "\u0085", "\u200b", "\u200d", "\ufeff", "\u202e", "\U0001f600", "e\u0301",
               "\u0000", "\uffff", "\U0010ffff", "\ue000", "\ufdfa", "\U0001d54f", "\r\n", "\t", "\\", '"',
               "data: [DONE]\n\n", "\x1b[31m", "\u00a0", "\u0301" * 64, "ǅ", "İ", "ß")
LONE_SURROGATES = ('"\\ud800"', '"\\udfff"', '"a\\ud800b"', '"\\udc00\\ud800"', '"\\ud83d"', '"x\\udbff"')
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens", "n",
                   "ignore_eos", "return_token_ids", "stream", "stop", "cache_salt", "stream_options", "logprobs",
                   "top_logprobs", "frequency_penalty", "presence_penalty", "logit_bias", "response_format", "tools",
                   "best_of", "echo", "suffix", "user", "chat_template_kwargs", "add_generation_prompt", "model")
WRONG_TYPES: tuple[Any, ...] = (None, True, False, 0, -1, 1.5, "", "x", "1", "true", [], [1], ["a"], {}, {"a": 1},
                                [[]], [None], {"type": "text"})
NUMBERS: tuple[Any, ...] = (0, -1, 1, 2, -(2**63) - 1, 2**63, 2**64, 2**200, 1e308, -1e308, 5e-324, 1e-46, 1e-300,
                            -0.0, 0.5, 3.0, 1.0000001, 2**53 + 1.0, 4096, 10**9, -(10**9))
RAW_NUMBERS = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E-46", "-0", "0.0e0", "1" + "0" * 400)
CONTENT_TYPES = (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=utf-16", "application/JSON", "application/json-patch+json", "",
                 "application/json, text/plain", "text/event-stream", "application/json; charset=latin-1",
                 "*/*", "application/octet-stream")


@attrs.frozen
class Limits:
    """What the server under test accepts: its context, body limit and vocabulary."""

    context: int
    max_body: int
    vocab: int


@attrs.frozen
class Case:
    """One fuzzed HTTP request and how to read its answer; `kind` names the mutation, for grouping failures."""

    index: int
    kind: str
    path: str
    body: bytes
    content_type: str | None = JSON
    method: str = "POST"
    hang_up_after: int | None = None  # SSE lines read before hanging up; 0: hang up before any answer

    def reproducer(self, shown: int = 400) -> str:
        """A curl line for this case, a run of one unit written «unit×count» and the body cut to `shown` chars (the
        seed and index give the exact bytes)."""
        text = RUN.sub(lambda m: f"«{m[1]}×{len(m[0]) // len(m[1])}»", self.body.decode("utf-8", "backslashreplace"))
        cut = text if len(text) <= shown else f"{text[:shown]}... ({len(self.body)} bytes in all)"
        header = f" -H 'content-type: {self.content_type}'" if self.content_type is not None else ""
        hang_up = f"  # hang up after {self.hang_up_after} events" if self.hang_up_after is not None else ""
        return f"curl -X {self.method} $URL{self.path}{header} --data-binary '{cut}'{hang_up}"


Path = tuple[str | int, ...]


def leaf_paths(value: Any, at: Path = ()) -> list[Path]:
    """Every place in a JSON value a mutation can replace: each object member and array item, nested ones too."""
    found: list[Path] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found.append((*at, key))
        found.extend(leaf_paths(item, (*at, key)))
    return found


def set_at(body: Any, path: Path, value: Any) -> None:
    """Put `value` at `path` (the last key may be new)."""
    for key in path[:-1]:
        body = body[key]
    body[path[-1]] = value


def delete_at(body: Any, path: Path) -> None:
    """Remove the member or item at `path`."""
    for key in path[:-1]:
        body = body[key]
    del body[path[-1]]


def with_raw(body: dict[str, Any], path: Path, fragment: str | bytes) -> bytes:
    """`body` as JSON with the raw text `fragment` at `path` (NaN, huge integers, lone surrogates, nesting...)."""
    set_at(body, path, SLOT)
    raw = fragment if isinstance(fragment, bytes) else fragment.encode("utf-8", "surrogatepass")
    return json.dumps(body).encode().replace(json.dumps(SLOT).encode(), raw, 1)


def nested(depth: int, rng: random.Random) -> str:
    """A JSON value nested `depth` arrays or objects deep."""
    if rng.random() < 0.5:
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


class Fuzzer:
    """Cases from one seed: the same seed and limits give the same cases, in the same order."""

    def __init__(self, seed: int, limits: Limits) -> None:
        self.rng = random.Random(seed)
        self.limits = limits
        self.mutations: dict[str, Callable[[str], tuple[dict[str, Any] | bytes, dict[str, Any]]]] = {
            "valid": self._valid, "sampling": self._sampling, "wrong-type": self._wrong_type,
            "missing": self._missing, "extra": self._extra, "number": self._number, "big-int": self._big_int,
            "nested": self._nested, "surrogate": self._surrogate, "unicode": self._unicode,
            "special-tokens": self._special, "long": self._long, "content-type": self._content_type,
            "garbage": self._garbage, "messages": self._messages, "token-ids": self._token_ids,
            "duplicate-keys": self._duplicate_keys, "method": self._method,
        }
        self.weights = {"valid": 4, "sampling": 4, "long": 1, "method": 1}

    def cases(self, count: int) -> Iterator[Case]:
        """`count` cases, every kind drawn by its weight (default 2)."""
        kinds = list(self.mutations)
        weights = [self.weights.get(kind, 2) for kind in kinds]
        for index in range(count):
            kind = self.rng.choices(kinds, weights)[0]
            path = self.rng.choice(ENDPOINTS)
            body, extra = self.mutations[kind](path)
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            path = extra.pop("path", path)
            if path in (CHAT, COMPLETIONS) and self.rng.random() < 0.25:
                extra["hang_up_after"] = self.rng.randint(0, 3)
            yield Case(index, kind, path, raw, **extra)

    # the valid bodies every mutation starts from

    def words(self, count: int | None = None) -> str:
        """A few words of the tiny tokenizer's corpus."""
        return " ".join(self.rng.choice(WORDS) for _ in range(count or self.rng.randint(1, 12)))

    def base(self, path: str) -> dict[str, Any]:
        """A small valid request for `path`: a few tokens in, at most eight out."""
        rng = self.rng
        if path == DETOKENIZE:
            return {"tokens": [rng.randrange(self.limits.vocab) for _ in range(rng.randint(1, 8))]}
        if path == TOKENIZE:
            if rng.random() < 0.5:
                return {"prompt": self.words()}
            return {"messages": self.chat_messages(), "add_generation_prompt": rng.random() < 0.5}
        body: dict[str, Any] = {"model": "tiny", "max_tokens": rng.randint(1, 8)}
        if path == CHAT:
            body["messages"] = self.chat_messages()
        else:
            body["prompt"] = self.words() if rng.random() < 0.7 else [rng.randrange(3, self.limits.vocab)
                                                                       for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.4:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            body["temperature"] = rng.choice([0, 0.7, 1.0])
        if rng.random() < 0.3:
            body["seed"] = rng.randint(0, 1000)
        return body

    def chat_messages(self) -> list[dict[str, Any]]:
        """A short chat: an optional system message, then user/assistant turns ending with the user."""
        turns = self.rng.randint(1, 3)
        said = [{"role": "system", "content": self.words()}] if self.rng.random() < 0.3 else []
        for turn in range(turns):
            said.append({"role": "user", "content": self.words()})
            if turn < turns - 1:
                said.append({"role": "assistant", "content": self.words()})
        return said

    def field(self, body: dict[str, Any]) -> Path:
        """A place to mutate: any member or item already there, or a top-level field the API knows of."""
        if self.rng.random() < 0.6:
            return self.rng.choice(leaf_paths(body))
        return (self.rng.choice(SAMPLING_FIELDS),)

    def string_field(self, body: dict[str, Any]) -> Path:
        """A place where text goes: a message's content or role, the prompt, stop, model or cache_salt."""
        places: list[Path] = [path for path in leaf_paths(body)
                              if path[-1] in ("content", "role", "prompt") or path[0] == "prompt"]
        places += [("stop",), ("model",), ("cache_salt",), ("chat_template_kwargs", "extra"), ("user",)]
        path = self.rng.choice(places)
        if path == ("chat_template_kwargs", "extra"):
            body["chat_template_kwargs"] = {}
        return path

    # mutations: each returns a body (a dict, or raw bytes) and Case fields beyond the defaults

    def _valid(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.base(path), {}

    def _sampling(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Legal but extreme sampling: the values that once made the sampler divide 0 by 0."""
        rng = self.rng
        body = self.base(CHAT if path in (TOKENIZE, DETOKENIZE) else path)
        body["temperature"] = rng.choice([0, 1e-6, 1e-5, 0.5, 1.0, 2.0, 100.0, 1e30, 1e300])
        choices = {"top_p": [1e-46, 1e-45, 1e-38, 1e-8, 0.001, 0.5, 1.0], "top_k": [-1, 0, 1, 2, 511, 512, 10**9],
                   "min_p": [0.0, 0.5, 0.999999, 1.0], "seed": [0, -(2**63), 2**64 - 1, 2**63],
                   "max_tokens": [1, 2, self.limits.context // 2],
                   "stop": ["\n", "", [""], ["the", "e"], ["<|im_end|>"], ["x" * 4096], [str(i) for i in range(500)],
                            [" "] * 64, ["\ud7ff\U0001f600"]]}
        for name in rng.sample(sorted(choices), rng.randint(1, 3)):
            body[name] = rng.choice(choices[name])
        return body, {"path": CHAT if path in (TOKENIZE, DETOKENIZE) else path}

    def _wrong_type(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        body = self.base(path)
        set_at(body, self.field(body), self.rng.choice(WRONG_TYPES))
        return body, {}

    def _missing(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        body = self.base(path)
        delete_at(body, self.rng.choice(leaf_paths(body)))
        return body, {}

    def _extra(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        body = self.base(path)
        for _ in range(self.rng.randint(1, 4)):
            name = self.rng.choice(["x", "__proto__", "constructor", "", " ", "messages ", "n\u0000", "💥"])
            body[name + str(self.rng.randint(0, 9))] = self.rng.choice(WRONG_TYPES)
        if self.rng.random() < 0.5 and isinstance(body.get("messages"), list):
            body["messages"][0]["extra"] = self.rng.choice(WRONG_TYPES)
        return body, {}

    def _number(self, path: str) -> tuple[dict[str, Any] | bytes, dict[str, Any]]:
        body = self.base(path)
        where = self.field(body)
        if self.rng.random() < 0.3:
            return with_raw(body, where, self.rng.choice(RAW_NUMBERS)), {}
        set_at(body, where, self.rng.choice(NUMBERS))
        return body, {}

    def _big_int(self, path: str) -> tuple[bytes, dict[str, Any]]:
        body = self.base(path)
        digits = self.rng.choice([4301, 4400, 5000, 20000])
        sign = self.rng.choice(["", "-"])
        return with_raw(body, self.field(body), sign + "9" * digits), {}

    def _nested(self, path: str) -> tuple[bytes, dict[str, Any]]:
        depth = self.rng.choice([200, 1000, 1100, 5000, 50000])
        if self.rng.random() < 0.2:
            return nested(depth, self.rng).encode(), {}
        body = self.base(path)
        return with_raw(body, self.field(body), nested(depth, self.rng)), {}

    def _surrogate(self, path: str) -> tuple[bytes, dict[str, Any]]:
        body = self.base(path)
        if self.rng.random() < 0.2:  # the same code point as raw (CESU-8) bytes, and bytes that are not UTF-8
            raw = self.rng.choice([b"\xed\xa0\x80", b"\xff", b"\xc3", b"\xf4\x90\x80\x80"])
            return with_raw(body, self.string_field(body), b'"a' + raw + b'"'), {}
        return with_raw(body, self.string_field(body), self.rng.choice(LONE_SURROGATES)), {}

    def _unicode(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        body = self.base(path)
        text = "".join(self.rng.choice(ODD_UNICODE) for _ in range(self.rng.randint(1, 6)))
        set_at(body, self.string_field(body), self.words(2) + text)
        return body, {}

    def _special(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        body = self.base(path)
        if path == DETOKENIZE:
            body["tokens"] = [self.rng.randrange(3) for _ in range(self.rng.randint(1, 5))]
            return body, {}
        set_at(body, self.string_field(body), self.rng.choice(SPECIAL_STRINGS) + self.words(3))
        return body, {}

    def _long(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Text from twice the context up to just over the body limit, or a great many messages."""
        body = self.base(path)
        size = self.rng.choice([self.limits.context * 8, self.limits.max_body // 2, self.limits.max_body - 256,
                                self.limits.max_body + 1])
        if path == CHAT and self.rng.random() < 0.3:
            message = {"role": "user", "content": "a"}
            body["messages"] = [message] * (size // (len(json.dumps(message)) + 2))
        elif path == DETOKENIZE:
            body["tokens"] = [3] * (size // 3)
        else:
            set_at(body, self.string_field(body), ("kept state " * (size // 11 + 1))[:size])
        return body, {}

    def _content_type(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.base(path), {"content_type": self.rng.choice(CONTENT_TYPES)}

    def _garbage(self, path: str) -> tuple[bytes, dict[str, Any]]:
        valid = json.dumps(self.base(path)).encode()
        return self.rng.choice([
            b"", b"null", b"[]", b"123", b'"text"', b"true", b"{", b"{}", b"{" * 3, valid[: len(valid) // 2],
            valid + b"}", valid + b" trailing", b"\xef\xbb\xbf" + valid, valid.decode().encode("utf-16"),
            bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 64))), b"\x00" * 16,
        ]), {}

    def _messages(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Chat messages of odd shapes: roles, content parts, nulls, tool fields."""
        body = self.base(CHAT)
        rng = self.rng
        odd = rng.choice([
            {"content": "no role"}, {"role": None, "content": "x"}, {"role": "", "content": "x"},
            {"role": "user"}, {"role": "user", "content": None}, {"role": "assistant", "content": None},
            {"role": "tool", "content": "x", "tool_call_id": 5}, {"role": "user", "content": {"text": "x"}},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
            {"role": "user", "content": [{"type": "text", "text": 5}]}, {"role": "user", "content": [{"type": 1}]},
            {"role": "user", "content": [[["x"]]]}, {"role": "user", "content": [None, "x"]},
            {"role": "user", "content": [{"type": "input_audio"}]}, {"role": "user", "content": []},
            {"role": "user", "content": "x", "name": ["n"]}, {"role": "assistant", "tool_calls": "x"},
            {"role": "developer", "content": "x"}, {"role": "x" * 300, "content": "x"}, "just a string", 5, None,
        ])
        where = rng.choice(["append", "replace", "only"])
        if where == "append":
            body["messages"].append(odd)
        elif where == "replace":
            body["messages"][rng.randrange(len(body["messages"]))] = odd
        else:
            body["messages"] = [odd]
        return body, {"path": rng.choice([CHAT, TOKENIZE])}

    def _token_ids(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        vocab = self.limits.vocab
        ids = self.rng.choice([[], [-1], [vocab], [vocab - 1, 0], [3.0, 4], [True], [[1, 2], [3]], [[1, 2]],
                               [10**30], [None], ["a"], [1.5], [2**63], [[]], [["a"]], [[-5]]])
        path = self.rng.choice([COMPLETIONS, DETOKENIZE])
        body = self.base(path)
        body["prompt" if path == COMPLETIONS else "tokens"] = ids
        return body, {"path": path}

    def _duplicate_keys(self, path: str) -> tuple[bytes, dict[str, Any]]:
        body = self.base(path)
        name = self.rng.choice([*body, "max_tokens", "top_p"])
        return with_raw(body, (name,), f'1, "{name}": {self.rng.choice(["null", "-1", "1e-46", "[]", "1e999"])}'), {}

    def _method(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.base(path), {"method": self.rng.choice(["GET", "PUT", "DELETE", "PATCH"])}
