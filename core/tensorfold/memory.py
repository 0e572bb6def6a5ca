"""Stream memory: a slot for fixed states and a page lease for rows, over one KvStore."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from tensorfold.kv import KvStore, PagedStore
from tensorfold.layout import Layout
from tensorfold.pool.pages import Lease, PagePool
from tensorfold.pool.slots import SlotPool


def has_rows(layout: Layout) -> bool:
    """Whether any layer declares a row state: only then does a stream need pages."""
    return any(layer.rows for layer in layout.layers)


@attrs.frozen
class Claim:
    """What one running stream holds: its slot and, with pages on, its lease."""

    slot: int
    lease: Lease | None


class StreamMemory:
    """Admission's view of memory: whether a stream fits, and taking and returning what it holds.

    A Layout without row states (a pure recurrent model: conv tails and SSM states only) has nothing to put in
    pages, so its streams lease none, its kept states hold none and nothing is evicted for them: the pool is
    dropped and a stream costs a slot alone."""

    def __init__(self, kv: KvStore, slots: SlotPool, pool: PagePool | None) -> None:
        if isinstance(kv, PagedStore) != (pool is not None):
            raise ValueError("a PagedStore needs a PagePool, a window store none")
        self.kv = kv
        self.slots = slots
        self.pool = pool if has_rows(kv.layout) else None

    def fits(self, rows: int, shared: int = 0, forks: Sequence[int] = ()) -> bool:
        """A free slot and, with pages on, the pages `rows` rows need beyond `shared` pages already held; with
        `forks` (each fork's rows: engine/forks.py), a slot and pages for each of them too, all at once."""
        if not forks:
            return self.slots.free > 0 and (self.pool is None or self.pool.fits(rows, shared))
        return self.slots.free > len(forks) and self.pages_needed(rows, shared, forks) <= self.available

    def pages_needed(self, rows: int, shared: int = 0, forks: Sequence[int] = ()) -> int:
        """New pages a stream of `rows` rows (its first `shared` pages held already) and its forks reserve."""
        if self.pool is None:
            return 0
        return self.pool.pages_for(rows) - shared + sum(self.pool.pages_for(fork) for fork in forks)

    @property
    def available(self) -> int:
        """Pages a new claim may reserve now (none needed without pages)."""
        return self.pool.available if self.pool is not None else 0

    def never_fits(self, rows: int, forks: Sequence[int]) -> str | None:
        """Why a stream and its forks could not run together even with nothing else running; None when they can."""
        if len(forks) + 1 > self.slots.count:
            return f"{len(forks) + 1} streams of one prompt need as many slots, this engine has {self.slots.count}"
        if self.pool is not None and self.pages_needed(rows, 0, forks) > self.pool.total:
            return (f"{len(forks) + 1} streams of one prompt need {self.pages_needed(rows, 0, forks)} pages, the "
                    f"pool has {self.pool.total}")
        return None

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

    def reset(self, claim: Claim) -> None:
        """Make a claim fresh again after a restore that failed part way: its pages given back (still reserved),
        its slot cleared (fixed states zeroed, a window poisoned when poison is on)."""
        if claim.lease is not None and self.pool is not None:
            self.pool.shrink(claim.lease, 0)
            if isinstance(self.kv, PagedStore):
                self.kv.bind(claim.slot, claim.lease.pages)
        self.kv.clear(claim.slot)

    def copy_state(self, src: Claim, dst: Claim, at: int) -> None:
        """Give `dst` the state `src` holds at row `at` (a fork of a stream at its prompt's end): every fixed state
        of its slot, and the entries of every row state for rows [0, at), in pages of its own (or its window)."""
        self.extend(dst, at)
        self.kv.copy_slot(src.slot, dst.slot, at)

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
