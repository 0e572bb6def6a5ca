"""Prefill cuts on the absolute grid: chunk k covers [k·chunk, (k+1)·chunk), whatever row a pass starts at."""

from __future__ import annotations

from collections.abc import Iterator


def grid_cuts(start: int, end: int, chunk: int) -> Iterator[tuple[int, int]]:
    """The pieces [a, b) of [start, end) cut at every multiple of `chunk`, so a resume at a grid point redoes
    exactly the arithmetic the cold pass did after it."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    a = start
    while a < end:
        b = min(end, (a // chunk + 1) * chunk)
        yield a, b
        a = b
