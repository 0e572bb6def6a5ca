"""A state whose split dim concatenates pieces (a conv tail over [q | k | v] channels): each piece is cut on its own,
so the rank's Layout divides when every piece does, and is refused naming the pieces when one does not."""

from __future__ import annotations

import pytest

from tensorfold.layout import FixedState, LayerLayout, Layout
from tensorfold.shard import Split, StateSplit, TensorParallel

LAYOUT = Layout([LayerLayout("linear", fixed=[FixedState("conv", (12, 3), "float32")])])


def parallel(parts: tuple[int, ...]) -> TensorParallel:
    return TensorParallel(divides={}, params=[Split("*", "replicated")],
                          states=[StateSplit("conv", 0, kind="linear", parts=parts)])


def test_each_piece_of_a_concatenated_state_dim_is_cut_on_its_own():
    assert parallel((4, 4, 4)).layout(LAYOUT, 2).layers[0].fixed[0].shape == (6, 3)
    assert parallel((4, 4, 4)).layout(LAYOUT, 4).layers[0].fixed[0].shape == (3, 3)
    assert parallel((8, 2, 2)).layout(LAYOUT, 2).layers[0].fixed[0].shape == (6, 3)


def test_a_piece_the_world_does_not_divide_is_refused_though_the_whole_dim_divides():
    assert parallel(()).layout(LAYOUT, 3).layers[0].fixed[0].shape == (4, 3)      # 12 / 3 as one piece
    with pytest.raises(ValueError, match=r"state 'conv' of shape \(12, 3\) \(parts \[4, 4, 4\]\) does not split "
                                         r"in 3 along dim 0"):
        parallel((4, 4, 4)).layout(LAYOUT, 3)


def test_pieces_that_do_not_add_up_to_the_dim_are_refused():
    with pytest.raises(ValueError, match=r"\(parts \[4, 4\]\) does not split in 2"):
        parallel((4, 4)).layout(LAYOUT, 2)
