"""The engine under every built-in tool parser: calls are blocks between a start and an end marker, found in a
stream of text whatever its chunking, with the text around them left as content.

A format is one or more `Syntax`es (markers and a body decoder). `BlockStream` holds back only what may still
turn out to be a call — a partial start marker, the whitespace before one, an open block — and decides only on
whole markers, so every split of a text gives the same deltas, concatenated; `BlockParser.parse` is one stream
fed the whole text, which makes that the definition of the whole parse.

Conventions (docs/hooks.md): whitespace touching a call is the template's and is dropped; text left on both
sides of a call is joined by a blank line; a block whose body does not decode stays content, as written.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from tensorfold.chat.api import ContentDelta, ToolCall, ToolCallDelta, Tools

SEPARATOR = "\n\n"          # between content before a call and content after it
Schemas = Mapping[str, Mapping[str, Any]]       # function name -> its parameters' `properties`
Decoded = list[tuple[str, str]]                 # (name, arguments as JSON text) per call in a block
Decoder = Callable[[str, Schemas], Decoded | None]


def never_open(body: str) -> bool:
    """The default `Syntax.open`: an end marker always ends the block."""
    return False


@attrs.frozen
class Syntax:
    """One way a call is written: `start` BODY `end`. `decode` turns the body into calls (None: malformed, the
    block stays content); `open(body)` says an end marker met here sits inside a value (a string, a parameter),
    so the block goes on to the next one."""

    start: str
    end: str
    decode: Decoder
    open: Callable[[str], bool] = never_open


def new_call_id() -> str:
    """A fresh OpenAI-style call id: `call_` and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def schemas_of(tools: Tools) -> dict[str, Mapping[str, Any]]:
    """Each function's parameter schemas by name, from the request's tools (OpenAI's shape, or bare functions)."""
    found: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        found[function["name"]] = properties if isinstance(properties, Mapping) else {}
    return found


def partial_at_end(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins one of the markers (a marker maybe arriving)."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


class BlockStream:
    """One reply's tool calls, found incrementally (a `ToolCallStream`)."""

    def __init__(self, syntaxes: Sequence[Syntax], schemas: Schemas) -> None:
        self.syntaxes = tuple(syntaxes)
        self.schemas = schemas
        self.buffer = ""                   # outside: undecided text; inside: the block's body so far
        self.inside: Syntax | None = None
        self.gap = ""                      # the whitespace dropped before the open block (restored if malformed)
        self.searched = 0                  # inside: the body before this holds no end marker worth trying
        self.after_call = False            # the last thing out was a call: drop leading whitespace, then separate
        self.said = False                  # some content went out
        self.calls = 0

    def push(self, text: str) -> list[ContentDelta | ToolCallDelta]:
        """Deltas for new text; text that may still turn out to be a call is held back."""
        out: list[ContentDelta | ToolCallDelta] = []
        self.buffer += text
        self._drain(out, final=False)
        return out

    def finish(self) -> list[ContentDelta | ToolCallDelta]:
        """Whatever was held back, at the end of the reply (an unfinished call is content)."""
        out: list[ContentDelta | ToolCallDelta] = []
        self._drain(out, final=True)
        return out

    def _drain(self, out: list, final: bool) -> None:
        """Step until nothing more can be decided (or, when final, until everything went out)."""
        while self._outside(out, final) if self.inside is None else self._in_block(out, final):
            pass

    def _outside(self, out: list, final: bool) -> bool:
        """Look for a start marker; emit what cannot be part of one. True when a block opened."""
        found = [(at, s) for s in self.syntaxes if (at := self.buffer.find(s.start)) != -1]
        if found:
            at, syntax = min(found, key=lambda pair: pair[0])
            self.gap = self._content(self.buffer[:at], out, before_call=True)
            self.inside, self.buffer, self.searched = syntax, self.buffer[at + len(syntax.start):], 0
            return True
        if final:
            self._content(self.buffer, out)
            self.buffer = ""
            return False
        cut = len(self.buffer) - partial_at_end(self.buffer, [s.start for s in self.syntaxes])
        while cut > 0 and self.buffer[cut - 1].isspace():
            cut -= 1
        self._content(self.buffer[:cut], out)
        self.buffer = self.buffer[cut:]
        return False

    def _in_block(self, out: list, final: bool) -> bool:
        """Try each end marker in the body in turn. True when the block closed (as calls or as content)."""
        syntax = self.inside
        assert syntax is not None
        at = self.buffer.find(syntax.end, self.searched)
        while at != -1:
            body = self.buffer[:at]
            decoded = syntax.decode(body, self.schemas)
            last = body.rfind(syntax.start) if decoded is None else -1
            if last != -1 and syntax.decode(body[last + len(syntax.start):], self.schemas) is not None:
                # an unclosed block, then a whole one: the first is content
                self.gap = self._content(self.gap + syntax.start + body[:last], out, before_call=True)
                self.buffer, at = self.buffer[last + len(syntax.start):], at - last - len(syntax.start)
                continue
            if decoded is None and syntax.open(body):            # the end marker is inside a value
                at = self.buffer.find(syntax.end, at + 1)
                continue
            if decoded is not None:
                self._calls(decoded, out)
            else:
                self._content(self.gap + syntax.start + body + syntax.end, out)
            self.inside, self.gap, self.buffer = None, "", self.buffer[at + len(syntax.end):]
            return True
        if final:
            self._content(self.gap + syntax.start + self.buffer, out)
            self.inside, self.gap, self.buffer = None, "", ""
            return False
        self.searched = max(0, len(self.buffer) - len(syntax.end) + 1)
        return False

    def _calls(self, decoded: Decoded, out: list) -> None:
        """One delta per call, whole: id, name and arguments (a call is sent once its block closed)."""
        for name, arguments in decoded:
            out.append(ToolCallDelta(index=self.calls, id=new_call_id(), name=name, arguments=arguments))
            self.calls += 1
        self.after_call = True

    def _content(self, text: str, out: list, before_call: bool = False) -> str:
        """Emit content by the whitespace conventions; return the whitespace dropped before a call."""
        dropped = ""
        if before_call:
            kept = text.rstrip()
            text, dropped = kept, text[len(kept):]
        if self.after_call:
            text = text.lstrip()
            if not text:
                return dropped
            if self.said:
                text = SEPARATOR + text
            self.after_call = False
        if text:
            out.append(ContentDelta(text))
            self.said = True
        return dropped


class BlockParser:
    """A `ToolParser` made of syntaxes: `stream` runs a BlockStream, `parse` runs one over the whole text."""

    def __init__(self, name: str, syntaxes: Sequence[Syntax]) -> None:
        self.name = name
        self.syntaxes = tuple(syntaxes)

    def __repr__(self) -> str:
        return f"<tool parser {self.name}>"

    def stream(self, tools: Tools = ()) -> BlockStream:
        """A fresh incremental parser for one reply, typing arguments by `tools`."""
        return BlockStream(self.syntaxes, schemas_of(tools))

    def parse(self, text: str, tools: Tools = ()) -> tuple[str, tuple[ToolCall, ...]]:
        """The content left and the calls found in a finished reply's text."""
        stream = self.stream(tools)
        return collect(stream.push(text) + stream.finish())


def collect(deltas: Sequence[ContentDelta | ToolCallDelta]) -> tuple[str, tuple[ToolCall, ...]]:
    """A stream's deltas put back together: the content and the calls (the client's view of a stream)."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
            continue
        call = calls.setdefault(delta.index, ["", "", ""])
        call[0] = delta.id or call[0]
        call[1] = delta.name or call[1]
        call[2] += delta.arguments
    return "".join(content), tuple(ToolCall(id=i, name=n, arguments=a) for i, n, a in calls.values())
