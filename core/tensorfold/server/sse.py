"""Server-sent events: a generation as `data: {...}` chunks, then `data: [DONE]`; the engine freed if abandoned."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tensorfold.server.errors import SERVER, envelope
from tensorfold.server.generation import EngineFailed, Finish, Generation
from tensorfold.server.payloads import CHAT, Shaper

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


async def chunks(generation: Generation, shaper: Shaper, include_usage: bool) -> AsyncIterator[bytes]:
    """The stream body: a role chunk (chat), text chunks, the finish chunk, the usage chunk if asked, [DONE]. The
    events of one wake-up go out as one body write; the events themselves are one per Piece whatever the batching."""
    prompt: list[int] | None = list(generation.params.prompt)
    parts: list[bytes] = []
    if shaper.kind == CHAT:
        parts.append(event(shaper.chunk("", role=True, prompt=prompt)))
        prompt = None
    try:
        async for batch in generation.batches():
            for item in batch:
                if isinstance(item, Finish):
                    parts.append(event(shaper.chunk(None, item.finish_reason, prompt=prompt)))
                    if include_usage:
                        parts.append(event(shaper.usage_chunk(item.usage)))
                elif item.text or (shaper.return_token_ids and item.token_ids):
                    parts.append(event(shaper.chunk(item.text, token_ids=item.token_ids, prompt=prompt)))
                    prompt = None
            if parts and not generation.finished:  # the last batch leaves with [DONE]
                yield b"".join(parts)
                parts = []
    except EngineFailed as err:
        log.warning("request %s failed mid-stream: %s", generation.id, err)
        parts.append(event(envelope(str(err), SERVER)))
    parts.append(DONE)
    yield b"".join(parts)


class EventStream(StreamingResponse):
    """An SSE response that cancels its engine request however it ends (client gone, error, shutdown)."""

    def __init__(self, generation: Generation, shaper: Shaper, include_usage: bool) -> None:
        super().__init__(chunks(generation, shaper, include_usage), media_type="text/event-stream",
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
