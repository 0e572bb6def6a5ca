"""Reasoning out of a reply's text: what lies between the family's think markers, whole or streamed.

One reasoning block per reply, at its start, as the templates write it:

- `starts_open`: the prompt ended inside reasoning (Qwen3.5 and Nemotron-3 end it with `<think>\\n`, GLM-4.7 with
  `<think>`), so the reply is reasoning up to the end marker; a start marker the model writes again is skipped.
- otherwise a start marker at the reply's start (after whitespace, as GLM-4.6 writes `\\n<think>`) opens it; any
  other reply is content, where markers are not looked for again — except an end marker with no start marker
  before it, which the whole split reads as closing reasoning that began with the reply (vLLM's qwen3 and
  deepseek_r1 parsers do the same). A stream cannot take back the content it already sent, so there the marker
  is only dropped: the one place a stream and the whole split differ.
- No end marker: the rest of the reply is reasoning (it was cut short).

Newlines are the templates' own convention around markers (`<think>\\nR\\n</think>\\n\\nC`): those at both ends of
the reasoning and at the start of the content after it are dropped. Empty reasoning counts as none.
"""

from __future__ import annotations

from tensorfold.chat.api import ContentDelta, ReasoningDelta
from tensorfold.chat.blocks import partial_at_end

LEAD, THINK, AFTER, CONTENT = "lead", "think", "after", "content"


class ReasoningSplitter:
    """One reply's reasoning and content, split incrementally; markers may arrive split across pushes."""

    def __init__(self, start: str | None, end: str | None, starts_open: bool) -> None:
        self.start, self.end = start, end
        self.state = CONTENT if start is None or end is None else (THINK if starts_open else LEAD)
        self.buffer = ""
        self.leading = True                   # THINK: no reasoning out yet, so newlines are still the marker's
        self.redundant_start = starts_open    # THINK: a start marker may still come first, and is skipped
        self.orphan_end = self.state == LEAD  # CONTENT: an end marker with no start is still looked for

    def push(self, text: str) -> list[ContentDelta | ReasoningDelta]:
        """Deltas for new text; a marker that may be arriving is held back."""
        out: list[ContentDelta | ReasoningDelta] = []
        self.buffer += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[ContentDelta | ReasoningDelta]:
        """Whatever was held back, at the end of the reply."""
        out: list[ContentDelta | ReasoningDelta] = []
        while self._step(out, final=True):
            pass
        return out

    def _step(self, out: list, final: bool) -> bool:
        """Advance over the buffer; True when the state changed and the buffer must be looked at again."""
        return getattr(self, f"_{self.state}")(out, final)

    def _lead(self, out: list, final: bool) -> bool:
        """Before anything: a start marker (after whitespace) opens reasoning, anything else is content."""
        assert self.start is not None
        text = self.buffer.lstrip()
        if text.startswith(self.start):
            self.buffer, self.state, self.orphan_end = text[len(self.start):], THINK, False
            return True
        if not final and self.start.startswith(text):
            return False                          # only whitespace, or the start marker arriving
        self.state = CONTENT
        return True

    def _think(self, out: list, final: bool) -> bool:
        """Inside reasoning: up to the end marker, holding back a marker arriving and the newlines before it."""
        assert self.start is not None and self.end is not None
        if self.redundant_start:
            text = self.buffer.lstrip()
            if text.startswith(self.start):
                self.buffer, self.redundant_start = text[len(self.start):], False
            elif final or not self.start.startswith(text):
                self.redundant_start = False
            else:
                return False
        at = self.buffer.find(self.end)
        if at != -1:
            self._reasoning(self.buffer[:at].rstrip("\n"), out)
            self.buffer, self.state = self.buffer[at + len(self.end):], AFTER
            return True
        cut = len(self.buffer) if final else len(self.buffer) - partial_at_end(self.buffer, [self.end])
        kept = self.buffer[:cut].rstrip("\n") if not final else self.buffer.rstrip("\n")
        self._reasoning(kept, out)
        self.buffer = "" if final else self.buffer[len(kept):]
        return False

    def _after(self, out: list, final: bool) -> bool:
        """Just after the end marker: its newlines go, then the rest is content."""
        text = self.buffer.lstrip("\n")
        if not text and not final:
            return False
        self.buffer, self.state = text, CONTENT
        return True

    def _content(self, out: list, final: bool) -> bool:
        """Content, passed through; until a start marker shows up, an end marker with no start is dropped."""
        cut = len(self.buffer)
        if self.orphan_end:
            assert self.start is not None and self.end is not None
            at, opened = self.buffer.find(self.end), self.buffer.find(self.start)
            if at != -1 and (opened == -1 or at < opened):
                self._say(self.buffer[:at], out)
                self.buffer, self.state, self.orphan_end = self.buffer[at + len(self.end):], AFTER, False
                return True
            if opened != -1:
                self.orphan_end = False           # a start marker in content: markers there are text
            elif not final:
                cut -= partial_at_end(self.buffer, [self.start, self.end])
        self._say(self.buffer[:cut], out)
        self.buffer = self.buffer[cut:]
        return False

    def _reasoning(self, text: str, out: list) -> None:
        """Reasoning out, less the newlines that follow the start marker."""
        if self.leading:
            text = text.lstrip("\n")
        if text:
            out.append(ReasoningDelta(text))
            self.leading = False

    @staticmethod
    def _say(text: str, out: list) -> None:
        """Content out, when there is any (no empty delta goes out)."""
        if text:
            out.append(ContentDelta(text))


def split_reasoning(text: str, start: str | None, end: str | None, starts_open: bool) -> tuple[str | None, str]:
    """A finished reply's reasoning (None when there was none) and the content after it."""
    if start is not None and end is not None and not starts_open and end in text \
            and start not in text[:text.find(end)]:
        starts_open = True                        # an end marker with no start: the reply began in reasoning
    splitter = ReasoningSplitter(start, end, starts_open)
    reasoning, content = [], []
    for delta in splitter.push(text) + splitter.finish():
        (reasoning if isinstance(delta, ReasoningDelta) else content).append(delta.text)
    return ("".join(reasoning) or None), "".join(content)
