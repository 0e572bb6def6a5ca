"""The JSON objects OpenAI's clients parse: completions, chat completions, and their stream chunks."""

from __future__ import annotations

import time
from typing import Any

from tensorfold.server.generation import Usage

CHAT = "chat"
TEXT = "text"


class Shaper:
    """Builds one request's response objects, chat or text, with a shared id, model and creation time."""

    def __init__(self, kind: str, id: str, model: str, return_token_ids: bool) -> None:
        self.kind = kind
        self.id = id
        self.model = model
        self.return_token_ids = return_token_ids
        self.created = int(time.time())

    def _head(self, object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def response(self, text: str, finish_reason: str, usage: Usage, prompt: list[int],
                 token_ids: list[int]) -> dict[str, Any]:
        """The whole answer of a non-streamed request."""
        if self.kind == CHAT:
            body = self._head("chat.completion")
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
            body["prompt_token_ids"] = prompt
        body["choices"] = [choice]
        body["usage"] = usage.to_json()
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, token_ids: tuple[int, ...] = (),
              role: bool = False, prompt: list[int] | None = None) -> dict[str, Any]:
        """One stream chunk: new text (or none), and on the last one the finish reason."""
        if self.kind == CHAT:
            body = self._head("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if prompt is not None:
                body["prompt_token_ids"] = prompt
        body["choices"] = [choice]
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The chunk stream_options.include_usage asks for: no choices, only usage."""
        body = self._head("chat.completion.chunk" if self.kind == CHAT else "text_completion")
        body["choices"] = []
        body["usage"] = usage.to_json()
        return body
