"""Anthropic's answer shapes without a server: a stream of thinking, text and tool_use blocks read by the anthropic
client's own accumulator ends as the message a non-streamed request returns; stop reasons, usage and the error
envelope by status."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message

from tensorfold.chat.api import ChatFormat, ContentDelta, ReasoningDelta, ReplyParts, ToolCall, ToolCallDelta
from tensorfold.chat.tools import tool_parser
from tensorfold.server.anthropic import anthropic_error, refusal
from tensorfold.server.anthropic_stream import Ending, matched_stop, message_body, message_events, usage_json
from tensorfold.server.errors import ApiError, bad_request, engine_failed, model_not_found, queue_full
from tensorfold.server.generation import EngineFailed, Finish, Piece, Usage
from tensorfold.server.replies import ChatOutput
from tensorfold.server.tooling import AUTO, ToolChoice

USAGE = Usage(prompt_tokens=40, completion_tokens=9, cached_tokens=32)


class Scripted:
    """A reply splitter's stand-in: each pushed piece of text gives the next scripted deltas."""

    def __init__(self, pushes: list[list], last: list, called: bool) -> None:
        self.pushes = list(pushes)
        self.last = last
        self.called = called

    def push(self, text: str) -> list:
        return self.pushes.pop(0)

    def finish(self) -> list:
        return self.last


class Replayed:
    """A Generation's stand-in: its pieces in one batch, then the Finish."""

    def __init__(self, texts: list[str], finish: Finish, stops: tuple[str, ...] = (), stopped: bool = False,
                 decoded: str = "") -> None:
        self.id = "msg-test"
        self.params = SimpleNamespace(model="tiny", prompt=tuple(range(40)), stop=stops)
        self.text = SimpleNamespace(stopped=stopped)
        self.token_ids = [1, 2, 3]
        self.decoded = decoded
        self.finished = False
        self.texts = texts
        self.finish = finish

    async def batches(self, disconnected=None):
        yield [Piece(text, (7,)) for text in self.texts]
        self.finished = True
        yield [self.finish]


def events(generation: Replayed, output) -> list[tuple[str, dict]]:
    """The stream's (event name, data) pairs."""
    async def body() -> bytes:
        ending = Ending(generation, output, lambda ids: generation.decoded)
        return b"".join([part async for part in message_events(generation, output, "msg_test", ending)])
    raw = asyncio.run(body()).decode()
    out = []
    for block in raw.split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def accumulated(pairs: list[tuple[str, dict]]) -> dict:
    """What the anthropic client's stream accumulator makes of the events."""
    snapshot = None
    buffers: dict[int, bytes] = {}
    for name, data in pairs:
        assert data["type"] == name
        if name != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=buffers)
    return Message.model_validate(snapshot.to_dict()).model_dump()


def test_a_stream_of_thinking_text_and_calls_accumulates_to_the_whole_message():
    calls = (ToolCall("call_a", "weather", '{"city": "Paris"}'), ToolCall("call_b", "noop", "{}"))
    output = Scripted([[ReasoningDelta("Let me ")], [ReasoningDelta("think.")], [ContentDelta(""), ContentDelta("Hel")],
                       [ContentDelta("lo")], [ToolCallDelta(0, "call_a", "weather", '{"city"')],
                       [ToolCallDelta(0, arguments=': "Paris"}')]],
                      [ToolCallDelta(1, "call_b", "noop", "{}")], called=True)
    generation = Replayed(["a", "b", "c", "d", "e", "f"], Finish("stop", USAGE))
    pairs = events(generation, output)
    names = [name for name, _ in pairs]
    assert names == ["message_start", "ping",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    start = pairs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == 40
    assert [data["index"] for name, data in pairs if name == "content_block_start"] == [0, 1, 2, 3]
    assert pairs[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                            "usage": usage_json(USAGE)}
    whole = message_body("msg_test", "tiny", ReplyParts("Hello", "Let me think.", calls), ("tool_use", None), USAGE)
    assert accumulated(pairs) == Message.model_validate(whole).model_dump()
    assert [block["type"] for block in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole["content"][2]["input"] == {"city": "Paris"}


def test_a_text_stream_without_a_splitter_is_one_text_block():
    generation = Replayed(["Hel", "", "lo"], Finish("length", USAGE))
    pairs = events(generation, None)
    assert [name for name, _ in pairs] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta",
                                           "message_stop"]
    whole = message_body("msg_test", "tiny", ReplyParts("Hello"), ("max_tokens", None), USAGE)
    assert accumulated(pairs) == Message.model_validate(whole).model_dump()


def test_an_empty_reply_has_no_blocks():
    pairs = events(Replayed([""], Finish("stop", USAGE)), None)
    assert [name for name, _ in pairs] == ["message_start", "ping", "message_delta", "message_stop"]
    assert message_body("m", "tiny", ReplyParts(""), ("end_turn", None), USAGE)["content"] == []


@pytest.mark.parametrize("engine, called, stopped, reason", [
    ("length", False, False, ("max_tokens", None)), ("length", True, False, ("max_tokens", None)),
    ("stop", True, False, ("tool_use", None)), ("stop", False, True, ("stop_sequence", "END")),
    ("stop", False, False, ("end_turn", None)),
])
def test_stop_reasons(engine, called, stopped, reason):
    generation = Replayed([], Finish(engine, USAGE), stops=("never", "END"), stopped=stopped, decoded="Done END.")
    output = Scripted([], [], called) if called else None
    assert Ending(generation, output, lambda ids: generation.decoded).of(Finish(engine, USAGE)) == reason


def test_the_stop_sequence_is_the_earliest_then_the_shortest():
    decode = lambda ids: "abc STOP and more END"  # noqa: E731
    assert matched_stop(("END", "STOP"), [1], decode) == "STOP"
    assert matched_stop(("STOP", "ST"), [1], decode) == "ST"
    assert matched_stop(("zzz",), [1], decode) is None


def test_usage_counts_resumed_tokens_as_cache_reads():
    assert usage_json(USAGE) == {"input_tokens": 8, "output_tokens": 9, "cache_read_input_tokens": 32,
                                 "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("err, status, kind", [
    (bad_request("'top_p' must be greater than 0", "top_p"), 400, "invalid_request_error"),
    (model_not_found("gpt", ("tiny",)), 404, "not_found_error"),
    (engine_failed("boom"), 500, "api_error"),
    (queue_full("64 requests wait"), 503, "overloaded_error"),
    (ApiError(401, "no key"), 401, "authentication_error"),
    (ApiError(413, "too large"), 413, "request_too_large"),
])
def test_errors_in_anthropics_envelope(err, status, kind):
    response = anthropic_error(err)
    body = json.loads(response.body)
    assert response.status_code == status and body == {"type": "error", "error": {"type": kind,
                                                                                   "message": body["error"]["message"]}}
    assert err.message in body["error"]["message"]
    if status == 503:
        assert response.headers["retry-after"] == "1"


def test_an_error_message_names_its_field():
    body = json.loads(anthropic_error(bad_request("must be a string", "messages[0].content")).body)
    assert body["error"]["message"] == "messages[0].content: must be a string"


def test_a_real_splitter_streams_the_blocks_its_whole_split_gives():
    tools = ({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},)
    format = ChatFormat(tool_parser=tool_parser("hermes"), think_start="<think>", think_end="</think>")
    text = ('<think>Paris, then.</think>Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris", "days": 2}}\n</tool_call>')
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    streamed = ChatOutput(format, tools, ToolChoice(AUTO), False)
    pairs = events(Replayed(pieces, Finish("stop", USAGE)), streamed)
    whole = ChatOutput(format, tools, ToolChoice(AUTO), False)
    body = message_body("msg_test", "tiny", whole.whole(text), ("tool_use", None), USAGE)
    assert [block["type"] for block in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][2]["input"] == {"city": "Paris", "days": 2}
    got = accumulated(pairs)
    assert got["stop_reason"] == "tool_use" and got["content"][2]["id"].startswith("call_")
    for message in (got, body):
        message["content"][2]["id"] = "call"
    assert got == Message.model_validate(body).model_dump()


def test_the_front_doors_refusals_take_the_envelope_of_their_path():
    err = ApiError(401, "Incorrect API key provided.", param="x-api-key", code="invalid_api_key")
    assert json.loads(refusal("/v1/messages", err).body)["error"]["type"] == "authentication_error"
    assert json.loads(refusal("/v1/messages/count_tokens", err).body)["type"] == "error"
    assert json.loads(refusal("/v1/chat/completions", err).body)["error"]["code"] == "invalid_api_key"


class Failing(Replayed):
    """A generation whose engine fails after the first piece."""

    async def batches(self, disconnected=None):
        yield [Piece("Hel", (7,))]
        self.finished = True
        raise EngineFailed("the engine stopped: device lost")


def test_an_engine_failure_mid_stream_is_an_error_event_in_anthropics_envelope():
    pairs = events(Failing([], Finish("stop", USAGE)), None)
    assert [name for name, _ in pairs] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "error"]
    assert pairs[-1][1] == {"type": "error", "error": {"type": "api_error",
                                                       "message": "the engine stopped: device lost"}}
