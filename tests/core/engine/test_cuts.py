"""A cold pass cuts at the grid and at request starts; a pass resumed at any of its cuts makes the same cuts."""

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
    assert plan_cuts(1000, (50, 300, 330, 950), 400, 100) == (300, 700, 950, 1000)
    assert cuts_from(700, 1000, (50, 300, 330, 950), 400, 100) == (950, 1000)


def test_each_start_at_least_min_chunk_past_the_previous_cut_is_a_cut():
    assert plan_cuts(2000, (300, 900, 1500), 2048, 256) == (300, 900, 1500, 2000)


def test_starts_closer_than_min_chunk_merge_into_the_previous_cut():
    # 100 is within 256 of 0; 600 is within 256 of 500; 1000 is exactly 256 past 744 and cuts.
    assert plan_cuts(1200, (100, 500, 600, 744, 1000), 2048, 256) == (500, 1000, 1200)
    assert plan_cuts(1200, (100, 500, 600, 744, 1000), 2048, 1) == (100, 500, 600, 744, 1000, 1200)


def test_the_grid_runs_on_from_a_start_cut():
    assert plan_cuts(3000, (700,), 1000, 256) == (700, 1700, 2700, 3000)


def test_a_start_just_past_a_grid_cut_merges_into_it():
    assert plan_cuts(2500, (1010,), 1000, 256) == (1000, 2000, 2500)


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


cases = st.tuples(st.integers(1, 3000), st.lists(st.integers(-10, 3100), max_size=30), st.integers(1, 700),
                  st.integers(1, 400))


@settings(max_examples=400, deadline=None)
@given(cases)
def test_property_cuts(case):
    length, starts, grid, min_chunk = case
    cuts = plan_cuts(length, starts, grid, min_chunk)
    previous = 0
    for cut in cuts:  # strictly increasing, never a chunk longer than the grid, ends at the length
        assert previous < cut <= min(length, previous + grid)
        if cut < length and cut != previous + grid:  # a cut off the grid is a start at least min_chunk past
            assert cut in starts and cut - previous >= min_chunk
        skipped = [s for s in usable_starts(length, starts) if previous < s < cut]
        assert all(s < previous + min_chunk for s in skipped), "a start that should cut was passed over"
        previous = cut
    assert cuts[-1] == length
    for c in (0, *cuts):  # resumed at any cut == the cold cuts after it
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
