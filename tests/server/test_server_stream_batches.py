"""A stream's events leave in one body write per wake-up: an engine stub hands the server scripted batches of
events through the request's sink (as the engine does once per step), and the SSE body is read write by write.
The events are the ones a token-by-token stream sends (one per piece of text), byte for byte."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tensorfold.engine.api import DoneEvent, ErrorEvent, Event, Request, Sampling, TokenEvent
from tensorfold.server.generation import Generation
from tensorfold.server.params import Generate
from tensorfold.server.payloads import CHAT, TEXT, Shaper
from tensorfold.server.sse import chunks
from tensorfold.service import Service
from tensorfold.tokenizer import ChatTokenizer

HELLO = (42, 348, 81, 278, 264)  # "H" "ell" "o" " the" "re": "Hello there" in the tiny tokenizer
CAFE = (69, 67, 72, 130, 105)    # "c" "a" "f" and the two bytes of "é"
HEAD = b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":0,"model":"tiny","choices":'


def text(content: str) -> bytes:
    """A chat text chunk's exact bytes."""
    return (HEAD + b'[{"index":0,"delta":{"content":"' + content.encode()
            + b'"},"logprobs":null,"finish_reason":null}]}\n\n')


ROLE = HEAD + b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
DONE = b"data: [DONE]\n\n"


def finish(reason: str) -> bytes:
    return HEAD + b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":"' + reason.encode() + b'"}]}\n\n'


class Scripted:
    """An engine that hands each request's events over in the batches it was given, one sink delivery each:
    the first at submit, the next each time the test calls `next`."""

    def __init__(self, *batches: list[Event]) -> None:
        self.batches = list(batches)
        self.request: Request | None = None
        self.failure = None

    def submit(self, request: Request) -> None:
        self.request = request
        self.next()

    def next(self) -> None:
        assert self.request is not None and self.request.sink is not None
        self.request.sink.deliver([(self.request, event) for event in self.batches.pop(0)])

    def snapshot(self) -> dict:
        return {}


def tokens(*ids: int) -> list[Event]:
    return [TokenEvent(i) for i in ids]


def done(count: int, reason: str = "length") -> DoneEvent:
    return DoneEvent(reason, 3, count, 0)


async def writes(engine: Scripted, tokenizer: ChatTokenizer, kind: str = CHAT, stop: tuple[str, ...] = (),
                 ids: bool = False) -> list[bytes]:
    """The body writes of one streamed request: after each write the engine hands over its next batch."""
    service = Service(engine=engine, tokenizer=tokenizer, model_name="tiny", family="example", context=64,
                      defaults=Sampling())
    params = Generate(model="tiny", prompt=(1, 2, 3), sampling=Sampling(), stop=stop, stream=True,
                      return_token_ids=ids)
    generation = Generation(service, params, "chatcmpl" if kind == CHAT else "cmpl")
    shaper = Shaper(kind, "chatcmpl-x" if kind == CHAT else "cmpl-x", "tiny", ids)
    shaper.created = 0
    generation.submit()
    await generation.first_event_ok(None)
    out = []
    async for write in chunks(generation, shaper, include_usage=False):
        out.append(write)
        if engine.batches:
            engine.next()
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> ChatTokenizer:
    return ChatTokenizer(tiny_checkpoint)


def test_one_batch_is_one_write_of_every_event(tokenizer):
    body = asyncio.run(writes(Scripted([*tokens(*HELLO), done(5)]), tokenizer))
    assert body == [ROLE + text("H") + text("ell") + text("o") + text(" the") + text("re") + finish("length") + DONE]


def test_batches_are_written_as_they_come(tokenizer):
    engine = Scripted(tokens(42), tokens(348, 81), tokens(278, 264), [done(5)])
    body = asyncio.run(writes(engine, tokenizer))
    assert body == [ROLE + text("H"), text("ell") + text("o"), text(" the") + text("re"), finish("length") + DONE]


def test_a_character_split_over_batches_waits_for_its_last_byte(tokenizer):
    engine = Scripted(tokens(*CAFE[:4]), [TokenEvent(CAFE[4]), done(5)])
    body = asyncio.run(writes(engine, tokenizer))
    assert body == [ROLE + text("c") + text("a") + text("f"), text("é") + finish("length") + DONE]


def test_tokens_after_a_stop_string_in_the_same_batch_are_dropped(tokenizer):
    engine = Scripted([*tokens(*HELLO), *tokens(*HELLO)], [done(10, "cancelled")])
    body = asyncio.run(writes(engine, tokenizer, stop=("o t",)))
    assert body == [ROLE + text("H") + text("ell"), finish("stop") + DONE]
    assert engine.request is not None and engine.request.cancelled.is_set()


def test_an_error_after_pieces_of_the_same_batch_follows_them_in_one_write(tokenizer):
    engine = Scripted(tokens(42), [*tokens(348, 81), ErrorEvent("the engine failed this request: RuntimeError: x")])
    body = asyncio.run(writes(engine, tokenizer))
    error = (b'data: {"error":{"message":"the engine failed this request: RuntimeError: x","type":"server_error",'
             b'"param":null,"code":null}}\n\n')
    assert body == [ROLE + text("H"), text("ell") + text("o") + error + DONE]


def test_completion_chunks_carry_the_ids_of_their_own_piece(tokenizer):
    body = asyncio.run(writes(Scripted([*tokens(*CAFE), done(5)]), tokenizer, kind=TEXT, ids=True))
    head = b'data: {"id":"cmpl-x","object":"text_completion","created":0,"model":"tiny",'
    first = head + b'"prompt_token_ids":[1,2,3],"choices":[{"index":0,"text":"c","logprobs":null,' \
                   b'"finish_reason":null,"token_ids":[69]}]}\n\n'

    def piece(content: str, ids: str, reason: str = "null") -> bytes:
        return (head + b'"choices":[{"index":0,"text":"' + content.encode() + b'","logprobs":null,"finish_reason":'
                + reason.encode() + b',"token_ids":[' + ids.encode() + b"]}]}\n\n")

    assert body == [first + piece("a", "67") + piece("f", "72") + piece("é", "130,105")
                    + piece("", "", '"length"') + DONE]
