"""A reply's text as the server hands it out: reasoning first (the family's think markers), then tool calls out of
what is left, streamed as deltas or split whole. Built per request from the family's ChatFormat."""

from __future__ import annotations

from collections.abc import Sequence

from tensorfold.chat.api import ChatFormat, ContentDelta, Delta, ReasoningDelta, ReplyParts, ToolCallStream, Tools
from tensorfold.chat.reasoning import ReasoningSplitter, split_reasoning


class ReplySplitter:
    """One reply's text split into content, reasoning and tool calls, streamed (`push`, `finish`) or whole.

    `tools` are the request's (None or empty: no call is looked for); `starts_open` says the prompt left the reply
    inside reasoning (the server reads it off the rendered prompt's end). Calls are looked for outside reasoning
    only."""

    def __init__(self, format: ChatFormat, tools: Tools | None, starts_open: bool) -> None:
        self.format = format
        self.tools: Tools = tuple(tools or ())
        self.starts_open = starts_open
        self.reasoning = ReasoningSplitter(format.think_start, format.think_end, starts_open)
        self.calls: ToolCallStream | None = format.tool_parser.stream(self.tools) if self.tools else None

    def push(self, text: str) -> list[Delta]:
        """Deltas for new text; what may still be a marker or a call is held back."""
        return self._route(self.reasoning.push(text), final=False)

    def finish(self) -> list[Delta]:
        """Whatever was held back, at the end of the reply (an unfinished call is content)."""
        return self._route(self.reasoning.finish(), final=True)

    def split_whole(self, text: str) -> ReplyParts:
        """A finished reply's parts at once (a non-streamed response), independent of this splitter's stream."""
        reasoning, rest = split_reasoning(text, self.format.think_start, self.format.think_end, self.starts_open)
        if not self.tools:
            return ReplyParts(content=rest, reasoning=reasoning)
        content, calls = self.format.tool_parser.parse(rest, self.tools)
        return ReplyParts(content=content, reasoning=reasoning, tool_calls=calls)

    def _route(self, deltas: Sequence[ContentDelta | ReasoningDelta], final: bool) -> list[Delta]:
        """Content goes through the call parser; reasoning passes; neighbours of one kind are merged."""
        out: list[Delta] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta) and self.calls is not None:
                out += self.calls.push(delta.text)
            else:
                out.append(delta)
        if final and self.calls is not None:
            out += self.calls.finish()
        return merged(out)


def merged(deltas: Sequence[Delta]) -> list[Delta]:
    """Adjacent content (or reasoning) deltas as one, so a push makes as few chunks as it can."""
    out: list[Delta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if isinstance(delta, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + delta.text)
        elif isinstance(delta, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + delta.text)
        else:
            out.append(delta)
    return out
