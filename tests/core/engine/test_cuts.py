"""A cold pass cuts at the grid and at every request start; a pass resumed at any of its cuts makes the same cuts,
and a later prompt that extends a history end cuts there too (issue 17)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorfold.cuts import cuts_from, is_cut, plan_cuts, usable_starts
from tensorfold.engine.grid import grid_cuts


def grid_only(length: int, grid: int) -> tuple[int, ...]:
    return tuple(b for _, b in grid_cuts(0, length, grid))


@pytest.mark.parametrize("length, grid", [(1, 1), (5000, 2048), (4096, 2048), (7, 3), (300, 1000)])
def test_without_starts_the_cuts_are_the_absolute_grid(length, grid):
    assert plan_cuts(length, (), grid, 256) == grid_only(length, grid)


def test_the_docstring_example():
    assert plan_cuts(1000, (50, 300, 330, 950), 400, 100) == (50, 300, 330, 730, 950, 1000)
    assert cuts_from(730, 1000, (50, 300, 330, 950), 400, 100) == (950, 1000)


def test_every_start_is_a_cut_whatever_min_chunk():
    assert plan_cuts(2000, (300, 900, 1500), 2048, 256) == (300, 900, 1500, 2000)
    for min_chunk in (1, 256, 5000):  # min_chunk merges no start (it spaces system-end states, tiers/policy.py)
        assert plan_cuts(1200, (100, 500, 600, 744, 1000), 2048, min_chunk) == (100, 500, 600, 744, 1000, 1200)


def test_the_grid_runs_on_from_a_start_cut():
    assert plan_cuts(3000, (700,), 1000, 256) == (700, 1700, 2700, 3000)


def test_a_start_just_past_a_grid_cut_is_a_cut():
    assert plan_cuts(2500, (1010,), 1000, 256) == (1000, 1010, 2010, 2500)


def test_a_short_chat_cuts_at_each_history_end_in_every_later_turn():
    # the chat under the default min chunk: turns of 51, 114 and 175 rows, a 3-row generated-turn header;
    # each turn's history end (the reply's start) is a plain start in the next turn, and a cut of both
    turn1, turn2, turn3 = (48,), (48, 61, 111), (48, 61, 111, 124, 172)
    assert plan_cuts(51, turn1, 32, 256) == (32, 48, 51)
    assert plan_cuts(114, turn2, 32, 256) == (32, 48, 61, 93, 111, 114)
    assert plan_cuts(175, turn3, 32, 256) == (32, 48, 61, 93, 111, 124, 156, 172, 175)
    for (length, starts), (later, more) in zip([(51, turn1), (114, turn2)], [(114, turn2), (175, turn3)],
                                               strict=True):
        end = length - 3
        assert [c for c in plan_cuts(length, starts, 32, 256) if c <= end] == \
            [c for c in plan_cuts(later, more, 32, 256) if c <= end]


def test_the_length_is_always_the_last_cut_even_right_after_a_start():
    assert plan_cuts(1000, (990,), 2048, 256) == (990, 1000)


def test_starts_at_or_past_the_length_at_zero_repeated_or_unsorted_are_ignored():
    assert plan_cuts(1000, (1000, 5000, 0, -3), 400, 100) == grid_only(1000, 400)
    assert plan_cuts(1000, (600, 300, 300), 400, 100) == plan_cuts(1000, (300, 600), 400, 100) == (300, 600, 1000)
    assert usable_starts(1000, (1000, 600, 0, 300, 600)) == (300, 600)


def test_a_pass_resumed_at_a_cut_continues_with_the_cold_cuts():
    starts = (120, 400, 410, 1333, 2900, 2950)
    cold = plan_cuts(4000, starts, 1024, 64)
    for c in (0, *cold):
        assert cuts_from(c, 4000, starts, 1024, 64) == tuple(x for x in cold if x > c)
        assert is_cut(c, 4000, starts, 1024, 64)
    assert not is_cut(121, 4000, starts, 1024, 64)


def test_empty_and_bad_arguments():
    assert plan_cuts(0, (5,), 4, 1) == ()
    assert cuts_from(9, 9, (), 4, 1) == ()
    with pytest.raises(ValueError, match="prefill chunk"):
        plan_cuts(10, (), 0, 1)
    with pytest.raises(ValueError, match="min chunk"):
        plan_cuts(10, (), 4, 0)


def resumption_points(cuts: tuple[int, ...], usable: tuple[int, ...], most: int = 48) -> list[int]:
    """0 and every cut where there are few; else every cut at or next to a start, and cuts spread evenly between
    (resuming at each of thousands of one-row cuts costs seconds an example and finds nothing the spread misses)."""
    if len(cuts) <= most:
        return [0, *cuts]
    near = {i + d for i, cut in enumerate(cuts) if cut in usable for d in (-1, 0, 1)}
    spread = set(range(0, len(cuts), len(cuts) // most)) | {len(cuts) - 1}
    return [0, *(cuts[i] for i in sorted((near | spread) & set(range(len(cuts)))))]


cases = st.tuples(st.integers(1, 3000), st.lists(st.integers(-10, 3100), max_size=30), st.integers(1, 700),
                  st.integers(1, 400))


@settings(max_examples=400, deadline=None)
@given(cases)
def test_property_cuts(case):
    length, starts, grid, min_chunk = case
    cuts = plan_cuts(length, starts, grid, min_chunk)
    usable = usable_starts(length, starts)
    previous = 0
    for cut in cuts:  # strictly increasing, never a chunk longer than the grid, ends at the length
        assert previous < cut <= min(length, previous + grid)
        if cut < length and cut != previous + grid:  # a cut off the grid is a start
            assert cut in starts
        assert not [s for s in usable if previous < s < cut], "a start was passed over"
        previous = cut
    assert cuts[-1] == length
    for c in resumption_points(cuts, usable):  # resumed at a cut == the cold cuts after it
        assert cuts_from(c, length, starts, grid, min_chunk) == tuple(x for x in cuts if x > c)
    if not usable_starts(length, starts):
        assert cuts == grid_only(length, grid)


@settings(max_examples=200, deadline=None)
@given(cases, st.integers(1, 3000))
def test_property_a_longer_prompt_with_the_same_earlier_starts_cuts_the_same_before_the_shorter_end(case, extra):
    length, starts, grid, min_chunk = case
    short = plan_cuts(length, starts, grid, min_chunk)
    longer = plan_cuts(length + extra, [*starts, length + extra // 2], grid, min_chunk)
    assert [c for c in short if c < length] == [c for c in longer if c < length]


@settings(max_examples=300, deadline=None)
@given(cases, st.integers(1, 3000), st.lists(st.integers(1, 3000), max_size=10))
def test_property_a_history_end_is_a_cut_of_every_prompt_that_extends_it(case, extra, later):
    """A pass keeps its history end h (a start, or its length): a later prompt whose starts below h are this one's,
    h among them, and any others after it, cuts at h and exactly as this pass did before it."""
    length, starts, grid, min_chunk = case
    short = plan_cuts(length, starts, grid, min_chunk)
    ends = {length, *usable_starts(length, starts)}
    longer_starts = [*usable_starts(length, starts), length, *(length + x for x in later)]
    longer = plan_cuts(length + extra + max(later, default=0), longer_starts, grid, min_chunk)
    for h in ends:
        assert h in longer
        assert [c for c in short if c <= h] == [c for c in longer if c <= h]
