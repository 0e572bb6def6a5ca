"""KV rows in pages: one page id spans every layer's row states; a slot reads through its page table.

    page p, row state s of layer l:  pages[l][s][p] holds entries for page_rows rows ([page_rows / every, *shape])
    slot's row r lives in page table[r // page_rows] at offset r % page_rows
"""

from __future__ import annotations

import torch

from tensorfold.kernels.upload import ints
from tensorfold.kv.base import KvStore
from tensorfold.kv.journal import Bind, Fill
from tensorfold.layout import DTYPES, Layout


class PagedStore(KvStore):
    """Rows in `pages` pages of `page_rows` rows; the engine binds each slot's page table before its steps."""

    def __init__(self, layout: Layout, slots: int, pages: int, page_rows: int, device: torch.device | str = "cpu",
                 poison: bool = False) -> None:
        super().__init__(layout, slots, device, poison)
        for layer in layout.layers:
            for s in layer.rows:
                if page_rows % s.every:
                    raise ValueError(f"--page-rows {page_rows} is not a multiple of row state {s.name!r}'s every "
                                     f"{s.every}")
        self.pages = pages
        self.page_rows = page_rows
        self._pages: list[dict[str, torch.Tensor]] = [
            {s.name: torch.zeros((pages, page_rows // s.every, *s.shape), dtype=DTYPES[s.dtype], device=self.device)
             for s in layer.rows}
            for layer in layout.layers
        ]
        self._tables: list[torch.Tensor | None] = [None] * slots  # made from the host table when first read
        self._host_tables: list[tuple[int, ...]] = [()] * slots

    @property
    def page_bytes(self) -> int:
        """Bytes one page holds across every layer."""
        return sum(t[0].numel() * t.element_size() for layer in self._pages for t in layer.values())

    @property
    def nbytes(self) -> int:
        """Bytes of every page and the fixed states."""
        return self.pages * self.page_bytes + self.fixed_nbytes

    def bind(self, slot: int, table: list[int]) -> None:
        """Set the slot's page table (its pages in row order). Its device copy is made when a forward first reads
        it: a decode step that reads the host tables (engine/graphs.py) never waits for a copy."""
        if self.journal is not None:
            self.journal.append(Bind(slot, table))
        self._tables[slot] = None
        self._host_tables[slot] = tuple(table)

    def _table(self, slot: int) -> torch.Tensor:
        """The slot's page table on the device."""
        table = self._tables[slot]
        if table is None:
            table = self._tables[slot] = ints(self._host_tables[slot], torch.long, self.device)
        return table

    def host_table(self, slot: int) -> tuple[int, ...]:
        """The slot's page table as host ints (no device read)."""
        return self._host_tables[slot]

    def table_width(self, context: int) -> int:
        """Entries the widest table of a `context`-row stream has."""
        return max(1, -(-context // self.page_rows))

    def row_pages(self, layer: int, name: str) -> torch.Tensor:
        """The pages of one row state: [pages, page_rows / every, *shape]."""
        return self._state(self._pages, layer, name, "row")

    def tables(self, slots: list[int]) -> torch.Tensor:
        """The slots' page tables, padded with 0: int32 [len(slots), widest]."""
        width = max(1, max((len(self._host_tables[s]) for s in slots), default=0))
        padded = [v for s in slots for v in (*self._host_tables[s], *(0,) * (width - len(self._host_tables[s])))]
        return ints(padded, torch.int32, self.device).view(len(slots), width)

    def fill(self, pages: list[int]) -> None:
        """Poison freshly handed-out pages with NaN (TF_KV_POISON), so a read of an unwritten row shows."""
        if not pages:
            return
        if self.journal is not None:
            self.journal.append(Fill(pages))
        self.arrived()
        index = ints(pages, torch.long, self.device)
        for layer in self._pages:
            for state in layer.values():
                state[index] = float("nan") if state.dtype.is_floating_point else 0

    def rows(self, layer: int, name: str, slot: int, end: int) -> torch.Tensor:
        """Positions [0, end) gathered from the slot's pages into one tensor (a copy)."""
        state = self._state(self._pages, layer, name, "row")
        entries = end // self._every[layer][name]
        per_page = state.shape[1]
        used = -(-entries // per_page)
        table = self._table(slot)
        if used > table.numel():
            raise IndexError(f"slot {slot} reads {entries} entries of {name!r}; its {table.numel()} pages hold "
                             f"{table.numel() * per_page}")
        return state[table[:used]].reshape(used * per_page, *state.shape[2:])[:entries]

    def write_rows(self, layer: int, name: str, slot: int, start: int, values: torch.Tensor) -> None:
        """Scatter entries into the slot's pages."""
        state = self._state(self._pages, layer, name, "row")
        self._check(layer, name, values, state, entries=True)
        per_page = state.shape[1]
        table = self._table(slot)
        first = start // self._every[layer][name]
        last = first + values.shape[0] - 1                       # host ints: the bound check reads no device value
        if values.shape[0] and last // per_page >= table.numel():
            raise IndexError(f"slot {slot} writes {name!r} entry {last}; its {table.numel()} pages hold "
                             f"{table.numel() * per_page}")
        entry = torch.arange(values.shape[0], device=self.device) + first
        state[table[entry // per_page], entry % per_page] = values
