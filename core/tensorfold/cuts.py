"""Where a cold prefill pass cuts: the grid (`--prefill-chunk`) and the request starts the server found.

The rule. A pass over rows [0, length) with grid `grid` and starts S is cut at c₁ < c₂ < … < cₙ = length, where
from the previous cut p (p = 0 first)

    next(p) = min(length, p + grid, min{s in S : s > p})

- Every start is a cut, however close it is to the cut before it (a start of a tiny message makes a tiny chunk).
  No start is merged: `min_chunk` is checked but no longer moves a cut (it spaces system-end states,
  tiers/policy.py).
- Starts at or past `length`, at or before 0, and repeats are ignored; their order does not matter.
- With no starts, next(p) = min(length, p + grid) from p = 0: the cuts are exactly the absolute grid k·grid
  (`engine/grid.py`), so the switch off changes nothing.
- With starts, the grid runs on from the last cut: after a start cut s the next grid cut is s + grid.
- `length` is always the last cut, however close it is to the cut before.

Why no start is merged. A state is resumable only where a later pass cuts exactly as the pass that kept it did
(tiers/policy.py `resumable`), so the cuts up to a kept row must be a function of what the two passes share: the
tokens and the starts up to that row. The states worth keeping sit at marks (the history end, the rewind mark,
the system end), and every mark of one request is a plain start of the requests after it: turn N's history end
is the start of turn N's reply in turn N+1's prompt, its rewind mark the start of a user message that is no longer
the latest. The engine sees starts as positions only, so it cannot tell which of a later prompt's starts were
marks of an earlier request. A rule that merges a start closer than min_chunk to the previous cut, sparing only
the current request's own marks, therefore cuts turn N at its history end h and turn N+1 not at h (there h is an
ordinary start, merged whenever the chunk before it is short): turn N+1 cannot resume at h. Example, min_chunk 256,
a 3-row generated-turn header: turn 1 (51 rows) keeps at its history end 48; turn 2 (114 rows) has starts 48 (the
reply), 61 (the user) and 111 (its own history end); 48 < 0 + 256 would merge, turn 2 would not cut at 48 and
would prefill from 0. With every start a cut, the cuts up to any row depend only on the starts up to it, so a
prompt that extends another with the same starts below its history end cuts the same there, and each turn resumes
where the last kept its history end. The cost: a chunk per message, however short (one more step of a cold
prefill per short message; a resumed turn prefills only its new messages).

next(p) depends on p and S alone, never on where the pass began, so a pass resumed at any cut c of the cold
pass makes exactly the cold pass's cuts after c (`cuts_from`), and resumed == fresh holds bitwise. A pass may
resume only at a cut (`is_cut`); resumed anywhere else it would chunk differently.

Example: length 1000, grid 400, starts 50, 300, 330, 950.

    rows   0     50           300  330           730             950  1000
           |-----|------------|----|-------------|---------------|----|
    cuts         50           300  330           730             950  1000
    why          a start      a start, a start   330+400 = 730   a start; then the length

    plan_cuts(1000, (50, 300, 330, 950), 400, 100) == (50, 300, 330, 730, 950, 1000)
    cuts_from(730, 1000, …) == (950, 1000)
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable


def _check(grid: int, min_chunk: int) -> None:
    if grid < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {grid}")
    if min_chunk < 1:
        raise ValueError(f"min chunk must be >= 1, got {min_chunk}")


def usable_starts(length: int, starts: Iterable[int]) -> tuple[int, ...]:
    """The starts that can be cuts: inside (0, length), sorted, once each."""
    return tuple(sorted({s for s in starts if 0 < s < length}))


def _next(p: int, length: int, starts: tuple[int, ...], grid: int) -> int:
    cut = min(length, p + grid)
    i = bisect_right(starts, p)
    if i < len(starts):
        cut = min(cut, starts[i])
    return cut


def cuts_from(at: int, length: int, starts: Iterable[int], grid: int, min_chunk: int) -> tuple[int, ...]:
    """The cuts a pass starting at row `at` makes up to `length`, the last one included (empty when at ≥ length).
    From a cut of the cold pass these are exactly the cold pass's later cuts. `min_chunk` is checked only (no start
    is merged: module docstring)."""
    _check(grid, min_chunk)
    found = usable_starts(length, starts)
    cuts = []
    p = at
    while p < length:
        p = _next(p, length, found, grid)
        cuts.append(p)
    return tuple(cuts)


def plan_cuts(length: int, starts: Iterable[int], grid: int, min_chunk: int) -> tuple[int, ...]:
    """Every cut of a cold pass over [0, length): 0 excluded, `length` included."""
    return cuts_from(0, length, starts, grid, min_chunk)


def is_cut(at: int, length: int, starts: Iterable[int], grid: int, min_chunk: int) -> bool:
    """Whether the cold pass cuts at `at` (0 counts): the only rows a pass may resume at."""
    return at == 0 or at in plan_cuts(length, starts, grid, min_chunk)
