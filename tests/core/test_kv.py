"""The reference memory: rows by slot and position, fixed states zeroed for a new stream, poison on request."""

from __future__ import annotations

import pytest
import torch

from tensorfold.kv import WindowStore
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState

LAYOUT = Layout([LayerLayout("mixed", rows=[RowState("k", (2, 3), "float32"), RowState("p", (4,), "float32", every=4)],
                             fixed=[FixedState("s", (2, 2), "float32")])])


def test_rows_written_are_read_back_per_slot():
    kv = WindowStore(LAYOUT, slots=2, capacity=16)
    values = torch.randn(5, 2, 3)
    kv.write_rows(0, "k", 1, 3, values)
    assert torch.equal(kv.rows(0, "k", 1, 8)[3:8], values)
    assert kv.rows(0, "k", 0, 8).abs().sum() == 0


def test_pooled_rows_are_entries_per_group():
    kv = WindowStore(LAYOUT, slots=1, capacity=16)
    kv.write_rows(0, "p", 0, 4, torch.ones(2, 4))
    assert kv.rows(0, "p", 0, 11).shape == (2, 4)
    assert kv.rows(0, "p", 0, 12).shape == (3, 4)


def test_writing_past_the_window_is_an_error():
    kv = WindowStore(LAYOUT, slots=1, capacity=4)
    with pytest.raises(IndexError, match="exceed the window"):
        kv.write_rows(0, "k", 0, 2, torch.zeros(3, 2, 3))


def test_clear_zeroes_fixed_states_and_poisons_rows():
    kv = WindowStore(LAYOUT, slots=2, capacity=8, poison=True)
    kv.fixed(0, "s", 0).fill_(3.0)
    kv.fixed(0, "s", 1).fill_(3.0)
    kv.clear(0)
    assert kv.fixed(0, "s", 0).abs().sum() == 0 and kv.fixed(0, "s", 1).sum() == 12
    assert torch.isnan(kv.rows(0, "k", 0, 8)).all()


def test_nbytes_is_the_window_times_row_bytes_plus_fixed():
    kv = WindowStore(LAYOUT, slots=3, capacity=8)
    assert kv.nbytes == 3 * (8 * 2 * 3 * 4 + 2 * 4 * 4 + 2 * 2 * 4)


def test_a_family_writing_the_wrong_dtype_is_told():
    kv = WindowStore(LAYOUT, slots=1, capacity=8)
    with pytest.raises(TypeError, match="the Layout declares torch.float32, the family wrote torch.bfloat16"):
        kv.write_rows(0, "k", 0, 0, torch.zeros(1, 2, 3, dtype=torch.bfloat16))


def test_paged_rows_read_back_through_a_scrambled_table():
    from tensorfold.kv import PagedStore

    kv = PagedStore(LAYOUT, slots=2, pages=6, page_rows=4)
    kv.bind(0, [5, 1, 3])
    kv.bind(1, [0, 2])
    values = torch.randn(11, 2, 3)
    kv.write_rows(0, "k", 0, 0, values[:6])
    kv.write_rows(0, "k", 0, 6, values[6:])
    assert torch.equal(kv.rows(0, "k", 0, 11), values)
    assert torch.equal(kv._pages[0]["k"][1][:2], values[4:6])
    kv.write_rows(0, "p", 0, 4, torch.ones(2, 4))
    assert kv.rows(0, "p", 0, 12).shape == (3, 4) and kv.rows(0, "p", 0, 12)[1:].sum() == 8
    assert kv.rows(0, "k", 1, 0).shape == (0, 2, 3)


def test_paged_store_refuses_reads_and_writes_past_its_pages():
    from tensorfold.kv import PagedStore

    kv = PagedStore(LAYOUT, slots=1, pages=4, page_rows=4)
    kv.bind(0, [2])
    with pytest.raises(IndexError, match="its 1 pages hold 4"):
        kv.write_rows(0, "k", 0, 3, torch.zeros(2, 2, 3))
    with pytest.raises(IndexError, match="its 1 pages hold 4"):
        kv.rows(0, "k", 0, 5)


def test_fill_poisons_only_the_pages_named():
    from tensorfold.kv import PagedStore

    kv = PagedStore(LAYOUT, slots=1, pages=3, page_rows=4, poison=True)
    kv.fill([1])
    assert torch.isnan(kv._pages[0]["k"][1]).all() and not torch.isnan(kv._pages[0]["k"][0]).any()
    assert kv.page_bytes == 4 * 2 * 3 * 4 + 1 * 4 * 4


def test_page_rows_must_hold_whole_pools():
    from tensorfold.kv import PagedStore

    with pytest.raises(ValueError, match="--page-rows 6 is not a multiple of row state 'p'"):
        PagedStore(LAYOUT, slots=1, pages=2, page_rows=6)


def test_kernel_views_expose_pages_tables_and_slot_states():
    from tensorfold.kv import PagedStore

    paged = PagedStore(LAYOUT, slots=3, pages=6, page_rows=4)
    paged.bind(0, [5, 1])
    paged.bind(2, [3])
    assert paged.tables([0, 2]).tolist() == [[5, 1], [3, 0]] and paged.tables([0]).dtype == torch.int32
    assert paged.row_pages(0, "k").shape == (6, 4, 2, 3) and paged.row_pages(0, "p").shape == (6, 1, 4)
    assert paged.fixed_states(0, "s").shape == (3, 2, 2)
    window = WindowStore(LAYOUT, slots=2, capacity=8)
    assert window.tables([1, 0]).tolist() == [[1], [0]] and window.row_pages(0, "k").shape == (2, 8, 2, 3)


# -- states a family names: an undeclared one, or one of another dtype, is named where it is asked for -------------

SSM = Layout([LayerLayout("ssm", fixed=[FixedState("conv", (6, 3), "bfloat16"), FixedState("ssm", (2, 4), "float32")]),
              LayerLayout("attention", rows=[RowState("k", (2, 3), "bfloat16")])])


@pytest.mark.parametrize("store", ["window", "paged"])
def test_an_undeclared_state_names_the_layer_and_what_it_declares(store):
    from tensorfold.kv import PagedStore
    from tensorfold.kv.base import UndeclaredState

    kv = WindowStore(SSM, slots=1, capacity=8) if store == "window" else PagedStore(SSM, slots=1, pages=2, page_rows=4)
    with pytest.raises(UndeclaredState) as caught:
        kv.fixed(1, "ssm", 0)
    assert str(caught.value) == ("layer 1 (attention) declares no fixed state 'ssm': its fixed states are [], its "
                                 "row states ['k'] (family_kv_layout)")
    assert isinstance(caught.value, KeyError)
    with pytest.raises(UndeclaredState, match=r"^layer 0 \(ssm\) declares no row state 'k': its fixed states are "
                                              r"\['conv', 'ssm'\], its row states \[\] \(family_kv_layout\)$"):
        kv.write_rows(0, "k", 0, 0, torch.zeros(1, 2, 3, dtype=torch.bfloat16))
    with pytest.raises(UndeclaredState, match="layer 0 .ssm. declares no row state 'k'"):
        kv.rows(0, "k", 0, 1)
    with pytest.raises(IndexError, match=r"^layer 2: the Layout declares 2 layers \(0 \.\. 1\)$"):
        kv.fixed_states(2, "ssm")


def test_a_fixed_state_read_as_another_dtype_is_named():
    kv = WindowStore(SSM, slots=2, capacity=8)
    assert kv.fixed(0, "ssm", 1, dtype=torch.float32).dtype == torch.float32   # float32 in a bf16 model
    with pytest.raises(TypeError, match=r"^layer 0 conv: the Layout declares torch.bfloat16, the family reads it as "
                                        r"torch.float32$"):
        kv.fixed(0, "conv", 0, dtype=torch.float32)
    with pytest.raises(TypeError, match="layer 0 ssm: the Layout declares torch.float32, the family reads it as "
                                        "torch.bfloat16"):
        kv.fixed_states(0, "ssm", dtype=torch.bfloat16)


def test_write_fixed_replaces_one_slot_and_never_casts():
    kv = WindowStore(SSM, slots=2, capacity=8)
    values = torch.randn(2, 4)
    kv.write_fixed(0, "ssm", 1, values)
    assert torch.equal(kv.fixed(0, "ssm", 1), values) and kv.fixed(0, "ssm", 0).abs().sum() == 0
    with pytest.raises(TypeError, match=r"^layer 0 ssm: the Layout declares torch.float32, the family wrote "
                                        r"torch.bfloat16$"):
        kv.write_fixed(0, "ssm", 0, values.bfloat16())
    with pytest.raises(ValueError, match=r"^layer 0 conv: the Layout declares shape \(6, 3\), the family wrote "
                                         r"\(6, 4\)$"):
        kv.write_fixed(0, "conv", 0, torch.zeros(6, 4, dtype=torch.bfloat16))
    assert torch.equal(kv.fixed(0, "ssm", 0), torch.zeros(2, 4))


@pytest.mark.parametrize("store", ["window", "paged"])
def test_rows_of_another_entry_shape_are_named(store):
    from tensorfold.kv import PagedStore

    kv = WindowStore(SSM, slots=1, capacity=8) if store == "window" else PagedStore(SSM, slots=1, pages=2, page_rows=4)
    if store == "paged":
        kv.bind(0, [1, 0])
    with pytest.raises(ValueError, match=r"^layer 1 k: the Layout declares entries of shape \(2, 3\), the family "
                                         r"wrote \[5, \*\(3, 2\)\]$"):
        kv.write_rows(1, "k", 0, 0, torch.zeros(5, 3, 2, dtype=torch.bfloat16))
