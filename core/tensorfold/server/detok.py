"""Token ids to text as they arrive: whole characters only, stop strings cut, nothing sent that a stop might eat.

Each token costs a decode of a few recent ids, not of the whole completion (HF's and vLLM's incremental
detokenizer): the ids before `read` decoded to whole characters, so the new text is what the window
ids[prefix:] decodes to past what ids[prefix:read] decodes to. The window starts one whole-character segment back,
so a decoder that treats a sequence's first token apart (a leading space dropped) treats both decodes alike. For
decoders that decode a sequence as the concatenation of its pieces at whole-character boundaries (byte-level BPE:
the lossy UTF-8 of its tokens' bytes) this equals decoding every id each time, character for character. The
window grows only while its text ends in U+FFFD (an unfinished character, or bytes that are no character).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that do not (yet) form a whole UTF-8 character
WINDOW = 8  # ids that decode to no text (skipped special tokens) the window keeps before it lets its context go


class Window:
    """A completion's ids and the text they decode to, found a few ids at a time."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self._prefix = 0       # the window's first id: the start of the last whole-character segment
        self._read = 0         # ids before it are text already given out as whole characters
        self._prefix_len = 0   # characters ids[prefix:read] decode to
        self._given = 0        # characters of the tail (ids[read:]'s text) already given out

    def push(self, token_id: int) -> str:
        """Take one id; return the whole characters it completed (U+FFFD at the end is held: it may be a
        character's first bytes)."""
        self.ids.append(token_id)
        tail = self.decode(self.ids[self._prefix:])[self._prefix_len:]
        stable = tail.rstrip(REPLACEMENT)
        new = stable[self._given:] if len(stable) > self._given else ""
        self._given = max(self._given, len(stable))
        if not tail.endswith(REPLACEMENT):  # ids[read:] ended on a character boundary: the window moves up
            if tail or len(self.ids) - self._prefix > WINDOW:
                self._prefix = self._read
            self._read = len(self.ids)
            self._prefix_len = len(self.decode(self.ids[self._prefix:self._read]))
            self._given = 0
        return new

    def rest(self) -> str:
        """The text not given out yet, as decoded (an unfinished character as U+FFFD)."""
        tail = self.decode(self.ids[self._prefix:])[self._prefix_len:]
        return tail[self._given:] if len(tail) > self._given else ""


class StopText:
    """The completion's text so far; `push` returns what may be sent now, `finish` what is left at the end."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = (),
                 include: bool = False) -> None:
        self.window = Window(decode)
        self.stops = tuple(s for s in stops if s)
        self.include = include  # the text ends after the stop string, not before it (include_stop_str_in_output)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.held = ""  # decoded and final text not sent yet: a tail that could still grow into a stop string
        self.stopped = False  # a stop string was seen; the text ends at it and later tokens are ignored

    @property
    def ids(self) -> list[int]:
        """The completion's ids (up to the token that completed a stop string, once one did)."""
        return self.window.ids

    def push(self, token_id: int) -> str:
        """Take one token; return the new text that is safe to send (may be empty)."""
        if self.stopped:
            return ""
        self._extend(self.window.push(token_id))
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """The request ended: return everything held back (an incomplete character included, as decoded)."""
        if not self.stopped:
            self._extend(self.window.rest())
        return self._take(final=True)

    def _extend(self, new: str) -> None:
        """Add newly decoded text, cutting it at the first stop string it completes. A stop can only begin in the
        held text or the new text: one that began in text already sent would have held that text back."""
        if not new:
            return
        start = max(0, len(self.held) - self.longest + 1)
        self.held += new
        found = self._first_stop(start)
        if found is not None:
            cut, stop = found
            self.held = self.held[:cut + len(stop)] if self.include else self.held[:cut]
            self.stopped = True

    def _first_stop(self, start: int) -> tuple[int, str] | None:
        """The earliest stop string at or after `start` in the held text (the shortest of those starting there),
        with where it begins; None when there is none."""
        found = [(i, len(s), s) for s, i in ((s, self.held.find(s, start)) for s in self.stops) if i >= 0]
        if not found:
            return None
        index, _, stop = min(found)
        return index, stop

    def _take(self, final: bool) -> str:
        """Hand out the held text up to the part that could still grow into a stop string."""
        end = len(self.held) if final else len(self.held) - self._could_stop()
        piece, self.held = self.held[:end], self.held[end:]
        return piece

    def _could_stop(self) -> int:
        """Length of the longest tail of the held text that is a proper prefix of some stop string."""
        for k in range(min(self.longest - 1, len(self.held)), 0, -1):
            tail = self.held[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
