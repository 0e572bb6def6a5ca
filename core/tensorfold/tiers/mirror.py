"""Kept states at tensor-parallel size N > 1: rank 0's tiers decide, every follower mirrors their decisions on its
own part of each state (docs/architecture.md, "Tensor parallelism").

Rank 0's tiers record every operation that copies bytes to or from the store in the store's journal (kv/journal.py)
at the point it happens, among the store's own commands, each naming the state by a key of rank 0's; a follower
replays them in order against its own store and its own key → part map (`Mirror`), so each copy happens at the same
point relative to the store commands and steps as on rank 0. A follower's part holds its slice of the split states
and whole copies of the replicated ones (its own Layout). Nothing here decides: which state is kept, where, what
goes, what is promoted and what is restored, and every clock and rate, are rank 0's.

    HostSetup    the host tier's budget and copy pieces: the follower's arena and lane (once, at startup)
    Snap         a device keep: the slot's tail rows from `tail_start` and its fixed states copied (the full pages
                 are held by reference: the follower's pages are rank 0's, bound the same way)
    HostKeep     a host keep: the slot's rows [0, at) and fixed states copied out to host memory
    ToHost       a device state let go into the host tier: its pages' rows and copies copied out
    Restore      a device state put into a slot (after the claim's pages are bound)
    HostRestore  a host state put into a slot; with `promote`, the copies a promoted device state needs are made
    Adopt        the host restore just made is kept as a device state (promotion)
    Drop         a state let go for good (rank 0 evicted, forgot or refused it)
"""

from __future__ import annotations

import itertools

import attrs

from tensorfold.kv import KvStore
from tensorfold.tiers.arena import HostArena
from tensorfold.tiers.copy_out import kept_out, slot_pages_out
from tensorfold.tiers.host_restore import Promoted, restore_host
from tensorfold.tiers.lanes import Lane
from tensorfold.tiers.states import Copies, HostState, KeptState

_KEYS = itertools.count(1)


def new_key() -> int:
    """A key for a state rank 0 keeps, unique in this process."""
    return next(_KEYS)


def slot_copies(kv: KvStore, slot: int, at: int, tail_start: int) -> tuple[Copies, Copies]:
    """Device copies of a slot's row entries from row `tail_start` to `at` and of its fixed states."""
    tail = tuple((i, spec.name, kv.rows(i, spec.name, slot, at)[tail_start // spec.every:].clone())
                 for i, layer in enumerate(kv.layout.layers) for spec in layer.rows)
    fixed = tuple((i, spec.name, kv.fixed(i, spec.name, slot).clone())
                  for i, layer in enumerate(kv.layout.layers) for spec in layer.fixed)
    return tail, fixed


@attrs.frozen
class HostSetup:
    """The host tier exists: its budget (the follower's arena limit), copy pieces and startup reserve."""

    budget: int
    piece_bytes: int
    reserve: int


@attrs.frozen
class Snap:
    """A device keep of `slot` at `at`: its full `pages` held, copies from `tail_start` on."""

    key: int
    slot: int
    at: int
    pages: tuple[int, ...]
    tail_start: int


@attrs.frozen
class HostKeep:
    """A host keep of `slot` at `at` (`pages` its lease's pages; None without pages)."""

    key: int
    slot: int
    at: int
    pages: tuple[int, ...] | None


@attrs.frozen
class ToHost:
    """Device state `src` copied out into host state `dst`."""

    src: int
    dst: int


@attrs.frozen
class Restore:
    """Device state `key` put into `slot`."""

    key: int
    slot: int


@attrs.frozen
class HostRestore:
    """Host state `key` put into `slot` over `pages`; `promote` as tiers/host_restore.py takes it."""

    key: int
    slot: int
    pages: tuple[int, ...] | None
    promote: int | None


@attrs.frozen
class Adopt:
    """The last host restore's copies kept as device state `key` at `at` over full `pages`."""

    key: int
    at: int
    pages: tuple[int, ...]


@attrs.frozen
class Drop:
    """State `key` let go."""

    key: int


TierCommand = HostSetup | Snap | HostKeep | ToHost | Restore | HostRestore | Adopt | Drop
TIER_COMMANDS = (HostSetup, Snap, HostKeep, ToHost, Restore, HostRestore, Adopt, Drop)


class Mirror:
    """A follower's parts of rank 0's kept states, by rank 0's keys, over the follower's own store."""

    def __init__(self, kv: KvStore) -> None:
        self.kv = kv
        self.lane = Lane(kv.device)
        self.pin = kv.device.type == "cuda"
        self.arena: HostArena | None = None
        self.piece_bytes = 1
        self.parts: dict[int, KeptState | HostState] = {}
        self._promoted: Promoted | None = None

    def apply(self, command: TierCommand) -> None:
        """Do what rank 0's tier did, on this rank's part."""
        handler = getattr(self, f"_{type(command).__name__.lower()}")
        handler(command)

    def _hostsetup(self, c: HostSetup) -> None:
        self.arena = HostArena(self.pin, limit=c.budget + c.budget // 4)
        if self.pin:
            self.arena.reserve(min(c.budget, c.reserve))
        self.piece_bytes = c.piece_bytes

    def _snap(self, c: Snap) -> None:
        tail, fixed = slot_copies(self.kv, c.slot, c.at, c.tail_start)
        self.parts[c.key] = KeptState(tokens=(), at=c.at, cuts=(), pages=c.pages, tail_start=c.tail_start,
                                      tail=tail, fixed=fixed)

    def _hostkeep(self, c: HostKeep) -> None:
        pages = list(c.pages) if c.pages is not None else None
        out = slot_pages_out(self.kv, self.lane, self._arena(), c.slot, pages, c.at, self.piece_bytes)
        self._hold(c.key, HostState(tokens=(), at=c.at, cuts=(), rows=out.rows, fixed=out.fixed),
                   out.publish(self.kv, self._arena(), c.slot))

    def _tohost(self, c: ToHost) -> None:
        state = self.parts[c.src]
        out = kept_out(self.kv, self.lane, self._arena(), state, self.piece_bytes)
        self._hold(c.dst, HostState(tokens=(), at=state.at, cuts=(), rows=out.rows, fixed=out.fixed),
                   out.publish(self.kv, self._arena(), None))

    def _hold(self, key: int, state: HostState, landed: object | None) -> None:
        state.landed = landed
        self.parts[key] = state
        if self.pin:
            self._arena().ahead(state.nbytes)

    def _restore(self, c: Restore) -> None:
        state = self.parts[c.key]
        for i, name, tensor in state.fixed:
            self.kv.write_fixed(i, name, c.slot, tensor)
        for i, name, tensor in state.tail:
            if tensor.shape[0]:
                self.kv.write_rows(i, name, c.slot, state.tail_start, tensor)

    def _hostrestore(self, c: HostRestore) -> None:
        pages = list(c.pages) if c.pages is not None else None
        self._promoted, _ = restore_host(self.kv, self.lane, self._arena(), self.parts[c.key], c.slot, pages,
                                         c.promote, self.piece_bytes, self.pin)

    def _adopt(self, c: Adopt) -> None:
        made, self._promoted = self._promoted, None
        if made is None:
            raise RuntimeError(f"rank 0 adopted state {c.key} with no promoting host restore before it")
        self.parts[c.key] = KeptState(tokens=(), at=c.at, cuts=(), pages=c.pages, tail_start=made.tail_start,
                                      tail=made.tail, fixed=made.fixed)

    def _drop(self, c: Drop) -> None:
        self.parts.pop(c.key)

    def _arena(self) -> HostArena:
        if self.arena is None:
            raise RuntimeError("rank 0 sent a host-tier command before its HostSetup")
        return self.arena

    @property
    def nbytes(self) -> int:
        """Bytes this rank's parts copy (device tails and fixed states, host copies); pages are the store's."""
        return sum(p.copy_bytes if isinstance(p, KeptState) else p.nbytes for p in self.parts.values())

