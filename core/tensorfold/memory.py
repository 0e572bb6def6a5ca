"""Stream memory: a slot for fixed states and a page lease for rows, over one KvStore."""

from __future__ import annotations

import attrs

from tensorfold.kv import KvStore, PagedStore
from tensorfold.pool.pages import Lease, PagePool
from tensorfold.pool.slots import SlotPool


@attrs.frozen
class Claim:
    """What one running stream holds: its slot and, with pages on, its lease."""

    slot: int
    lease: Lease | None


class StreamMemory:
    """Admission's view of memory: whether a stream fits, and taking and returning what it holds."""

    def __init__(self, kv: KvStore, slots: SlotPool, pool: PagePool | None) -> None:
        if isinstance(kv, PagedStore) != (pool is not None):
            raise ValueError("a PagedStore needs a PagePool, a window store none")
        self.kv = kv
        self.slots = slots
        self.pool = pool

    def fits(self, rows: int, shared: int = 0) -> bool:
        """A free slot and, with pages on, the pages `rows` rows need beyond `shared` pages already held."""
        return self.slots.free > 0 and (self.pool is None or self.pool.fits(rows, shared))

    def take(self, owner: str, rows: int, shared: tuple[int, ...] = ()) -> Claim:
        """Reserve a slot and the pages of `rows` rows, the first of them `shared` (a kept state's full pages,
        read only); the slot's fixed states start at zero."""
        lease = self.pool.lease(owner, rows, shared) if self.pool is not None else None
        slot = self.slots.take()
        self.kv.clear(slot)
        if shared and isinstance(self.kv, PagedStore):
            self.kv.bind(slot, lease.pages)
        return Claim(slot, lease)

    def extend(self, claim: Claim, end: int) -> None:
        """Make rows [0, end) writable: take the pages they need and bind the slot's table."""
        if claim.lease is None or self.pool is None:
            return
        taken = self.pool.grow(claim.lease, end)
        if taken:
            if self.kv.poison:
                self.kv.fill(taken)
            self.kv.bind(claim.slot, claim.lease.pages)

    def release(self, claim: Claim) -> None:
        """Return the slot and every page."""
        if claim.lease is not None and self.pool is not None:
            self.pool.release(claim.lease)
        self.slots.give(claim.slot)

    def check_integrity(self) -> None:
        """The pool's accounting adds up (and slots are all returned when nothing runs)."""
        if self.pool is not None:
            self.pool.check_integrity()

    def snapshot(self) -> dict[str, int]:
        """Numbers for /memory."""
        out = {"slots": self.slots.count, "slots_free": self.slots.free, "kv_bytes": self.kv.nbytes}
        if self.pool is not None:
            out |= self.pool.snapshot()
        return out
