"""The decode runner's bookkeeping: which batch sizes are captured, which models and sizes it takes. (What it
computes is checked with a real family in tensorfold_qwen/tests/test_qwen_decode.py, on the GPU too.)"""

from __future__ import annotations

import pytest

from tensorfold.engine.graphs import DecodeRunner, batch_sizes, has_decode
from tensorfold.kv import WindowStore
from tensorfold.layout import LayerLayout, Layout, RowState

LAYOUT = Layout([LayerLayout("attention", rows=[RowState("k", (2,), "float32")])])


def test_batch_sizes_rise_to_the_streams():
    assert batch_sizes(1) == (1,)
    assert batch_sizes(5) == (1, 2, 4, 5)
    assert batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_sizes(100)[-3:] == (80, 96, 100)
    assert batch_sizes(1000)[-1] == 256
    assert batch_sizes(0) == (1,)


class NoDecode:
    vocab_size = 8

    def forward(self, plan, kv):
        raise AssertionError("not called")


def test_a_model_without_decode_is_refused_by_name():
    kv = WindowStore(LAYOUT, 2, 16)
    assert not has_decode(NoDecode())
    with pytest.raises(TypeError, match="NoDecode has no decode"):
        DecodeRunner(NoDecode(), kv, (1, 2), context=16, graphs=False)


@pytest.mark.parametrize("sizes", [(), (2, 1), (0, 1), (1, 1)])
def test_sizes_must_rise_from_one(sizes):
    class WithDecode(NoDecode):
        def decode(self, batch, kv):
            raise AssertionError("not called")

    with pytest.raises(ValueError, match="batch sizes"):
        DecodeRunner(WithDecode(), WindowStore(LAYOUT, 2, 16), sizes, context=16, graphs=False)
