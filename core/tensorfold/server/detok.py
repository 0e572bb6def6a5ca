"""Token ids to text as they arrive: whole characters only, stop strings cut, nothing sent that a stop might eat."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that do not (yet) form a whole UTF-8 character


class StopText:
    """The completion's text so far; `push` returns what may be sent now, `finish` what is left at the end."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""  # decoded and final (cut at a stop string once one is seen)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False  # a stop string was seen; later tokens are ignored

    def push(self, token_id: int) -> str:
        """Take one token; return the new text that is safe to send (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        full = self.decode(self.ids)
        self._advance(full.rstrip(REPLACEMENT))
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """The request ended: return everything held back (an incomplete character included, as decoded)."""
        if not self.stopped:
            self._advance(self.decode(self.ids))
        return self._take(final=True)

    def _advance(self, stable: str) -> None:
        """Adopt a longer decode, cutting it at the first stop string that it completes."""
        if len(stable) <= len(self.text):
            return
        start = max(0, len(self.text) - self.longest + 1)
        self.text = stable
        cut = self._first_stop(start)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True

    def _first_stop(self, start: int) -> int | None:
        """Where the earliest stop string begins at or after `start`, if any."""
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _take(self, final: bool) -> str:
        """Hand out text up to the part that could still grow into a stop string."""
        end = len(self.text) if final else len(self.text) - self._held()
        end = max(end, self.sent)
        piece = self.text[self.sent:end]
        self.sent = end
        return piece

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        for k in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
