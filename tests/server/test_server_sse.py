"""The SSE encoder: one event is one line to every line splitter (str.splitlines, httpx), and its JSON reads back
to the payload it was given."""

from __future__ import annotations

import json

import httpx
import pytest

from tensorfold.server.sse import event

SPLITTERS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


@pytest.mark.parametrize("char", list(SPLITTERS))
def test_every_line_break_is_escaped(char):
    payload = {"text": f"a{char}b", "model": char}
    raw = event(payload)
    assert raw.endswith(b"\n\n") and raw.startswith(b"data: {")
    line = raw[:-2].decode()
    assert line.splitlines() == [line]
    assert json.loads(line.removeprefix("data: ")) == payload


def test_exact_bytes_of_an_event():
    assert event({"t": "x\u2028y\x85z\u2029 \u00e9\n"}) == b'data: {"t":"x\\u2028y\\u0085z\\u2029 \xc3\xa9\\n"}\n\n'


def test_httpx_reads_one_line_per_event():
    body = event({"text": "one\u2028two"}) + event({"text": "\x85\u2029"}) + b"data: [DONE]\n\n"
    response = httpx.Response(200, content=body)
    lines = [line for line in response.iter_lines() if line]
    assert [json.loads(line[6:]) for line in lines[:2]] == [{"text": "one\u2028two"}, {"text": "\x85\u2029"}]
    assert lines[2] == "data: [DONE]"
