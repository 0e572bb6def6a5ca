"""State images: read out, to bytes, back, put back — byte-equal; damage and mismatch refused by name."""

from __future__ import annotations

import pytest
import torch

from tensorfold.image import ImageFormat, StateImage, put_back, read_out, row_offset
from tensorfold.kv import KvStore, WindowStore
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState

LAYOUT = Layout([
    LayerLayout("rec", fixed=[FixedState("s", (3, 3), "float32"), FixedState("conv", (5,), "bfloat16")]),
    LayerLayout("attn", rows=[RowState("k", (2, 4), "bfloat16"), RowState("pool", (3,), "float32", every=4)]),
])
FMT = ImageFormat.of_layout("test", 1, LAYOUT)


def filled(at: int) -> KvStore:
    kv = WindowStore(LAYOUT, slots=2, capacity=32, poison=True)
    kv.clear(0)
    generator = torch.Generator().manual_seed(0)
    kv.fixed(0, "s", 0).copy_(torch.randn(3, 3, generator=generator))
    kv.fixed(0, "conv", 0).copy_(torch.randn(5, generator=generator))
    kv.write_rows(1, "k", 0, 0, torch.randn(at, 2, 4, generator=generator).bfloat16())
    kv.write_rows(1, "pool", 0, 0, torch.randn(at // 4, 3, generator=generator))
    return kv


@pytest.mark.parametrize("at", [1, 4, 7, 13])
def test_round_trip_is_byte_equal(at):
    kv = filled(at)
    image = read_out(kv, 0, at, FMT)
    assert len(image.own) + len(image.rows) == LAYOUT.stream_bytes(at)
    put_back(kv, 1, StateImage.from_bytes(image.to_bytes()), FMT)
    assert read_out(kv, 1, at, FMT) == image
    assert torch.equal(kv.rows(1, "k", 1, at), kv.rows(1, "k", 0, at))


def test_rows_are_laid_by_position_so_prefixes_share_bytes():
    kv = filled(13)
    long_image = read_out(kv, 0, 13, FMT)
    short_image = read_out(kv, 0, 9, FMT)
    cut = row_offset(LAYOUT, FMT, 9)
    assert long_image.rows[:cut] == short_image.rows
    assert cut == 9 * 16 + 2 * 12


def test_plain_rows_take_the_vectorised_path_and_agree():
    layout = Layout([LayerLayout("attn", rows=[RowState("k", (2,), "float32"), RowState("v", (3,), "bfloat16")])])
    fmt = ImageFormat.of_layout("plain", 1, layout)
    kv = WindowStore(layout, slots=2, capacity=8)
    kv.write_rows(0, "k", 0, 0, torch.arange(10.0).reshape(5, 2))
    kv.write_rows(0, "v", 0, 0, torch.arange(15.0).reshape(5, 3).bfloat16())
    image = read_out(kv, 0, 5, fmt)
    first = torch.tensor([0.0, 1.0]).numpy().tobytes()
    first += torch.tensor([0.0, 1, 2]).bfloat16().view(torch.uint8).numpy().tobytes()
    assert image.rows[:14] == first
    put_back(kv, 1, image, fmt)
    assert read_out(kv, 1, 5, fmt) == image


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:-1], "body is"),
    (lambda b: b[:4] + (9).to_bytes(4, "little") + b[8:], "container version 9"),
])
def test_damaged_bytes_are_refused(damage, message):
    data = read_out(filled(5), 0, 5, FMT).to_bytes()
    with pytest.raises(ValueError, match=message):
        StateImage.from_bytes(damage(data))


def test_an_image_of_another_format_or_layout_is_refused():
    kv = filled(5)
    image = read_out(kv, 0, 5, FMT)
    with pytest.raises(ValueError, match="this family writes other v1"):
        put_back(kv, 1, image, ImageFormat("other", 1, FMT.own, FMT.rows))
    other = WindowStore(Layout([LayerLayout("rec", fixed=[FixedState("s", (3, 3), "float32"),
                                                      FixedState("conv", (5,), "bfloat16")]),
                            LayerLayout("attn", rows=[RowState("k", (2, 4), "float32"),
                                                      RowState("pool", (3,), "float32", every=4)])]), 1, 8)
    with pytest.raises(ValueError, match="another Layout"):
        put_back(other, 0, image, FMT)


def test_format_problems_name_what_is_missing_or_unknown():
    bad = ImageFormat("bad", 1, own=[(0, "s"), (0, "s")], rows=[(1, "k"), (1, "nope")])
    problems = " | ".join(bad.problems(LAYOUT))
    assert "named twice" in problems and "(0, 'conv')" in problems and "(1, 'nope')" in problems
    assert "(1, 'pool')" in problems
    assert FMT.problems(LAYOUT) == []


def test_an_own_part_of_the_wrong_length_is_refused_before_the_slot_is_touched():
    import attrs

    kv = filled(5)
    image = read_out(kv, 0, 5, FMT)
    kv.fixed(0, "s", 1).fill_(7.0)
    with pytest.raises(ValueError, match=r"^image own part is 45 bytes, the format needs 46$"):
        put_back(kv, 1, attrs.evolve(image, own=image.own[:-1]), FMT)
    assert torch.equal(kv.fixed(0, "s", 1), torch.full((3, 3), 7.0))


def test_a_float32_state_in_a_bf16_layout_round_trips_in_its_own_dtype():
    """A fixed state may have another dtype than the model's: its bytes are its own dtype's, put back as they were."""
    kv = filled(3)
    state = kv.fixed(0, "s", 0)
    state.copy_(torch.tensor([[1.0 + 2**-20, 2.0, 3.0]] * 3))          # not representable in bf16
    image = read_out(kv, 0, 3, FMT)
    put_back(kv, 1, image, FMT)
    assert kv.fixed(0, "s", 1).dtype == torch.float32 and torch.equal(kv.fixed(0, "s", 1), state)
    assert kv.fixed(0, "conv", 1).dtype == torch.bfloat16 and len(image.own) == 3 * 3 * 4 + 5 * 2
