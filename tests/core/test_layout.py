"""The Layout prices memory from declarations alone."""

from __future__ import annotations

import pytest

from tensorfold.layout import FixedState, LayerLayout, Layout, RowState


def hybrid() -> Layout:
    linear = LayerLayout("gdn", fixed=[FixedState("conv", (96, 3), "bfloat16"),
                                       FixedState("state", (4, 8, 8), "float32")])
    attention = LayerLayout("attention", rows=[RowState("k", (2, 16), "bfloat16"),
                                               RowState("v", (2, 16), "bfloat16")])
    indexed = LayerLayout("mla", rows=[RowState("latent", (512,), "bfloat16"),
                                       RowState("pooled", (128,), "bfloat16", every=16)])
    return Layout([linear, linear, linear, attention, indexed])


def test_bytes_per_token_and_fixed_bytes_follow_the_declarations():
    layout = hybrid()
    assert layout.fixed_bytes == 3 * (96 * 3 * 2 + 4 * 8 * 8 * 4)
    assert layout.bytes_per_token == 2 * 2 * 16 * 2 + 512 * 2 + 128 * 2 / 16


def test_stream_bytes_count_only_complete_pools():
    layout = hybrid()
    per_row = 2 * 2 * 16 * 2 + 512 * 2
    assert layout.stream_bytes(15) == layout.fixed_bytes + 15 * per_row
    assert layout.stream_bytes(16) == layout.fixed_bytes + 16 * per_row + 128 * 2
    assert layout.stream_bytes(0) == layout.fixed_bytes


def test_by_kind_sums_layers_of_a_kind():
    kinds = hybrid().by_kind()
    assert kinds["gdn"]["layers"] == 3 and kinds["attention"]["layers"] == 1
    assert kinds["gdn"]["bytes_per_token"] == 0 and kinds["mla"]["fixed_bytes"] == 0


@pytest.mark.parametrize("make, message", [
    (lambda: RowState("k", (0, 4), "float32"), "positive ints"),
    (lambda: RowState("k", (2,), "float64"), "is not one of"),
    (lambda: RowState("", (2,), "float32"), "identifier"),
    (lambda: RowState("k", (2,), "float32", every=0), "every"),
    (lambda: LayerLayout("attention", rows=[RowState("k", (2,), "float32")], fixed=[FixedState("k", (2,), "float32")]),
     "repeats a state name"),
    (lambda: Layout([]), "at least one layer"),
    (lambda: Layout([{"kind": "attention"}]), "not LayerLayout"),
])
def test_malformed_declarations_fail_with_the_reason(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_describe_is_json_ready():
    import json

    text = json.dumps(hybrid().describe())
    assert '"every": 16' in text
