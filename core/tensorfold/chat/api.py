"""The reply's parts as the server hands them out, and the parser interface a family declares (docs/hooks.md).

A family's `family_chat_format` hook answers a ChatFormat: its think markers and a ToolParser. The server runs
every reply's text through a ReplySplitter built from it (chat/reply.py): reasoning first (between the markers),
then tool calls out of what is left, streamed as deltas or split whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

Tools = Sequence[Mapping[str, Any]]   # the request's `tools`, OpenAI's shape: {"type": "function", "function": {...}}


@attrs.frozen
class ToolCall:
    """One call the model made: OpenAI's `tool_calls[i]` (arguments as JSON text, as OpenAI sends them)."""

    id: str
    name: str
    arguments: str


@attrs.frozen
class ReplyParts:
    """A finished reply split: the visible text, the reasoning (None when there was none) and the calls."""

    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@attrs.frozen
class ContentDelta:
    """Visible text that may be sent now."""

    text: str


@attrs.frozen
class ReasoningDelta:
    """Reasoning text that may be sent now."""

    text: str


@attrs.frozen
class ToolCallDelta:
    """A piece of tool call `index`: its first delta carries `id` and `name`, later ones argument text; the
    arguments of one call, concatenated over its deltas, are the call's JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Delta = ContentDelta | ReasoningDelta | ToolCallDelta


@runtime_checkable
class ToolCallStream(Protocol):
    """One reply's incremental tool-call parser: text in (after reasoning was taken out), deltas out."""

    def push(self, text: str) -> list[ContentDelta | ToolCallDelta]:
        """Deltas for new text; text that may still turn out to be a call is held back."""
        ...

    def finish(self) -> list[ContentDelta | ToolCallDelta]:
        """Whatever was held back, at the end of the reply (an unfinished call is content)."""
        ...


@runtime_checkable
class ToolParser(Protocol):
    """A family's tool-call format: how a call looks in generated text, whole and streamed."""

    name: str

    def parse(self, text: str, tools: Tools = ()) -> tuple[str, tuple[ToolCall, ...]]:
        """The content left and the calls found in a finished reply's text; `tools` (the request's) type the
        arguments of formats that write values as bare text."""
        ...

    def stream(self, tools: Tools = ()) -> ToolCallStream:
        """A fresh incremental parser for one reply, typing arguments by `tools` as `parse` does."""
        ...


@attrs.frozen
class ChatFormat:
    """A family's chat conventions the server needs beyond the template: think markers and its tool parser."""

    tool_parser: ToolParser
    think_start: str | None = None   # e.g. "<think>"; None: the family does not reason in text
    think_end: str | None = None     # e.g. "</think>"

    def problems(self) -> list[str]:
        """What is wrong with this declaration, as sentences (empty when the server can use it)."""
        found = []
        parser = self.tool_parser
        if not isinstance(parser, ToolParser):
            found.append(f"tool_parser {type(parser).__name__} lacks name, parse(text, tools) or stream(tools)")
        elif not isinstance(parser.name, str) or not parser.name:
            found.append(f"tool_parser.name must be a non-empty string, got {parser.name!r}")
        markers = (self.think_start, self.think_end)
        if (markers[0] is None) != (markers[1] is None):
            found.append(f"think_start and think_end must both be set or both be None, got {markers!r}")
        elif markers[0] is not None and not all(isinstance(m, str) and m.strip() for m in markers):
            found.append(f"think markers must be non-blank strings, got {markers!r}")
        elif markers[0] is not None and markers[0] == markers[1]:
            found.append(f"think_start and think_end must differ, got {markers!r}")
        return found
