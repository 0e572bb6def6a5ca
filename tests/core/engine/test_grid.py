"""Prefill cuts fall on the absolute grid whatever row a pass starts at."""

from __future__ import annotations

import pytest

from tensorfold.engine.grid import grid_cuts


def test_a_cold_pass_cuts_at_every_multiple():
    assert list(grid_cuts(0, 5000, 2048)) == [(0, 2048), (2048, 4096), (4096, 5000)]


def test_a_resumed_pass_meets_the_same_cuts():
    cold = set(grid_cuts(0, 9000, 2048))
    resumed = list(grid_cuts(4096, 9000, 2048))
    assert resumed == [(4096, 6144), (6144, 8192), (8192, 9000)] and set(resumed) <= cold


def test_a_pass_starting_off_grid_cuts_up_to_the_next_point():
    assert list(grid_cuts(100, 300, 128)) == [(100, 128), (128, 256), (256, 300)]


def test_empty_and_bad_chunk():
    assert list(grid_cuts(7, 7, 4)) == []
    with pytest.raises(ValueError, match="prefill chunk"):
        list(grid_cuts(0, 4, 0))
