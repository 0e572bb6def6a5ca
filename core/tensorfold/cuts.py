"""Where a cold prefill pass cuts: the grid (`--prefill-chunk`) and the request starts the server found.

The rule. A pass over rows [0, length) with grid `grid`, minimum chunk `min_chunk` and starts S is cut at
c₁ < c₂ < … < cₙ = length, where from the previous cut p (p = 0 first)

    next(p) = min(length, p + grid, min{s in S : s ≥ p + min_chunk})

- A start closer than `min_chunk` to the previous cut (p < s < p + min_chunk) is merged into that cut: it is
  not a cut, and it does not move the cuts after it. The previous cut may be a grid cut or a start.
- Starts at or past `length`, at or before 0, and repeats are ignored; their order does not matter.
- With no starts, next(p) = min(length, p + grid) from p = 0: the cuts are exactly the absolute grid k·grid
  (`engine/grid.py`), so the switch off changes nothing.
- With starts, the grid runs on from the last cut: after a start cut s the next grid cut is s + grid. So every
  chunk but the last is at least min(grid, min_chunk) rows.
- `length` is always the last cut, however close it is to the cut before.

next(p) depends on p and S alone, never on where the pass began, so a pass resumed at any cut c of the cold
pass makes exactly the cold pass's cuts after c (`cuts_from`), and resumed == fresh holds bitwise. A pass may
resume only at a cut (`is_cut`); resumed anywhere else it would chunk differently.

Example: length 1000, grid 400, min_chunk 100, starts 50, 300, 330, 950.

    rows   0        50           300  330         700              950  1000
           |--------+------------|----+-----------|----------------|----|
    cuts                         300              700              950  1000
    why    50 < 0+100: merged    300 ≥ 0+100       300+400 = 700    950 ≥ 700+100; then the length
                                 330 < 300+100: merged

    plan_cuts(1000, (50, 300, 330, 950), 400, 100) == (300, 700, 950, 1000)
    cuts_from(700, 1000, …) == (950, 1000)
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable


def _check(grid: int, min_chunk: int) -> None:
    if grid < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {grid}")
    if min_chunk < 1:
        raise ValueError(f"min chunk must be >= 1, got {min_chunk}")


def usable_starts(length: int, starts: Iterable[int]) -> tuple[int, ...]:
    """The starts that can be cuts: inside (0, length), sorted, once each."""
    return tuple(sorted({s for s in starts if 0 < s < length}))


def _next(p: int, length: int, starts: tuple[int, ...], grid: int, min_chunk: int) -> int:
    cut = min(length, p + grid)
    i = bisect_left(starts, p + min_chunk)
    if i < len(starts):
        cut = min(cut, starts[i])
    return cut


def cuts_from(at: int, length: int, starts: Iterable[int], grid: int, min_chunk: int) -> tuple[int, ...]:
    """The cuts a pass starting at row `at` makes up to `length`, the last one included (empty when at ≥ length).
    From a cut of the cold pass these are exactly the cold pass's later cuts."""
    _check(grid, min_chunk)
    found = usable_starts(length, starts)
    cuts = []
    p = at
    while p < length:
        p = _next(p, length, found, grid, min_chunk)
        cuts.append(p)
    return tuple(cuts)


def plan_cuts(length: int, starts: Iterable[int], grid: int, min_chunk: int) -> tuple[int, ...]:
    """Every cut of a cold pass over [0, length): 0 excluded, `length` included."""
    return cuts_from(0, length, starts, grid, min_chunk)


def is_cut(at: int, length: int, starts: Iterable[int], grid: int, min_chunk: int) -> bool:
    """Whether the cold pass cuts at `at` (0 counts): the only rows a pass may resume at."""
    return at == 0 or at in plan_cuts(length, starts, grid, min_chunk)
