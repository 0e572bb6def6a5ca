"""The keep policy: where a pass keeps states (the history end and rewind cut always, the system end at least
min_chunk past the start row, on cuts) and which kept states a later one moves past."""

from __future__ import annotations

import pytest

from tensorfold.cuts import plan_cuts
from tensorfold.tiers.policy import (
    HISTORY,
    REWIND,
    SYSTEM,
    eviction_order,
    keep_points,
    mark_passed,
    moves_past,
    resumable,
)
from tensorfold.tiers.states import HostState

# length 1000, grid 400, starts 50, 300, 330, 950: cuts 50, 300, 330, 730, 950, 1000 (cuts.py: every start cuts)
CUTS = plan_cuts(1000, (50, 300, 330, 950), 400, 100)


def points(history=None, system=None, rewind=None, start=0, min_chunk=100, cuts=CUTS, length=1000):
    return keep_points(cuts, length, history, system, rewind, start, min_chunk)


def test_the_example_cuts():
    assert CUTS == (50, 300, 330, 730, 950, 1000)


def test_without_marks_the_history_end_is_the_prompt_end():
    assert points() == {1000: frozenset({HISTORY})}


def test_each_mark_keeps_at_the_last_cut_at_or_before_it():
    # the history end (the generated turn's start) at 950, the system prompt ending at 300, the latest user at 730
    assert points(history=950, system=300, rewind=730) == {950: {HISTORY}, 300: {SYSTEM}, 730: {REWIND}}
    # a mark that is no cut (the server proves every mark as a start, so only when called by hand) keeps at the
    # last cut before it: the same cut in any later pass
    assert points(history=990, system=320, rewind=720) == {950: {HISTORY}, 300: {SYSTEM}, 330: {REWIND}}


def test_two_marks_on_one_cut_make_one_state_with_both_reasons():
    assert points(history=950, system=300, rewind=300) == {950: {HISTORY}, 300: {SYSTEM, REWIND}}
    assert points(history=960, rewind=955) == {950: {HISTORY, REWIND}}


def test_the_history_end_and_the_rewind_cut_are_kept_however_close():
    # 20 rows from the start, 30 apart, 50 from the prompt end: each under min chunk 100, each kept
    assert points(history=50, rewind=20, cuts=(20, 50, 100), length=100) == {50: {HISTORY}, 20: {REWIND}}
    assert points(history=950, rewind=330, start=300) == {950: {HISTORY}, 330: {REWIND}}
    assert points(history=1000, start=950) == {1000: {HISTORY}}
    assert points(history=330, system=300, rewind=300, start=50) == {330: {HISTORY}, 300: {SYSTEM, REWIND}}


def test_the_system_end_is_kept_only_min_chunk_past_the_start_row():
    assert points(history=950, system=300, start=0) == {950: {HISTORY}, 300: {SYSTEM}}
    assert points(history=950, system=300, start=250, cuts=(250, 300, 950, 1000)) == {950: {HISTORY}}
    assert points(history=950, system=50) == {950: {HISTORY}}  # 50 < 0 + min chunk: a tiny system prompt
    # close to a later point is no reason to drop it: the later state is no prefix another conversation shares
    assert points(history=330, system=300, min_chunk=100) == {330: {HISTORY}, 300: {SYSTEM}}
    assert points(history=330, system=300, min_chunk=301) == {330: {HISTORY}}


def test_nothing_is_kept_at_or_before_the_row_the_pass_resumed_at():
    assert points(history=950, system=300, rewind=730, start=300) == {950: {HISTORY}, 730: {REWIND}}
    assert points(history=950, system=300, rewind=730, start=730) == {950: {HISTORY}}
    assert points(history=950, start=950) == {}


def test_marks_outside_the_prompt_or_before_the_first_cut_keep_nothing():
    assert points(history=40, system=0, rewind=1200) == {}


def state(tokens, why=(), cuts=None, at=None):
    at = len(tokens) if at is None else at
    return HostState(tokens=tuple(tokens), at=at, cuts=cuts or (at,), rows=(), fixed=(), why=frozenset(why))


def test_a_history_end_is_moved_past_by_any_state_that_extends_it():
    older = state(range(10), [HISTORY])
    assert moves_past(state(range(12), [REWIND]), older) and moves_past(state(range(20), [HISTORY]), older)
    assert not moves_past(state([*range(9), 99, 100]), older)  # another conversation
    assert not moves_past(state(range(10), [HISTORY]), older)  # not strictly longer
    assert not moves_past(state(range(8), [HISTORY]), older)


def test_a_system_end_is_never_moved_past_and_a_rewind_cut_only_by_a_later_rewind_cut():
    system = state(range(10), [SYSTEM, REWIND])
    rewind = state(range(10), [REWIND])
    assert not moves_past(state(range(30), [REWIND]), system)
    assert not moves_past(state(range(30), [HISTORY]), rewind)  # its own turn's history end
    assert moves_past(state(range(30), [REWIND]), rewind)  # the user wrote a newer message
    assert moves_past(state(range(30), [REWIND, HISTORY]), rewind)


def test_eviction_order_is_moved_past_first_then_least_recently_used_never_the_spare():
    a, b, c, d = (state(range(n), [HISTORY]) for n in (5, 6, 7, 8))
    lru = [state([9, 9]), a, state([8, 8]), b]
    assert mark_passed(c, lru) == 2 and a.passed and b.passed
    assert eviction_order(lru) == [a, b, lru[0], lru[2]]
    assert eviction_order(lru, spare=a) == [b, lru[0], lru[2]]
    assert mark_passed(d, lru) == 0  # marked once


@pytest.mark.parametrize("prompt, cuts, ok", [
    (tuple(range(12)), (10, 12), True),
    (tuple(range(10)), (10,), False),          # no row left to prefill
    (tuple(range(12)), (8, 10, 12), False),    # the pass cuts at 8 before 10: other arithmetic
    (tuple(range(12)), (11, 12), False),       # 10 is no cut of this pass
    ((1,) + tuple(range(1, 12)), (10, 12), False),  # not a prefix
])
def test_resumable_only_at_the_same_cuts_with_a_row_left(prompt, cuts, ok):
    assert resumable(state(range(10), cuts=(10,)), prompt, cuts) is ok
