"""The interface a family's forward uses, and the fixed states every store holds per slot."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from tensorfold.kv.journal import Clear, Command, Copy
from tensorfold.layout import DTYPES, Layout


class Arrival(Protocol):
    """Copies into or out of one layer queued on another stream: `wait` makes the current stream wait for them."""

    def wait(self) -> None:
        """Queue a wait for the copies on the current stream (never a host wait)."""
        ...


class UndeclaredState(KeyError):
    """A family asked for a state its Layout does not declare; the message names the layer and what it declares."""

    def __str__(self) -> str:
        return str(self.args[0])


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
        self.journal: list[Command] | None = None  # rank 0 of a TP world: what a follower replays (kv/journal.py)
        self._arrivals: dict[int, list[Arrival]] = {}  # layer -> the copies its states wait for (tiers/lanes.py)
        self._arriving_slots: set[int] = set()         # the slots those copies touch (until `arrived` empties both)
        self._aside = 0                                # inside `aside`: accesses wait, and leave the waits queued

    def rows(self, layer: int, name: str, slot: int, end: int) -> torch.Tensor:
        """The entries of a row state for positions [0, end): [entries, *shape]."""
        raise NotImplementedError

    def write_rows(self, layer: int, name: str, slot: int, start: int, values: torch.Tensor) -> None:
        """Store entries from entry index `start // every` on; the caller writes only complete entries."""
        raise NotImplementedError

    def fixed(self, layer: int, name: str, slot: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fixed state of one slot, as a view the family updates in place; with `dtype`, the dtype the family
        computes it in, so a Layout declaring another one fails here, named, rather than deep in the family."""
        return self.fixed_states(layer, name, dtype)[slot]

    def fixed_states(self, layer: int, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every slot's fixed state [slots, *shape], for kernels that index it by slot (`dtype` as in `fixed`)."""
        state = self._state(self._fixed, layer, name, "fixed")
        if dtype is not None and dtype != state.dtype:
            raise TypeError(f"layer {layer} {name}: the Layout declares {state.dtype}, the family reads it as {dtype}")
        return state

    def write_fixed(self, layer: int, name: str, slot: int, values: torch.Tensor, non_blocking: bool = False) -> None:
        """Replace a slot's fixed state with `values` of its declared dtype and shape (never a silent cast)."""
        state = self._state(self._fixed, layer, name, "fixed")
        self._check(layer, name, values, state)
        if tuple(values.shape) != tuple(state.shape[1:]):
            raise ValueError(f"layer {layer} {name}: the Layout declares shape {tuple(state.shape[1:])}, the family "
                             f"wrote {tuple(values.shape)}")
        state[slot].copy_(values, non_blocking=non_blocking)

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

    def arriving(self, layer: int, arrival: Arrival, slot: int | None = None) -> None:
        """A layer's states (of `slot`, or pages no slot holds any more) are being written or read by copies queued
        on another stream: the next read or write of that layer through this store first makes its own stream wait
        for them (`arrival.wait()`, a device wait)."""
        self._arrivals.setdefault(layer, []).append(arrival)
        if slot is not None:
            self._arriving_slots.add(slot)

    def arrived(self) -> None:
        """Make the current stream wait for every copy still arriving (before work that bypasses the accessors)."""
        while self._arrivals:
            for arrival in self._arrivals.popitem()[1]:
                arrival.wait()
        self._arriving_slots.clear()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Accesses from a copy stream (tiers/lanes.py): each makes that stream wait for the layer's copies and leaves
        them queued for the stream that runs the steps."""
        self._aside += 1
        try:
            yield
        finally:
            self._aside -= 1

    @property
    def arriving_layers(self) -> tuple[int, ...]:
        """Layers whose copies no access has waited for yet."""
        return tuple(sorted(self._arrivals))

    def clear(self, slot: int) -> None:
        """Ready a slot for a new stream: its fixed states zeroed (after the copies still arriving into it)."""
        if slot in self._arriving_slots:
            self.arrived()
        if self.journal is not None:
            self.journal.append(Clear(slot))
        for layer in self._fixed:
            for state in layer.values():
                state[slot].zero_()

    def copy_slot(self, src: int, dst: int, at: int) -> None:
        """Give slot `dst` what slot `src` holds at row `at`: every fixed state, and the entries of every row state
        for rows [0, at) (dst's table must cover them)."""
        if self.journal is not None:
            self.journal.append(Copy(src, dst, at))
        for i, layer in enumerate(self.layout.layers):
            for spec in layer.fixed:
                self.write_fixed(i, spec.name, dst, self.fixed(i, spec.name, src))
            for spec in layer.rows:
                entries = self.rows(i, spec.name, src, at)
                if entries.shape[0]:
                    self.write_rows(i, spec.name, dst, 0, entries)

    def bind(self, slot: int, table: list[int]) -> None:
        """Set the slot's page table (a store without pages has none to set)."""

    def fill(self, pages: list[int]) -> None:
        """Poison pages (a store without pages has none)."""

    @property
    def fixed_nbytes(self) -> int:
        """Bytes of every slot's fixed states."""
        return sum(t.numel() * t.element_size() for layer in self._fixed for t in layer.values())

    @property
    def nbytes(self) -> int:
        """Bytes this store holds on its device."""
        raise NotImplementedError

    def _check(self, layer: int, name: str, values: torch.Tensor, state: torch.Tensor, entries: bool = False) -> None:
        """Values of the declared dtype (and, for row entries, of the declared entry shape), or a named error."""
        if values.dtype != state.dtype:
            raise TypeError(f"layer {layer} {name}: the Layout declares {state.dtype}, the family wrote {values.dtype}")
        if entries and tuple(values.shape[1:]) != tuple(state.shape[2:]):
            raise ValueError(f"layer {layer} {name}: the Layout declares entries of shape {tuple(state.shape[2:])}, "
                             f"the family wrote [{values.shape[0]}, *{tuple(values.shape[1:])}]")

    def _state(self, states: list[dict[str, torch.Tensor]], layer: int, name: str, kind: str) -> torch.Tensor:
        """A declared state's tensor, or an error naming the layer and the states it does declare; the first access
        to a layer whose copies are arriving waits for them (on the device)."""
        if self._arrivals and layer in self._arrivals:
            for arrival in self._arrivals[layer] if self._aside else self._arrivals.pop(layer):
                arrival.wait()
        if not 0 <= layer < len(states):
            raise IndexError(f"layer {layer}: the Layout declares {len(states)} layers (0 .. {len(states) - 1})")
        found = states[layer].get(name)
        if found is None:
            declared = self.layout.layers[layer]
            raise UndeclaredState(
                f"layer {layer} ({declared.kind}) declares no {kind} state {name!r}: its fixed states are "
                f"{[s.name for s in declared.fixed]}, its row states {[s.name for s in declared.rows]} "
                "(family_kv_layout)")
        return found
