"""A chat reply's text turned into what the client reads: visible content, reasoning and tool calls, whole or as
stream deltas. The family's ChatFormat splits free text (chat/reply.py); a forced call (tool_choice required or
named) is JSON written under a grammar and read back here."""

from __future__ import annotations

from collections.abc import Sequence

from tensorfold.chat.api import ChatFormat, ContentDelta, Delta, ReplyParts, ToolCallDelta
from tensorfold.chat.reply import ReplySplitter
from tensorfold.server.params import Generate
from tensorfold.server.tooling import AUTO, ToolChoice, forced_calls
from tensorfold.service import Service


class ChatOutput:
    """One chat request's reply parts: fed its text as it arrives, then finished."""

    def __init__(self, format: ChatFormat | None, tools: Sequence[dict], choice: ToolChoice,
                 reasoning_open: bool) -> None:
        self.choice = choice
        self._held: list[str] = []  # a forced call's JSON, read whole at the end
        self._calls = 0
        parse_tools = list(tools) if tools and choice.mode == AUTO else None
        plain = format is None or (parse_tools is None and format.think_start is None and format.think_end is None)
        self._splitter = None if plain or choice.forced else ReplySplitter(format, parse_tools, reasoning_open)

    def push(self, text: str) -> list[Delta]:
        """The deltas new text makes (none while a forced call is being written)."""
        if self.choice.forced:
            self._held.append(text)
            return []
        if self._splitter is None:
            return [ContentDelta(text)] if text else []
        return self._one_call(self._splitter.push(text))

    def finish(self) -> list[Delta]:
        """What was held back; a forced call's calls, one delta each with its whole arguments."""
        if self.choice.forced:
            calls = forced_calls("".join(self._held), self.choice)
            if not calls:  # not the JSON asked for (cut by max_tokens): the text is the content
                return [ContentDelta("".join(self._held))] if self._held else []
            self._calls = len(calls)
            return [ToolCallDelta(i, call.id, call.name, call.arguments) for i, call in enumerate(calls)]
        if self._splitter is None:
            return []
        return self._one_call(self._splitter.finish())

    def whole(self, text: str) -> ReplyParts:
        """A finished reply's parts, for a non-streamed answer."""
        if self.choice.forced:
            calls = forced_calls(text, self.choice)
            self._calls = len(calls)
            return ReplyParts("" if calls else text, None, calls)
        if self._splitter is None:
            return ReplyParts(text)
        parts = self._splitter.split_whole(text)
        calls = parts.tool_calls if self.choice.parallel else parts.tool_calls[:1]
        self._calls = len(calls)
        return ReplyParts(parts.content, parts.reasoning, calls)

    @property
    def called(self) -> bool:
        """Whether the reply holds a tool call (its finish reason is then tool_calls)."""
        return self._calls > 0

    def _one_call(self, deltas: list[Delta]) -> list[Delta]:
        """Without parallel calls, the deltas of any call after the first are dropped."""
        kept = []
        for delta in deltas:
            if isinstance(delta, ToolCallDelta):
                if delta.index > 0 and not self.choice.parallel:
                    continue
                self._calls = max(self._calls, delta.index + 1)
            kept.append(delta)
        return kept


def finish_reason(engine_reason: str, output: ChatOutput | None) -> str:
    """OpenAI's finish reason: tool_calls when a reply that ended by itself holds calls."""
    if output is not None and output.called and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def chat_output(service: Service, params: Generate) -> ChatOutput | None:
    """The splitter a chat reply needs: None when its text is all content (no tools to parse, none forced, and a
    family that does not reason in text)."""
    format = service.chat_format
    reasons = format is not None and (format.think_start is not None or format.think_end is not None)
    parses = bool(params.tools) and params.tool_choice.mode == AUTO
    if not (reasons or parses or params.tool_choice.forced):
        return None
    return ChatOutput(format, params.tools, params.tool_choice, params.reasoning_open)
