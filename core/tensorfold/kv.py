"""Where streams' declared states live: the reference layout, one contiguous window of rows per slot."""

from __future__ import annotations

import torch

from tensorfold.layout import DTYPES, Layout


class KvStore:
    """Holds every slot's row and fixed states as the Layout declares them; families read and write through it.

    The window is contiguous per slot (the reference layout). A family touches memory only through `rows`,
    `write_rows` and `fixed`, so the store behind them can change (pages) without the family knowing.
    """

    def __init__(self, layout: Layout, slots: int, capacity: int, device: torch.device | str = "cpu",
                 poison: bool = False) -> None:
        self.layout = layout
        self.slots = slots
        self.capacity = capacity
        self.device = torch.device(device)
        self.poison = poison
        self._rows: list[dict[str, torch.Tensor]] = []
        self._fixed: list[dict[str, torch.Tensor]] = []
        for layer in layout.layers:
            self._rows.append({
                s.name: torch.zeros((slots, s.entries(capacity), *s.shape), dtype=DTYPES[s.dtype], device=self.device)
                for s in layer.rows
            })
            self._fixed.append({
                s.name: torch.zeros((slots, *s.shape), dtype=DTYPES[s.dtype], device=self.device)
                for s in layer.fixed
            })

    @property
    def nbytes(self) -> int:
        """Bytes this store holds on its device."""
        tensors = [t for layer in self._rows + self._fixed for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def rows(self, layer: int, name: str, slot: int, end: int) -> torch.Tensor:
        """The entries of a row state for positions [0, end): a view, [entries, *shape]."""
        state = self._rows[layer][name]
        return state[slot, : self._entries(layer, name, end)]

    def write_rows(self, layer: int, name: str, slot: int, start: int, values: torch.Tensor) -> None:
        """Store entries from entry index `start // every` on; the caller writes only complete entries."""
        state = self._rows[layer][name]
        if values.dtype != state.dtype:
            raise TypeError(f"layer {layer} {name}: the Layout declares {state.dtype}, the family wrote {values.dtype}")
        first = start // self._every(layer, name)
        if first + values.shape[0] > state.shape[1]:
            raise IndexError(f"layer {layer} {name}: entries up to {first + values.shape[0]} exceed the window "
                             f"of {state.shape[1]}")
        state[slot, first: first + values.shape[0]] = values

    def fixed(self, layer: int, name: str, slot: int) -> torch.Tensor:
        """A fixed state of one slot, as a view the family updates in place."""
        return self._fixed[layer][name][slot]

    def clear(self, slot: int) -> None:
        """Ready a slot for a new stream: fixed states zeroed, rows poisoned with NaN when poison is on."""
        for layer in self._fixed:
            for state in layer.values():
                state[slot].zero_()
        if self.poison:
            for layer in self._rows:
                for state in layer.values():
                    state[slot].fill_(float("nan") if state.dtype.is_floating_point else 0)

    def _every(self, layer: int, name: str) -> int:
        return next(s.every for s in self.layout.layers[layer].rows if s.name == name)

    def _entries(self, layer: int, name: str, end: int) -> int:
        return end // self._every(layer, name)
