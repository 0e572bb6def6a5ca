"""The page pool: KV rows live in pages of a fixed row count; a stream leases the pages it can reach up front.

    total pages = free + held by leases + held by kept states
    a lease reserves `reserved` pages at admission and takes them from the free list as its rows grow,
    so a running stream never fails for memory: admission fails instead, and the request waits.
"""

from __future__ import annotations

import attrs


class PoolExhausted(Exception):
    """Not enough unreserved pages for a lease; the caller waits or refuses."""


class PoolCorrupt(AssertionError):
    """The pool's accounting does not add up; the message carries the numbers."""


@attrs.define
class Lease:
    """One stream's claim: up to `reserved` pages, of which `pages` are taken, in row order."""

    owner: str
    reserved: int
    pages: list[int] = attrs.field(factory=list)

    @property
    def untaken(self) -> int:
        """Reserved pages not yet taken from the free list."""
        return self.reserved - len(self.pages)


class PagePool:
    """Hands out page ids; owns no tensors (the KvStore does), only the accounting."""

    def __init__(self, total: int, page_rows: int) -> None:
        if total < 1 or page_rows < 1:
            raise ValueError(f"a pool needs pages and rows per page, got {total} pages of {page_rows} rows")
        self.total = total
        self.page_rows = page_rows
        self._free = list(range(total - 1, -1, -1))
        self._leases: dict[str, Lease] = {}
        self._kept: dict[int, int] = {}

    def pages_for(self, rows: int) -> int:
        """Pages that hold `rows` rows."""
        return -(-rows // self.page_rows)

    @property
    def free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def available(self) -> int:
        """Free pages no lease has reserved: what a new lease may take."""
        return len(self._free) - sum(lease.untaken for lease in self._leases.values())

    @property
    def leased(self) -> int:
        """Pages taken by leases."""
        return sum(len(lease.pages) for lease in self._leases.values())

    def lease(self, owner: str, rows: int) -> Lease:
        """Reserve the pages `rows` rows need; raises PoolExhausted when they are not available."""
        if owner in self._leases:
            raise ValueError(f"{owner} already holds a lease")
        need = self.pages_for(rows)
        if need > self.available:
            raise PoolExhausted(f"{owner} needs {need} pages, {self.available} of {self.total} are available")
        lease = Lease(owner, need)
        self._leases[owner] = lease
        return lease

    def grow(self, lease: Lease, rows: int) -> list[int]:
        """Take pages from the free list until the lease holds `rows` rows; returns the pages it took."""
        need = self.pages_for(rows)
        if need > lease.reserved:
            raise ValueError(f"{lease.owner} grows to {rows} rows ({need} pages) past its {lease.reserved} reserved")
        taken = [self._free.pop() for _ in range(need - len(lease.pages))]
        lease.pages.extend(taken)
        return taken

    def release(self, lease: Lease) -> None:
        """Return every page of a finished or cancelled stream."""
        if self._leases.pop(lease.owner, None) is not lease:
            raise ValueError(f"{lease.owner} holds no lease in this pool")
        self._free.extend(reversed(lease.pages))
        lease.pages = []
        lease.reserved = 0

    def check_integrity(self) -> None:
        """free + leased + kept == total and every page owned once, or raise with the numbers."""
        owned = list(self._free) + [p for lease in self._leases.values() for p in lease.pages] + list(self._kept)
        kept = len(self._kept)
        if len(owned) != self.total or sorted(owned) != list(range(self.total)):
            dupes = len(owned) - len(set(owned))
            raise PoolCorrupt(f"pool of {self.total} pages: free {self.free} + leased {self.leased} + kept {kept} "
                              f"= {len(owned)}, {dupes} owned twice")
        if self.available < 0:
            raise PoolCorrupt(f"leases reserve {self.free - self.available} untaken pages, only {self.free} are free")

    def snapshot(self) -> dict[str, int]:
        """The numbers, for /memory and logs."""
        return {"pages": self.total, "page_rows": self.page_rows, "free": self.free, "available": self.available,
                "leased": self.leased, "kept": len(self._kept), "leases": len(self._leases)}
