"""A state copied out of the device into host memory carved from an arena (tiers/arena.py), through a Lane
(tiers/lanes.py): the host tier keeping a state, the disk tier staging one. The same code on the CPU and on CUDA.

    slot    the state a slot holds at `at`: per layer, each row state's whole pages gathered on the copy stream in
            pieces of up to `piece_bytes` and copied out, the partial last page straight from its page (without
            pages, the slot's rows as the store reads them); its fixed states straight from the slot
    kept    a device tier's state: its pages the same way, its tail and fixed copies straight (held for the copy
            stream, as the device tier drops them once they are copied)

On CUDA the copies are queued after the compute stream's work so far and the host never waits: each layer's end is
marked, the store's reader waits for the mark before it next touches that layer (kv/base.py `arriving`: no step
overwrites a page or a fixed state still being copied out, however soon the stream ends and its pages go to another),
the host memory is fenced with the last mark (a copy that is dropped comes back to the arena only once it has
landed), and the last mark is what a reader on the host waits for (`landed`).
"""

from __future__ import annotations

import attrs
import torch

from tensorfold.kv import KvStore, PagedStore
from tensorfold.layout import DTYPES, RowState
from tensorfold.memory import Claim
from tensorfold.tiers.arena import HostArena
from tensorfold.tiers.lanes import Lane
from tensorfold.tiers.states import Copies, KeptState


@attrs.frozen
class CopiedOut:
    """Host copies of every row state's entries [0, at) and every fixed state, in layer order, and each layer's
    mark (None on the CPU: the copies are done)."""

    rows: Copies
    fixed: Copies
    marks: tuple[tuple[int, object | None], ...]

    @property
    def landed(self) -> object | None:
        """The last mark: every copy is done once it has passed."""
        return self.marks[-1][1] if self.marks else None

    def publish(self, kv: KvStore, arena: HostArena, slot: int | None) -> object | None:
        """The store's reader waits for each layer's copies, and the arena's memory for the last; returns it."""
        for layer, mark in self.marks:
            if mark is not None:
                kv.arriving(layer, mark, slot)
        if self.landed is not None:
            arena.fence([tensor for part in (self.rows, self.fixed) for _, _, tensor in part], self.landed)
        return self.landed


def slot_out(kv: KvStore, lane: Lane, arena: HostArena, claim: Claim, at: int, piece_bytes: int) -> CopiedOut:
    """The state `claim`'s slot holds at `at` (the end of its last step), copied out (module docstring)."""
    pages = claim.lease.pages if isinstance(kv, PagedStore) and claim.lease is not None else None
    return slot_pages_out(kv, lane, arena, claim.slot, pages, at, piece_bytes)


def slot_pages_out(kv: KvStore, lane: Lane, arena: HostArena, slot: int, pages: list[int] | None, at: int,
                   piece_bytes: int) -> CopiedOut:
    """The state `slot` holds at `at` over `pages` (None: a window store), copied out (module docstring)."""
    pages = pages if isinstance(kv, PagedStore) else None
    rows, fixed, marks = [], [], []
    hosts = iter(_carve(kv, arena, at))
    with lane.copying(), kv.aside():
        full = at // kv.page_rows if pages else 0
        index = lane.index(pages[:full]) if full else None
        for i, layer in enumerate(kv.layout.layers):
            for spec in layer.rows:
                host = next(hosts)
                entries = host.shape[0]
                if pages is None:
                    if entries:
                        lane.to_host(host, kv.rows(i, spec.name, slot, at))
                else:
                    per_page = kv.page_rows // spec.every
                    target = kv.row_pages(i, spec.name)
                    if full:
                        _gather(lane, target, index, host[: full * per_page], spec, piece_bytes)
                    if entries > full * per_page:
                        lane.to_host(host[full * per_page:], target[pages[full], : entries - full * per_page])
                rows.append((i, spec.name, host))
            for spec in layer.fixed:
                host = next(hosts)
                lane.to_host(host, kv.fixed(i, spec.name, slot))
                fixed.append((i, spec.name, host))
            marks.append((i, lane.mark()))
    return CopiedOut(rows=tuple(rows), fixed=tuple(fixed), marks=tuple(marks))


def kept_out(kv: KvStore, lane: Lane, arena: HostArena, state: KeptState, piece_bytes: int) -> CopiedOut:
    """A device tier's state (its pages' rows, its tail and fixed copies), copied out (module docstring)."""
    tails = {(i, name): tail for i, name, tail in state.tail}
    kept = {(i, name): tensor for i, name, tensor in state.fixed}
    rows, fixed, marks = [], [], []
    hosts = iter(_carve(kv, arena, state.at))
    with lane.copying(), kv.aside():
        index = lane.index(state.pages) if state.pages and isinstance(kv, PagedStore) else None
        for i, layer in enumerate(kv.layout.layers):
            for spec in layer.rows:
                host = next(hosts)
                full = state.tail_start // spec.every
                if index is not None:
                    _gather(lane, kv.row_pages(i, spec.name), index, host[:full], spec, piece_bytes)
                tail = tails[i, spec.name]
                if tail.shape[0]:
                    lane.to_host(host[full:], tail, keep=True)
                rows.append((i, spec.name, host))
            for spec in layer.fixed:
                host = next(hosts)
                lane.to_host(host, kept[i, spec.name], keep=True)
                fixed.append((i, spec.name, host))
            marks.append((i, lane.mark()))
    return CopiedOut(rows=tuple(rows), fixed=tuple(fixed), marks=tuple(marks))


def _carve(kv: KvStore, arena: HostArena, at: int) -> list[torch.Tensor]:
    """One state's host tensors, as one run of the arena: per layer, its row states' entries [0, at) then its fixed
    states."""
    specs = []
    for layer in kv.layout.layers:
        specs += [((spec.entries(at), *spec.shape), DTYPES[spec.dtype]) for spec in layer.rows]
        specs += [(tuple(spec.shape), DTYPES[spec.dtype]) for spec in layer.fixed]
    return arena.empty_many(specs)


def _gather(lane: Lane, target: torch.Tensor, index: torch.Tensor, host: torch.Tensor, spec: RowState,
            piece_bytes: int) -> None:
    """Whole pages `index` of one row state into `host`: per piece of up to `piece_bytes`, a gather on the device
    (made on the copy stream) and one copy out."""
    per_page = target.shape[1]
    full = host.shape[0] // per_page
    step = max(1, piece_bytes // (per_page * spec.entry_bytes))
    for first in range(0, full, step):
        count = min(step, full - first)
        piece = target.index_select(0, index[first: first + count])
        lane.to_host(host[first * per_page: (first + count) * per_page].view(count, per_page, *spec.shape), piece)
