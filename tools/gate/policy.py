"""Where a cache-on server must resume each request: the keep policy written out again, independently of the
engine, so the gate checks the engine's rows instead of trusting them.

    starts       where messages[i] (1 ≤ i < n) and the generated turn begin in the prompt: the token count of
                 messages[:i] (and of all messages) rendered without the generation prompt, each used only when
                 those tokens are an exact prefix of the prompt's (what the server's request-starts finder does)
    cuts         from the previous cut p: min(length, p + grid, first start past p), up to the length
    marks        history end (the generated turn's start; the prompt end when unproven), system end (the start
                 of the first message that is not a system or developer message, when one precedes it) and rewind
                 (the start of the latest user message, when it is not the first message)
    keep points  for each mark: the last cut at or before it, when that cut lies past the row the pass resumed
                 at; the history end and the rewind mark always, the system end only when at least min_chunk
                 past the resumed row or on a cut another mark chose
    resume row   the longest kept state whose tokens the prompt extends, that leaves a row to prefill, and whose
                 cuts are the prompt's own cuts up to it; 0 when there is none

Tiers and eviction are not modelled: a scenario that pushes states out says so (`drop_all`), and the checks
refuse a scenario in which the last tier dropped states unless it expected that.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

SYSTEM_ROLES = {"system", "developer"}


def usable(length: int, starts: Iterable[int]) -> tuple[int, ...]:
    """Starts that can be cuts: inside (0, length), sorted, once each."""
    return tuple(sorted({s for s in starts if 0 < s < length}))


def cuts_of(length: int, starts: Iterable[int], grid: int, min_chunk: int) -> tuple[int, ...]:
    """Every cut of a cold pass over [0, length), `length` included."""
    found = usable(length, starts)
    cuts: list[int] = []
    p = 0
    while p < length:  # every start is a cut; min_chunk merges none (cuts.py)
        i = bisect_right(found, p)
        p = min(length, p + grid, found[i] if i < len(found) else length)
        cuts.append(p)
    return tuple(cuts)


@attrs.frozen
class Shape:
    """A rendered chat prompt and where its messages start (`None`: no proven start)."""

    prompt: tuple[int, ...]
    message_starts: tuple[int | None, ...]  # one per message; messages[0] starts at 0
    history_end: int | None                 # where the generated turn starts
    roles: tuple[str, ...]

    @property
    def starts(self) -> tuple[int, ...]:
        """Every proven start, as the server sends them with the request."""
        return usable(len(self.prompt), [s for s in (*self.message_starts[1:], self.history_end) if s is not None])

    def marks(self) -> tuple[int | None, int | None, int | None]:
        """History end, system end and rewind mark, in keep priority (None: no such mark)."""
        first = next((i for i, role in enumerate(self.roles) if role not in SYSTEM_ROLES), None)
        users = [i for i, role in enumerate(self.roles) if role == "user"]
        history = self.history_end if self.history_end is not None else len(self.prompt)
        system = self.message_starts[first] if first else None
        rewind = self.message_starts[users[-1]] if users and users[-1] else None
        return history, system, rewind

    def keep_points(self, cuts: Sequence[int], start: int, min_chunk: int) -> set[int]:
        """The cuts a pass that resumed at `start` keeps states at."""
        chosen: set[int] = set()
        history, system, rewind = self.marks()
        for mark, always in ((history, True), (rewind, True), (system, False)):
            if mark is None or not 0 < mark <= len(self.prompt):
                continue
            below = [c for c in cuts if c <= mark]
            if not below or below[-1] <= start:
                continue
            cut = below[-1]  # the history end and the rewind cut always; the system end min_chunk past the start
            if always or cut - start >= min_chunk:
                chosen.add(cut)
        return chosen


def shape(prompt: Sequence[int], prefixes: Sequence[Sequence[int]], roles: Sequence[str]) -> Shape:
    """The shape of a prompt from the tokens of messages[:i] rendered without the generation prompt, i = 1..n."""
    prompt = tuple(prompt)

    def proven(ids: Sequence[int]) -> int | None:
        at = len(ids)
        return at if 0 < at < len(prompt) and prompt[:at] == tuple(ids) else None

    found = [proven(ids) for ids in prefixes]
    return Shape(prompt=prompt, message_starts=(0, *found[:-1]), history_end=found[-1], roles=tuple(roles))


def shape_of(server: Any, messages: list[dict[str, Any]]) -> Shape:
    """The shape of a chat request, asked of the server's /tokenize (its template, its tokenizer)."""
    prompt = server.tokenize(messages, generation_prompt=True)
    prefixes = [server.tokenize(messages[:i], generation_prompt=False) for i in range(1, len(messages) + 1)]
    return shape(prompt, prefixes, [m["role"] for m in messages])


@attrs.frozen
class Kept:
    """A state the policy says the server keeps."""

    tokens: tuple[int, ...]
    cuts: tuple[int, ...]

    @property
    def at(self) -> int:
        """The row it resumes at."""
        return len(self.tokens)


@attrs.define
class KeepModel:
    """Kept states as the policy predicts them, for one server's whole run."""

    grid: int
    min_chunk: int
    kept: list[Kept] = attrs.field(factory=list)

    def cuts(self, request: Shape) -> tuple[int, ...]:
        """The request's cold cuts (the family's request-starts switch must be on, its default)."""
        return cuts_of(len(request.prompt), request.starts, self.grid, self.min_chunk)

    def resume_row(self, request: Shape) -> int:
        """The row the server must resume this request at (0: prefill from the start)."""
        cuts = self.cuts(request)
        best = 0
        for state in self.kept:
            if best < state.at < len(request.prompt) and state.at in cuts and \
                    tuple(c for c in cuts if c <= state.at) == state.cuts and request.prompt[:state.at] == state.tokens:
                best = state.at
        return best

    def after(self, request: Shape, resumed_at: int) -> None:
        """Record what the request's pass keeps: its keep points among the cuts past where it resumed."""
        cuts = self.cuts(request)
        points = request.keep_points(cuts, resumed_at, self.min_chunk)
        for cut in cuts:
            if cut in points:
                state = Kept(request.prompt[:cut], tuple(c for c in cuts if c <= cut))
                if state not in self.kept:
                    self.kept.append(state)

    def drop_all(self) -> None:
        """Every state is gone (a scenario pushed them out of the last tier)."""
        self.kept.clear()
