"""Anthropic's Messages answer: the message object, and the same message as Anthropic's named SSE events
(message_start, content_block_start / _delta / _stop per block, message_delta, message_stop), so a client's
stream accumulator ends with the message a non-streamed request returns."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.responses import StreamingResponse

from tensorfold.chat.api import ContentDelta, Delta, ReasoningDelta, ReplyParts, ToolCall, ToolCallDelta
from tensorfold.server.generation import EngineFailed, Finish, Generation, Usage
from tensorfold.server.replies import ChatOutput
from tensorfold.server.sse import HEADERS, EventStream, event

log = logging.getLogger(__name__)
API_ERROR = "api_error"
STOP_REASONS = {"length": "max_tokens"}  # the engine's finish reason → Anthropic's (stop → end_turn, see below)


def error_body(message: str, type: str) -> dict[str, Any]:
    """Anthropic's error envelope."""
    return {"type": "error", "error": {"type": type, "message": message}}


def usage_json(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens prefilled, the ones resumed from a kept state are
    cache reads (the three add up to the prompt); nothing is billed as a cache write."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def message_head(id: str, model: str) -> dict[str, Any]:
    """A message with nothing in it yet: what message_start carries, and what the answer fills in."""
    return {"id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None}


def matched_stop(stops: Sequence[str], ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> str | None:
    """The stop sequence that ended a reply: the earliest (then shortest) in its text, as the stop-string
    decoder cuts at it; the ids run up to the token that completed it."""
    text = decode(list(ids))
    found = [(at, len(stop), stop) for stop in stops if (at := text.find(stop)) >= 0]
    return min(found)[2] if found else None


class Ending:
    """Why a reply stopped, in Anthropic's words."""

    def __init__(self, generation: Generation, output: ChatOutput | None,
                 decode: Callable[[Sequence[int]], str]) -> None:
        self.generation = generation
        self.output = output
        self.decode = decode

    def of(self, finish: Finish) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): tool_use when a reply that ended by itself holds calls, stop_sequence
        when a stop string cut it, max_tokens at the length limit, else end_turn."""
        if finish.finish_reason in STOP_REASONS:
            return STOP_REASONS[finish.finish_reason], None
        if self.output is not None and self.output.called:
            return "tool_use", None
        if self.generation.text.stopped:
            return "stop_sequence", matched_stop(self.generation.params.stop, self.generation.token_ids, self.decode)
        return "end_turn", None


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as the tool_use block's input object ({} when the model wrote no object)."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        log.warning("tool call %s (%s) has arguments that are not JSON: %.200r", call.id, call.name,
                    call.arguments)
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(parts: ReplyParts) -> list[dict[str, Any]]:
    """A finished reply's content: thinking, then text, then one tool_use block per call (empty parts left out,
    as a stream sends no block for them)."""
    blocks: list[dict[str, Any]] = []
    if parts.reasoning:
        blocks.append({"type": "thinking", "thinking": parts.reasoning, "signature": ""})
    if parts.content:
        blocks.append({"type": "text", "text": parts.content, "citations": None})
    blocks += [{"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call)}
               for call in parts.tool_calls]
    return blocks


def message_body(id: str, model: str, parts: ReplyParts, reason: tuple[str, str | None],
                 usage: Usage) -> dict[str, Any]:
    """The whole answer of a non-streamed request."""
    return {**message_head(id, model), "content": content_blocks(parts), "stop_reason": reason[0],
            "stop_sequence": reason[1], "usage": usage_json(usage)}


def named(name: str, payload: dict[str, Any]) -> bytes:
    """One Anthropic SSE event: its name on the `event:` line, the JSON (with the same `type`) on `data:`."""
    return b"event: " + name.encode() + b"\n" + event({"type": name, **payload})


class Blocks:
    """The stream's content blocks: a delta of another kind (or another call) closes the open block and opens the
    next, so each block's start, deltas and stop come in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: tuple[str, int] | None = None  # (kind, tool call index) of the open block

    def feed(self, deltas: Sequence[Delta]) -> list[bytes]:
        """The events for reply parts (none for empty text)."""
        out: list[bytes] = []
        for delta in deltas:
            if isinstance(delta, ToolCallDelta):
                if self.open != ("tool_use", delta.index):
                    out += self._start(("tool_use", delta.index),
                                       {"type": "tool_use", "id": delta.id or "", "name": delta.name or "",
                                        "input": {}})
                if delta.arguments:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": delta.arguments}))
            elif delta.text:
                if isinstance(delta, ReasoningDelta):
                    if self.open != ("thinking", 0):
                        out += self._start(("thinking", 0), {"type": "thinking", "thinking": "", "signature": ""})
                    out.append(self._delta({"type": "thinking_delta", "thinking": delta.text}))
                else:
                    if self.open != ("text", 0):
                        out += self._start(("text", 0), {"type": "text", "text": "", "citations": None})
                    out.append(self._delta({"type": "text_delta", "text": delta.text}))
        return out

    def close(self) -> list[bytes]:
        """content_block_stop for the open block, if one is."""
        if self.open is None:
            return []
        self.open = None
        return [named("content_block_stop", {"index": self.index})]

    def _start(self, kind: tuple[str, int], block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        return [*out, named("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named("content_block_delta", {"index": self.index, "delta": delta})


async def message_events(generation: Generation, output: ChatOutput | None, id: str,
                         ending: Ending) -> AsyncIterator[bytes]:
    """The stream body: message_start (the prompt's tokens as input until the engine tells how many it resumed),
    a ping, the blocks, then message_delta with the stop reason and the final usage, and message_stop. The events
    of one wake-up go out as one body write; an engine failure mid-stream is an `error` event."""
    head = message_head(id, generation.params.model)
    start = Usage(len(generation.params.prompt), 0, 0)
    parts = [named("message_start", {"message": {**head, "usage": usage_json(start)}}), named("ping", {})]
    blocks = Blocks()
    try:
        async for batch in generation.batches():
            for item in batch:
                if isinstance(item, Finish):
                    parts += blocks.feed(output.finish() if output is not None else [])
                    parts += blocks.close()
                    reason, sequence = ending.of(item)
                    parts.append(named("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                         "usage": usage_json(item.usage)}))
                    parts.append(named("message_stop", {}))
                else:
                    parts += blocks.feed(output.push(item.text) if output is not None else [ContentDelta(item.text)])
            if parts and not generation.finished:
                yield b"".join(parts)
                parts = []
    except EngineFailed as err:
        log.warning("request %s failed mid-stream: %s", generation.id, err)
        parts.append(named("error", {"error": {"type": API_ERROR, "message": str(err)}}))
    yield b"".join(parts)


class MessageStream(EventStream):
    """Anthropic's SSE answer; as EventStream, it cancels the engine's request however the stream ends."""

    def __init__(self, generation: Generation, body: AsyncIterator[bytes]) -> None:
        StreamingResponse.__init__(self, body, media_type="text/event-stream", headers=HEADERS)
        self.generation = generation
