"""Server-sent events: a generation as `data: {...}` chunks, then `data: [DONE]`; the engine freed if abandoned."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tensorfold.server.errors import SERVER, envelope
from tensorfold.server.generation import Choices, EngineFailed, Finish, Generation, Piece
from tensorfold.server.payloads import CHAT, Shaper
from tensorfold.server.replies import ChatOutput, finish_reason

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Line breaks to str.splitlines (and so to line-splitting SSE clients) that json.dumps leaves raw; the others
# (\n \r \x0b \x0c \x1c-\x1e) are control characters, which it escapes already.
LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"}


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event holding a JSON object, on one line however a client splits lines."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


class ChoiceChunks:
    """One choice's stream chunks: a role chunk (chat), text chunks (a chat's `output` splits them into content,
    reasoning and tool-call deltas) and its finish chunk; the prompt's ids (return_token_ids) ride its first."""

    def __init__(self, shaper: Shaper, prompt: list[int], output: ChatOutput | None = None) -> None:
        self.shaper = shaper
        self.output = output
        self._prompt: list[int] | None = prompt
        self._pending: list[int] = []  # token ids not yet sent with a reply part (return_token_ids)
        self._entries: list = []       # their logprob entries (logprobs)

    def start(self) -> list[bytes]:
        """The chunks a choice opens with: a chat's role chunk."""
        if self.shaper.kind != CHAT:
            return []
        opening = event(self.shaper.chunk("", role=True, prompt=self._prompt))
        self._prompt = None
        return [opening]

    def push(self, item: Piece | Finish) -> list[bytes]:
        """The chunks one item makes (none while text is held back)."""
        parts: list[bytes] = []
        output = self.output
        if isinstance(item, Finish):
            if output is not None:
                self._split(output.finish(), parts)
            reason = finish_reason(item.finish_reason, output)
            parts.append(event(self.shaper.chunk(None, reason, token_ids=tuple(self._pending), prompt=self._prompt,
                                                 entries=self._entries)))
        elif output is not None:
            self._pending += item.token_ids
            self._entries += item.logprobs
            self._split(output.push(item.text), parts)
        elif item.text or (self.shaper.return_token_ids and item.token_ids) or item.logprobs:
            parts.append(event(self.shaper.chunk(item.text, token_ids=item.token_ids, prompt=self._prompt,
                                                 entries=item.logprobs)))
            self._prompt = None
        return parts

    def _split(self, deltas: list, parts: list[bytes]) -> None:
        """A chunk per reply part; the ids and logprob entries gathered so far ride the first."""
        for delta in deltas:
            chunk = self.shaper.delta_chunk(delta, self._entries)
            self._entries = []
            if self.shaper.return_token_ids:
                chunk["choices"][0]["token_ids"], self._pending = self._pending, []
            parts.append(event(chunk))


async def chunks(generation: Generation, shaper: Shaper, include_usage: bool,
                 output: ChatOutput | None = None) -> AsyncIterator[bytes]:
    """The stream body: the choice's chunks (ChoiceChunks), the usage chunk if asked, [DONE]. The events of one
    wake-up go out as one body write; the events themselves are one per Piece (or reply part) whatever the
    batching."""
    choice = ChoiceChunks(shaper, list(generation.params.prompt), output)
    parts = choice.start()
    try:
        async for batch in generation.batches():
            for item in batch:
                parts += choice.push(item)
                if isinstance(item, Finish) and include_usage:
                    parts.append(event(shaper.usage_chunk(item.usage)))
            if parts and not generation.finished:  # the last batch leaves with [DONE]
                yield b"".join(parts)
                parts = []
    except EngineFailed as err:
        parts.append(failed(generation.id, err))
    parts.append(DONE)
    yield b"".join(parts)


def failed(request_id: str, err: EngineFailed) -> bytes:
    """The error event of a stream the engine failed mid-way (logged)."""
    log.warning("request %s failed mid-stream: %s", request_id, err)
    return event(envelope(str(err), SERVER))


class EventStream(StreamingResponse):
    """An SSE response that cancels its engine request however it ends (client gone, error, shutdown)."""

    generation: Generation | Choices  # a request's choices, streamed as one (server/choices.py)

    def __init__(self, generation: Generation, shaper: Shaper, include_usage: bool,
                 output: ChatOutput | None = None) -> None:
        super().__init__(chunks(generation, shaper, include_usage, output), media_type="text/event-stream",
                         headers=HEADERS)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the stream; whatever stops it, tell the engine the request is no longer wanted."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.generation.finished:
                log.info("request %s abandoned by its client; cancelling", self.generation.id)
            self.generation.abandon()
