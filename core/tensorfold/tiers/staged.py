"""A kept state on its way to the disk (tiers/disk.py): host copies of its rows and fixed states, taken from a slot,
a device state or a host state, and the KvStore view image.read_out reads them through on the I/O thread. Copies out
of the device go into the disk tier's arena through its Lane (tiers/copy_out.py), so staging a state allocates no
host memory and the step that stages it never waits; the I/O thread waits for them to land (`settle`)."""

from __future__ import annotations

import attrs
import torch

from tensorfold.kv import KvStore, PagedStore
from tensorfold.layout import Layout
from tensorfold.memory import Claim
from tensorfold.tiers.arena import HostArena
from tensorfold.tiers.copy_out import kept_out, slot_pages_out
from tensorfold.tiers.lanes import Lane
from tensorfold.tiers.states import HostState, KeptState, tensor_bytes

PIECE_BYTES = 64 * 2**20   # the largest gather of pages on the device before it is copied out

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
    landed: object | None = attrs.field(default=None, repr=False)   # on CUDA: its copies are done at this event

    @property
    def at(self) -> int:
        """Rows the state covers."""
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Host bytes its copies hold while it waits."""
        return sum(tensor_bytes(t) for part in (self.rows, self.fixed) for t in part.values())

    def settle(self) -> None:
        """Wait until its copies have landed, before the I/O thread reads them."""
        if self.landed is not None:
            self.landed.synchronize()


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


def from_slot(kv: KvStore, lane: Lane, arena: HostArena, claim: Claim, tokens: tuple[int, ...],
              cuts: tuple[int, ...], why: frozenset[str], partition: str = "",
              piece_bytes: int = PIECE_BYTES) -> Staged:
    """Host copies of the state a slot holds at `len(tokens)` (the end of its last step), copied out on the lane
    (tiers/copy_out.py: the host never waits; the I/O thread waits for `landed`)."""
    pages = claim.lease.pages if isinstance(kv, PagedStore) and claim.lease is not None else None
    return from_pages(kv, lane, arena, claim.slot, pages, tokens, cuts, why, partition, piece_bytes)


def from_pages(kv: KvStore, lane: Lane, arena: HostArena, slot: int, pages: list[int] | None,
               tokens: tuple[int, ...], cuts: tuple[int, ...], why: frozenset[str], partition: str = "",
               piece_bytes: int = PIECE_BYTES) -> Staged:
    """`from_slot` over the slot's `pages` (None: a window store): a follower, which holds no leases, names them."""
    out = slot_pages_out(kv, lane, arena, slot, pages, len(tokens), piece_bytes)
    return Staged(tokens=tokens, cuts=cuts, why=frozenset(why), rows=_by_name(out.rows), fixed=_by_name(out.fixed),
                  partition=partition, landed=out.publish(kv, arena, slot))


def from_state(kv: KvStore, lane: Lane, arena: HostArena, state: KeptState | HostState, used: float | None = None,
               piece_bytes: int = PIECE_BYTES) -> Staged:
    """Host copies of a device state (its shared pages' rows and its copies, copied out on the lane) or a host
    state (its copies, not copied again: the host tier never changes them); `used` its last use, when not now."""
    if isinstance(state, HostState):
        return Staged(tokens=state.tokens, cuts=state.cuts, why=state.why, rows=_by_name(state.rows),
                      fixed=_by_name(state.fixed), used=used, partition=state.partition, landed=state.landed)
    out = kept_out(kv, lane, arena, state, piece_bytes)
    return Staged(tokens=state.tokens, cuts=state.cuts, why=state.why, rows=_by_name(out.rows),
                  fixed=_by_name(out.fixed), used=used, partition=state.partition,
                  landed=out.publish(kv, arena, None))


def _by_name(copies: tuple[tuple[int, str, torch.Tensor], ...]) -> Copies:
    return {(i, name): tensor for i, name, tensor in copies}
