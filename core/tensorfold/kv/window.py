"""The reference layout: one contiguous window of rows per slot (`TF_KV_PAGES=0`)."""

from __future__ import annotations

import torch

from tensorfold.kernels.upload import ints
from tensorfold.kv.base import KvStore
from tensorfold.layout import DTYPES, Layout


class WindowStore(KvStore):
    """Every slot owns `capacity` rows of every row state, whether it uses them or not."""

    def __init__(self, layout: Layout, slots: int, capacity: int, device: torch.device | str = "cpu",
                 poison: bool = False) -> None:
        super().__init__(layout, slots, device, poison)
        self.capacity = capacity
        self._rows: list[dict[str, torch.Tensor]] = [
            {s.name: torch.zeros((slots, s.entries(capacity), *s.shape), dtype=DTYPES[s.dtype], device=self.device)
             for s in layer.rows}
            for layer in layout.layers
        ]

    @property
    def nbytes(self) -> int:
        """Bytes of the windows and the fixed states."""
        rows = sum(t.numel() * t.element_size() for layer in self._rows for t in layer.values())
        return rows + self.fixed_nbytes

    def rows(self, layer: int, name: str, slot: int, end: int) -> torch.Tensor:
        """A view of the slot's window, positions [0, end)."""
        return self._state(self._rows, layer, name, "row")[slot, : end // self._every[layer][name]]

    def write_rows(self, layer: int, name: str, slot: int, start: int, values: torch.Tensor) -> None:
        """Store entries into the slot's window."""
        state = self._state(self._rows, layer, name, "row")
        self._check(layer, name, values, state, entries=True)
        first = start // self._every[layer][name]
        if first + values.shape[0] > state.shape[1]:
            raise IndexError(f"layer {layer} {name}: entries up to {first + values.shape[0]} exceed the window "
                             f"of {state.shape[1]}")
        state[slot, first: first + values.shape[0]] = values

    def row_pages(self, layer: int, name: str) -> torch.Tensor:
        """Each slot's window is one page: [slots, capacity entries, *shape]."""
        return self._state(self._rows, layer, name, "row")

    def tables(self, slots: list[int]) -> torch.Tensor:
        """Slot s reads page s."""
        return ints(slots, torch.int32, self.device).view(-1, 1)

    def host_table(self, slot: int) -> tuple[int, ...]:
        """Slot s's one page, as a host int."""
        return (slot,)

    def table_width(self, context: int) -> int:
        """One page per slot."""
        return 1

    def clear(self, slot: int) -> None:
        """Fixed states zeroed; with poison on, the window filled with NaN so a stale read shows."""
        super().clear(slot)
        if self.poison:
            for layer in self._rows:
                for state in layer.values():
                    state[slot].fill_(float("nan") if state.dtype.is_floating_point else 0)
