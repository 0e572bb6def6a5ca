"""The stop-string decoder as it was before it became incremental: it decodes every id of the completion on every
token. Kept as the reference the incremental one must equal, output for output (test_server_detok_property.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class FullDecodeStopText:
    """The completion's text so far; `push` returns what may be sent now, `finish` what is left at the end."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token_id)
        full = self.decode(self.ids)
        self._advance(full.rstrip(REPLACEMENT))
        return self._take(final=self.stopped)

    def finish(self) -> str:
        if not self.stopped:
            self._advance(self.decode(self.ids))
        return self._take(final=True)

    def _advance(self, stable: str) -> None:
        if len(stable) <= len(self.text):
            return
        start = max(0, len(self.text) - self.longest + 1)
        self.text = stable
        cut = self._first_stop(start)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True

    def _first_stop(self, start: int) -> int | None:
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held()
        end = max(end, self.sent)
        piece = self.text[self.sent:end]
        self.sent = end
        return piece

    def _held(self) -> int:
        for k in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
