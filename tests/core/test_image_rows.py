"""The rows part of an image as whole tables (image_rows.py) is the by-position definition, byte for byte, for row
states of several `every`s at every length, and comes back into another slot unchanged."""

from __future__ import annotations

import pytest
import torch

from tensorfold.image import ImageFormat
from tensorfold.image_rows import RowsTable, put_rows, rows_bytes
from tensorfold.kv import PagedStore, WindowStore
from tensorfold.layout import LayerLayout, Layout, RowState

LAYOUT = Layout([
    LayerLayout("mla", rows=[RowState("latent", (3,), "bfloat16"), RowState("pooled", (2,), "float32", every=4)]),
    LayerLayout("odd", rows=[RowState("six", (1, 2), "float32", every=6)]),
    LayerLayout("plain", rows=[RowState("k", (2,), "float16")]),
])
FMT = ImageFormat.of_layout("rows-test", 1, LAYOUT)
CAPACITY = 48


def filled(store) -> None:
    generator = torch.Generator().manual_seed(1)
    for i, layer in enumerate(LAYOUT.layers):
        for spec in layer.rows:
            values = torch.randn(spec.entries(CAPACITY), *spec.shape, generator=generator)
            store.write_rows(i, spec.name, 0, 0, values.to(getattr(torch, spec.dtype)))


def by_position(store, at: int) -> bytes:
    """The definition: for each position, each row state's entry that completes there, in the format's order."""
    out = bytearray()
    for position in range(at):
        for i, name in FMT.rows:
            spec = next(s for s in LAYOUT.layers[i].rows if s.name == name)
            if (position + 1) % spec.every == 0:
                entry = store.rows(i, name, 0, position + 1)[-1]
                out += entry.contiguous().view(torch.uint8).numpy().tobytes()
    return bytes(out)


@pytest.mark.parametrize("make", [lambda: WindowStore(LAYOUT, slots=2, capacity=CAPACITY),
                                  lambda: _paged()], ids=["windows", "pages"])
def test_table_bytes_are_the_by_position_bytes_and_come_back(make):
    store = make()
    filled(store)
    table = RowsTable.of(store, FMT.rows)
    assert table.period == 12 and table.group_bytes == table.nbytes(12)
    for at in (0, 1, 3, 4, 11, 12, 13, 24, 29, 47, 48):
        rows = rows_bytes(store, 0, at, table)
        assert rows == by_position(store, at) and len(rows) == table.nbytes(at)
        put_rows(store, 1, bytearray(rows), at, table)
        assert rows_bytes(store, 1, at, table) == rows
    with pytest.raises(ValueError, match="rows part is 5 bytes"):
        put_rows(store, 1, b"12345", 13, table)


def _paged() -> PagedStore:
    store = PagedStore(LAYOUT, slots=2, pages=8, page_rows=12)
    store.bind(0, [0, 1, 2, 3])
    store.bind(1, [4, 5, 6, 7])
    return store
