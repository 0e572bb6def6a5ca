"""The JSON objects OpenAI's clients parse: completions, chat completions, and their stream chunks."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

from tensorfold.chat.api import ContentDelta, Delta, ReasoningDelta, ReplyParts, ToolCall, ToolCallDelta
from tensorfold.server.generation import Usage
from tensorfold.server.logprobs import Entry, TokenText, chat_logprobs, text_logprobs

CHAT = "chat"
TEXT = "text"


class Shaper:
    """Builds one request's response objects, chat or text, with a shared id, model and creation time."""

    def __init__(self, kind: str, id: str, model: str, return_token_ids: bool,
                 token_text: TokenText | None = None, decoded: TokenText | None = None) -> None:
        self.kind = kind
        self.id = id
        self.model = model
        self.return_token_ids = return_token_ids
        self.token_text = token_text  # set when the request asked for logprobs: each token's own text
        self.decoded = decoded or token_text or str  # each token's text, for vLLM's prompt_logprobs
        self.created = int(time.time())
        self.index = 0    # the choice these objects are for (several with `n`: server/choices.py)
        self._offset = 0  # characters of completion text streamed so far (completions' text_offset)

    def for_choice(self, index: int) -> Shaper:
        """A shaper for choice `index` of the same request: its id, model and creation time, its own offsets."""
        other = copy.copy(self)
        other.index, other._offset = index, 0
        return other

    def logprobs(self, entries: Sequence[Entry]) -> dict[str, Any] | None:
        """A choice's `logprobs` for these tokens (None when the request asked for none)."""
        if self.token_text is None:
            return None
        if self.kind == CHAT:
            return chat_logprobs(entries, self.token_text)
        found = text_logprobs(entries, self.token_text, self._offset)
        self._offset = found["text_offset"][-1] + len(found["tokens"][-1]) if entries else self._offset
        return found

    def _head(self, object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def response(self, text: str, finish_reason: str, usage: Usage, prompt: list[int],
                 token_ids: list[int], parts: ReplyParts | None = None,
                 entries: Sequence[Entry] = ()) -> dict[str, Any]:
        """The whole answer of a non-streamed request (a chat's `parts` when its text was split)."""
        if self.kind == CHAT:
            body = self._head("chat.completion")
            choice: dict[str, Any] = {"index": self.index, "message": message(parts or ReplyParts(text)),
                                      "logprobs": self.logprobs(entries), "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": self.index, "text": text, "logprobs": self.logprobs(entries),
                      "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
            body["prompt_token_ids"] = prompt
        body["choices"] = [choice]
        body["usage"] = usage.to_json()
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, token_ids: tuple[int, ...] = (),
              role: bool = False, prompt: list[int] | None = None, entries: Sequence[Entry] = ()) -> dict[str, Any]:
        """One stream chunk: new text (or none), and on the last one the finish reason."""
        logprobs = self.logprobs(entries) if entries else None
        if self.kind == CHAT:
            body = self._head("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": self.index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if prompt is not None:
                body["prompt_token_ids"] = prompt
        body["choices"] = [choice]
        return body

    def delta_chunk(self, delta: Delta, entries: Sequence[Entry] = ()) -> dict[str, Any]:
        """A chat stream chunk for one reply part: content, reasoning, or a piece of a tool call."""
        body = self._head("chat.completion.chunk")
        body["choices"] = [{"index": self.index, "delta": delta_json(delta),
                            "logprobs": self.logprobs(entries) if entries else None, "finish_reason": None}]
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The chunk stream_options.include_usage asks for: no choices, only usage."""
        body = self._head("chat.completion.chunk" if self.kind == CHAT else "text_completion")
        body["choices"] = []
        body["usage"] = usage.to_json()
        return body


def message(parts: ReplyParts) -> dict[str, Any]:
    """The chat answer's message: content (null when only calls were made), reasoning under vLLM's two names, and
    tool_calls when there are any."""
    out: dict[str, Any] = {"role": "assistant", "content": parts.content if parts.content or not parts.tool_calls
                           else None}
    if parts.reasoning is not None:
        out["reasoning_content"] = out["reasoning"] = parts.reasoning
    if parts.tool_calls:
        out["tool_calls"] = [call_json(call) for call in parts.tool_calls]
    return out


def call_json(call: ToolCall) -> dict[str, Any]:
    """One of OpenAI's message.tool_calls."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def delta_json(delta: Delta) -> dict[str, Any]:
    """OpenAI's stream delta for one reply part."""
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    if isinstance(delta, ReasoningDelta):
        return {"reasoning_content": delta.text, "reasoning": delta.text}
    assert isinstance(delta, ToolCallDelta)
    call: dict[str, Any] = {"index": delta.index}
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.id is not None:
        call |= {"id": delta.id, "type": "function"}
    if delta.name is not None:
        function = {"name": delta.name, **function}
    call["function"] = function
    return {"tool_calls": [call]}
