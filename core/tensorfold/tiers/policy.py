"""Which states are kept, which one a request resumes from, and which go first when a tier must make room.

Keep points. A pass keeps its state at the last cut at or before each of its request's marks (engine/api.py
KeepMarks, found by the server), so a later pass, whose cuts up to there are the same (cuts.py), can resume:

    history end   where the rendered history ends (the generated turn's start; the prompt end when unknown):
                  the next turn of the conversation resumes here
    system end    where the shared system prompt ends: another conversation on the same system prompt resumes here
    rewind cut    where the latest user message starts: an edited or regenerated last turn resumes here

Points land on cuts only (every start is a cut, cuts.py, so a mark the server proved is its own cut); two marks on
one cut make one state with both reasons. Which are kept, for the cuts after the row the pass started at:

    history end   always, however close to the start row, to another cut or to another mark: the next turn and
                  the next tool step resume exactly here, and one more state costs one state
    rewind cut    always: no history end moves past it (below), so it outlives a long tool chain; a next turn
                  whose template drops earlier reasoning (GLM-4.7 clear_thinking, Nemotron-3
                  truncate_history_thinking) changes the history inside the chain, after it, where no engine can
                  resume; an edited or regenerated last turn resumes here too
    system end    only when at least `--min-chunk` rows past the start row: it serves other conversations, and
                  the start row's state, a prefix of it that they share as well, serves them within min_chunk rows

A point is never dropped for being near a point after it: a longer state is no prefix that a diverging request
could use.

Moved past. Keeping a state T marks every kept state S whose tokens are a strict prefix of T's as moved past when
S is a history end (the conversation went on), or a rewind cut and T is one too (the user wrote a newer message).
A system end is never moved past: other conversations share it. Tiers evict moved-past states first, then the
least recently used; never the state being resumed.

Partitions. Every state is kept under its request's partition (engine/api.py Request.partition, "" the shared
one): a pass resumes only from a state of its own partition, and only a state of the same partition moves past
another, so no request learns from, or changes the eviction order of, another partition's states.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Protocol

HISTORY = "history end"
SYSTEM = "system end"
REWIND = "rewind cut"


class Marked(Protocol):
    """What the policy reads of a kept state, whatever tier holds it."""

    tokens: tuple[int, ...]
    at: int
    cuts: tuple[int, ...]
    why: frozenset[str]
    passed: bool
    partition: str


def keep_points(cuts: Sequence[int], length: int, history: int | None, system: int | None, rewind: int | None,
                start: int, min_chunk: int) -> dict[int, frozenset[str]]:
    """Cut → reasons, for the cuts after `start` (where the pass began) that a pass over `length` rows keeps: the
    history end and the rewind cut always, the system end when at least `min_chunk` past `start` (module docstring)."""
    chosen: dict[int, set[str]] = {}
    for why, mark in ((HISTORY, length if history is None else history), (REWIND, rewind), (SYSTEM, system)):
        if mark is None or not 0 < mark <= length:
            continue
        i = bisect_right(cuts, mark) - 1
        if i < 0 or cuts[i] <= start:
            continue
        cut = cuts[i]
        if cut in chosen or why != SYSTEM or cut - start >= min_chunk:
            chosen.setdefault(cut, set()).add(why)
    return {cut: frozenset(why) for cut, why in chosen.items()}


def resumable(state: Marked, prompt: Sequence[int], cuts: Sequence[int], partition: str = "") -> bool:
    """Whether a pass over `prompt` cut at `cuts` in `partition` may resume from `state`: kept in that partition,
    its tokens a prefix of the prompt, at least one prompt row left, and its cuts the pass's own up to its `at`."""
    if state.partition != partition or state.at >= len(prompt) or state.at not in cuts:
        return False
    return tuple(c for c in cuts if c <= state.at) == state.cuts and tuple(prompt[: state.at]) == state.tokens


def moves_past(newer: Marked, older: Marked) -> bool:
    """Whether keeping `newer` leaves `older` behind (module docstring)."""
    if newer.at <= older.at or SYSTEM in older.why or newer.partition != older.partition:
        return False
    if REWIND in older.why and REWIND not in newer.why:
        return False
    return newer.tokens[: older.at] == older.tokens


def mark_passed(newer: Marked, states: Iterable[Marked]) -> int:
    """Mark the states `newer` moves past; returns how many were newly marked."""
    marked = 0
    for state in states:
        if state is not newer and not state.passed and moves_past(newer, state):
            state.passed = True
            marked += 1
    return marked


def eviction_order(states: Iterable[Marked], spare: object | None = None) -> list[Marked]:
    """`states` (least recently used first) in the order they go: moved past first, then the rest; never `spare`."""
    states = [s for s in states if s is not spare]
    return [s for s in states if s.passed] + [s for s in states if not s.passed]
