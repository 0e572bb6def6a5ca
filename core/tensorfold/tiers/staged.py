"""A kept state on its way to the disk (tiers/disk.py): host copies of its rows and fixed states, taken from a slot,
a device state or a host state, and the KvStore view image.read_out reads them through on the I/O thread."""

from __future__ import annotations

import attrs
import torch

from tensorfold.kv import KvStore, PagedStore
from tensorfold.layout import Layout
from tensorfold.memory import Claim
from tensorfold.tiers.states import HostState, KeptState, tensor_bytes

Copies = dict[tuple[int, str], torch.Tensor]


@attrs.frozen
class Staged:
    """A state waiting for the I/O thread: host copies of every row state's entries [0, at) and every fixed state,
    to be written under `partition` (tiers/policy.py)."""

    tokens: tuple[int, ...]
    cuts: tuple[int, ...]
    why: frozenset[str]
    rows: Copies = attrs.field(repr=False)
    fixed: Copies = attrs.field(repr=False)
    used: float | None = None       # unix time it was last used, for the store's LRU order; None: when written
    partition: str = ""

    @property
    def at(self) -> int:
        """Rows the state covers."""
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Host bytes its copies hold while it waits."""
        return sum(tensor_bytes(t) for part in (self.rows, self.fixed) for t in part.values())


class CopiesView:
    """The reads image.read_out makes of a KvStore, over one staged state's host copies (its only slot is 0)."""

    def __init__(self, layout: Layout, staged: Staged) -> None:
        self.layout = layout
        self.device = torch.device("cpu")
        self._staged = staged

    def rows(self, layer: int, name: str, slot: int, end: int) -> torch.Tensor:
        """Entries [0, end) of a row state."""
        every = next(s.every for s in self.layout.layers[layer].rows if s.name == name)
        return self._staged.rows[layer, name][: end // every]

    def fixed(self, layer: int, name: str, slot: int) -> torch.Tensor:
        """A fixed state."""
        return self._staged.fixed[layer, name]


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def from_slot(kv: KvStore, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...], why: frozenset[str],
              partition: str = "") -> Staged:
    """Host copies of the state a slot holds at `len(tokens)` (the end of its last step)."""
    at = len(tokens)
    rows = {(i, s.name): _host(kv.rows(i, s.name, claim.slot, at))
            for i, layer in enumerate(kv.layout.layers) for s in layer.rows}
    fixed = {(i, s.name): _host(kv.fixed(i, s.name, claim.slot))
             for i, layer in enumerate(kv.layout.layers) for s in layer.fixed}
    return Staged(tokens=tokens, cuts=cuts, why=frozenset(why), rows=rows, fixed=fixed, partition=partition)


def from_state(kv: KvStore, state: KeptState | HostState, used: float | None = None) -> Staged:
    """Host copies of a device state (its shared pages' rows and its copies) or a host state (its copies, not
    copied again: the host tier never changes them); `used` its last use, when not now."""
    if isinstance(state, HostState):
        rows = {(i, name): t for i, name, t in state.rows}
        fixed = {(i, name): t for i, name, t in state.fixed}
    else:
        specs = {(i, s.name): s for i, layer in enumerate(kv.layout.layers) for s in layer.rows}
        rows = {}
        for i, name, tail in state.tail:
            parts = []
            if state.pages and isinstance(kv, PagedStore):
                index = torch.tensor(state.pages, dtype=torch.long, device=kv.device)
                parts.append(kv.row_pages(i, name)[index].reshape(-1, *specs[i, name].shape))
            parts.append(tail)
            rows[i, name] = _host(torch.cat(parts)) if len(parts) > 1 else _host(tail)
        fixed = {(i, name): _host(t) for i, name, t in state.fixed}
    return Staged(tokens=state.tokens, cuts=state.cuts, why=state.why, rows=rows, fixed=fixed, used=used,
                  partition=state.partition)
