"""The interface a family's forward uses, and the fixed states every store holds per slot."""

from __future__ import annotations

import torch

from tensorfold.layout import DTYPES, Layout


class KvStore:
    """Row states by slot and position, fixed states by slot, as the Layout declares them.

    A family touches memory only through `rows`, `write_rows` and `fixed`, so the storage behind them (one window
    per slot, or pages) changes without the family knowing. Subclasses own the rows; this class the fixed states.
    """

    def __init__(self, layout: Layout, slots: int, device: torch.device | str = "cpu", poison: bool = False) -> None:
        self.layout = layout
        self.slots = slots
        self.device = torch.device(device)
        self.poison = poison
        self._fixed: list[dict[str, torch.Tensor]] = [
            {s.name: torch.zeros((slots, *s.shape), dtype=DTYPES[s.dtype], device=self.device) for s in layer.fixed}
            for layer in layout.layers
        ]
        self._every = [{s.name: s.every for s in layer.rows} for layer in layout.layers]

    def rows(self, layer: int, name: str, slot: int, end: int) -> torch.Tensor:
        """The entries of a row state for positions [0, end): [entries, *shape]."""
        raise NotImplementedError

    def write_rows(self, layer: int, name: str, slot: int, start: int, values: torch.Tensor) -> None:
        """Store entries from entry index `start // every` on; the caller writes only complete entries."""
        raise NotImplementedError

    def fixed(self, layer: int, name: str, slot: int) -> torch.Tensor:
        """A fixed state of one slot, as a view the family updates in place."""
        return self._fixed[layer][name][slot]

    def fixed_states(self, layer: int, name: str) -> torch.Tensor:
        """Every slot's fixed state [slots, *shape], for kernels that index it by slot."""
        return self._fixed[layer][name]

    def row_pages(self, layer: int, name: str) -> torch.Tensor:
        """A row state's storage as pages [pages, entries per page, *shape], for kernels that read through tables."""
        raise NotImplementedError

    def tables(self, slots: list[int]) -> torch.Tensor:
        """The slots' page tables, padded with 0 to one width: int32 [len(slots), width]."""
        raise NotImplementedError

    def host_table(self, slot: int) -> tuple[int, ...]:
        """The slot's page table as host ints, for building a step's tables without reading the device."""
        raise NotImplementedError

    def table_width(self, context: int) -> int:
        """Entries the widest page table of a `context`-row stream has."""
        raise NotImplementedError

    def clear(self, slot: int) -> None:
        """Ready a slot for a new stream: its fixed states zeroed."""
        for layer in self._fixed:
            for state in layer.values():
                state[slot].zero_()

    @property
    def fixed_nbytes(self) -> int:
        """Bytes of every slot's fixed states."""
        return sum(t.numel() * t.element_size() for layer in self._fixed for t in layer.values())

    @property
    def nbytes(self) -> int:
        """Bytes this store holds on its device."""
        raise NotImplementedError

    def _check(self, layer: int, name: str, values: torch.Tensor, state: torch.Tensor) -> None:
        if values.dtype != state.dtype:
            raise TypeError(f"layer {layer} {name}: the Layout declares {state.dtype}, the family wrote {values.dtype}")
