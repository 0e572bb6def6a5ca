"""A host state's copies put into a slot through a Lane (tiers/host.py `out`): rank 0's host tier restoring a hit,
and a follower mirroring that restore on its own part of the state (tiers/mirror.py), by the same code."""

from __future__ import annotations

import attrs
import torch

from tensorfold.kv import KvStore, PagedStore
from tensorfold.layout import DTYPES, RowState
from tensorfold.tiers.arena import HostArena
from tensorfold.tiers.lanes import Lane, Timer
from tensorfold.tiers.states import Copies, HostState


@attrs.frozen
class Promoted:
    """What a device state made from a host restore needs beyond the claim's pages: the copies of its partial last
    page's entries (from row `tail_start`) and of its fixed states, on the device."""

    tail_start: int
    tail: Copies
    fixed: Copies


def restore_host(kv: KvStore, lane: Lane, arena: HostArena, state: HostState, slot: int, pages: list[int] | None,
                 promote: int | None, piece_bytes: int, pin: bool) -> tuple[Promoted | None, Timer]:
    """Copy a host state into `slot` (rows [0, at) into `pages`, already bound; None without pages), per layer on
    the lane, each layer's end marked for the compute stream (tiers/host.py); with `promote` (the device tier's
    page rows, 0 without pages) also the device copies a promoted device state needs. Returns them and the Timer."""
    pages = pages if isinstance(kv, PagedStore) else None
    rows = {(i, name): host for i, name, host in state.rows}
    fixed = {(i, name): host for i, name, host in state.fixed}
    tail_start = state.at // promote * promote if promote else 0
    tail, fixed_copies, marks = [], [], []
    with lane.copying(), kv.aside():
        timer = lane.timer()
        index = lane.index(pages) if pages else None
        for i, layer in enumerate(kv.layout.layers):
            for spec in layer.fixed:
                kv.write_fixed(i, spec.name, slot, fixed[i, spec.name], non_blocking=pin)
                if promote is not None:
                    copy = kv.fixed(i, spec.name, slot).clone()
                    fixed_copies.append((i, spec.name, lane.share(copy)))
            for spec in layer.rows:
                _put(kv, lane, slot, i, spec, rows[i, spec.name], pages, index, piece_bytes, pin)
                if promote is not None:
                    copy = _tail(kv, slot, i, spec, state.at, tail_start, pages)
                    tail.append((i, spec.name, lane.share(copy)))
            marks.append((i, lane.mark()))
        timer.stop()
    for i, mark in marks:
        if mark is not None:
            kv.arriving(i, mark, slot)
    if marks and marks[-1][1] is not None:
        arena.fence(host_tensors(state), marks[-1][1])   # dropped meanwhile, its memory waits for the copies
    if promote is None:
        return None, timer
    return Promoted(tail_start=tail_start, tail=tuple(tail), fixed=tuple(fixed_copies)), timer


def host_tensors(state: HostState) -> list[torch.Tensor]:
    """Every host tensor of a state."""
    return [tensor for part in (state.rows, state.fixed) for _, _, tensor in part]


def _tail(kv: KvStore, slot: int, layer: int, spec: RowState, at: int, tail_start: int,
          pages: list[int] | None) -> torch.Tensor:
    """A device copy of the slot's entries of one row state from row `tail_start` to `at` (on the copy stream,
    after its restore): the partial last page's, or every entry without pages."""
    first, end = tail_start // spec.every, spec.entries(at)
    if pages is None:
        return kv.rows(layer, spec.name, slot, at)[first:].clone()
    per_page = kv.page_rows // spec.every
    if end == first:
        return torch.empty((0, *spec.shape), dtype=DTYPES[spec.dtype], device=kv.device)
    return kv.row_pages(layer, spec.name)[pages[first // per_page], : end - first].clone()


def _put(kv: KvStore, lane: Lane, slot: int, layer: int, spec: RowState, host: torch.Tensor,
         pages: list[int] | None, index: torch.Tensor | None, piece_bytes: int, pin: bool) -> None:
    """Entries [0, len(host)) of one row state into the slot: whole pages in pieces of up to `piece_bytes`, each
    one copy to the device and one index_copy_ into the pages; then the partial last page in place."""
    entries = host.shape[0]
    if not entries:
        return
    if pages is None:
        step = max(1, piece_bytes // spec.entry_bytes)
        for first in range(0, entries, step):
            piece = lane.to_device(host[first: first + step])
            kv.write_rows(layer, spec.name, slot, first * spec.every, piece)
        return
    per_page = kv.page_rows // spec.every
    if -(-entries // per_page) > len(pages):
        raise IndexError(f"a restore writes {spec.name!r} entry {entries - 1}; the claim's {len(pages)} pages "
                         f"hold {len(pages) * per_page}")
    target = kv.row_pages(layer, spec.name)
    full = entries // per_page
    step = max(1, piece_bytes // (per_page * spec.entry_bytes))
    for first in range(0, full, step):
        count = min(step, full - first)
        piece = lane.to_device(host[first * per_page: (first + count) * per_page])
        target.index_copy_(0, index[first: first + count], piece.view(count, per_page, *spec.shape))
    if entries > full * per_page:
        target[pages[full], : entries - full * per_page].copy_(host[full * per_page:], non_blocking=pin)
