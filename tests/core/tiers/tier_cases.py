"""What the tier tests share: a Layout with every kind of state (rows, a pooled row state, a fixed state), memory
over it, and streams written as a forward would write them."""

from __future__ import annotations

import torch

from tensorfold.kv import PagedStore, WindowStore
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState
from tensorfold.memory import StreamMemory
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool

LAYOUT = Layout([LayerLayout("mixed", rows=[RowState("k", (2, 3), "float32"), RowState("p", (4,), "float32", every=4)],
                             fixed=[FixedState("s", (2, 2), "float32")]),
                 LayerLayout("attn", rows=[RowState("v", (3,), "float32")])])
PAGE_ROWS = 8


def paged(slots: int = 3, pages: int = 24) -> StreamMemory:
    return StreamMemory(PagedStore(LAYOUT, slots, pages, PAGE_ROWS, poison=True), SlotPool(slots),
                        PagePool(pages, PAGE_ROWS))


def windowed(slots: int = 3) -> StreamMemory:
    return StreamMemory(WindowStore(LAYOUT, slots, 64, poison=True), SlotPool(slots), None)


def fill(memory: StreamMemory, claim, rows: int, seed: int, start: int = 0) -> None:
    """Write rows [start, rows) and fixed states as a stream would (entries that complete at or past start)."""
    gen = torch.Generator().manual_seed(seed)
    memory.extend(claim, rows)
    kv = memory.kv
    for i, layer in enumerate(LAYOUT.layers):
        for spec in layer.rows:
            first = start // spec.every
            values = torch.randn(rows // spec.every - first, *spec.shape, generator=gen)
            kv.write_rows(i, spec.name, claim.slot, first * spec.every, values)
        for spec in layer.fixed:
            kv.fixed(i, spec.name, claim.slot).copy_(torch.randn(*spec.shape, generator=gen))


def every_state(memory: StreamMemory, slot: int, at: int) -> list[torch.Tensor]:
    kv = memory.kv
    out = [kv.rows(i, s.name, slot, at).clone() for i, layer in enumerate(LAYOUT.layers) for s in layer.rows]
    return out + [kv.fixed(i, s.name, slot).clone() for i, layer in enumerate(LAYOUT.layers) for s in layer.fixed]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                    for x, y in zip(a, b, strict=True))
