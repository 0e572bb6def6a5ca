"""The page pool: KV rows live in pages of a fixed row count; a stream leases the pages it can reach up front.

    total pages = free + held by leases + held by kept states (a page held by several counts once)
    a lease reserves `reserved` pages at admission and takes them from the free list as its rows grow,
    so a running stream never fails for memory: admission fails instead, and the request waits.

A page may be held several times: by the lease that wrote it, by kept states (`keep`), and by leases of streams
that resumed from a kept state (`lease(..., shared=...)`, full pages of rows below the resume point, which the
resumer only reads). Every hold is counted; a page goes back to the free list when its last hold ends.
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
        if total < 0 or page_rows < 1:
            raise ValueError(f"a pool needs rows per page and no fewer than 0 pages, got {total} pages of "
                             f"{page_rows} rows")
        self.total = total
        self.page_rows = page_rows
        self._free = list(range(total - 1, -1, -1))
        self._leases: dict[str, Lease] = {}
        self._kept: dict[int, int] = {}   # page -> holds by kept states
        self._holds: dict[int, int] = {}  # page -> holds by leases and kept states; absent when free

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
        """Pages held by leases, each once however many leases share it."""
        return len({p for lease in self._leases.values() for p in lease.pages})

    @property
    def kept(self) -> int:
        """Pages held by kept states and by no lease."""
        leased = {p for lease in self._leases.values() for p in lease.pages}
        return len(set(self._kept) - leased)

    def kept_holds(self) -> dict[int, int]:
        """Page -> how many kept states hold it."""
        return dict(self._kept)

    def fits(self, rows: int, shared: int = 0) -> bool:
        """Whether a lease of `rows` rows whose first `shared` pages are already held fits now."""
        return self.pages_for(rows) - shared <= self.available

    def lease(self, owner: str, rows: int, shared: list[int] | tuple[int, ...] = ()) -> Lease:
        """Reserve the pages `rows` rows need; raises PoolExhausted when they are not available. `shared` are held
        pages (a kept state's full pages) the lease starts with: they are its first pages and need no new page."""
        if owner in self._leases:
            raise ValueError(f"{owner} already holds a lease")
        need = self.pages_for(rows)
        shared = list(shared)
        if len(shared) > need:
            raise ValueError(f"{owner} shares {len(shared)} pages but reaches only {need}")
        unheld = [p for p in shared if p not in self._holds]
        if unheld:
            raise ValueError(f"{owner} shares pages no one holds: {unheld}")
        if need - len(shared) > self.available:
            raise PoolExhausted(f"{owner} needs {need - len(shared)} pages, {self.available} of {self.total} are "
                                f"available")
        lease = Lease(owner, need, shared)
        for page in shared:
            self._holds[page] += 1
        self._leases[owner] = lease
        return lease

    def keep(self, pages: list[int] | tuple[int, ...]) -> None:
        """A kept state holds these pages (each already held, by the lease that wrote it)."""
        unheld = [p for p in pages if p not in self._holds]
        if unheld:
            raise ValueError(f"kept pages must be held already, these are free: {unheld}")
        for page in pages:
            self._holds[page] += 1
            self._kept[page] = self._kept.get(page, 0) + 1

    def unkeep(self, pages: list[int] | tuple[int, ...]) -> None:
        """A kept state lets go of its pages; those no one else holds go back to the free list."""
        missing = [p for p in pages if self._kept.get(p, 0) < 1]
        if missing:
            raise ValueError(f"pages not kept: {missing}")
        for page in pages:
            self._kept[page] -= 1
            if not self._kept[page]:
                del self._kept[page]
            self._drop(page)

    def _drop(self, page: int) -> None:
        self._holds[page] -= 1
        if not self._holds[page]:
            del self._holds[page]
            self._free.append(page)

    def grow(self, lease: Lease, rows: int) -> list[int]:
        """Take pages from the free list until the lease holds `rows` rows; returns the pages it took."""
        need = self.pages_for(rows)
        if need > lease.reserved:
            raise ValueError(f"{lease.owner} grows to {rows} rows ({need} pages) past its {lease.reserved} reserved")
        taken = [self._free.pop() for _ in range(need - len(lease.pages))]
        for page in taken:
            self._holds[page] = 1
        lease.pages.extend(taken)
        return taken

    def shrink(self, lease: Lease, rows: int) -> list[int]:
        """Give back the pages past those `rows` rows need (they stay reserved for the lease); returns them."""
        keep = self.pages_for(rows)
        dropped = lease.pages[keep:]
        for page in reversed(dropped):
            self._drop(page)
        del lease.pages[keep:]
        return dropped

    def release(self, lease: Lease) -> None:
        """Return every page of a finished or cancelled stream."""
        if self._leases.pop(lease.owner, None) is not lease:
            raise ValueError(f"{lease.owner} holds no lease in this pool")
        for page in reversed(lease.pages):
            self._drop(page)
        lease.pages = []
        lease.reserved = 0

    def check_integrity(self) -> None:
        """free + leased + kept == total with every held page counted once and on no free list, and every page's
        holds equal to the leases and kept states that hold it; or raise with the numbers."""
        leased = {p for lease in self._leases.values() for p in lease.pages}
        kept_only = set(self._kept) - leased
        owned = list(self._free) + sorted(leased) + sorted(kept_only)
        if len(owned) != self.total or sorted(owned) != list(range(self.total)):
            dupes = len(owned) - len(set(owned))
            raise PoolCorrupt(f"pool of {self.total} pages: free {self.free} + leased {len(leased)} + kept "
                              f"{len(kept_only)} = {len(owned)}, {dupes} owned twice")
        counted: dict[int, int] = dict(self._kept)
        for lease in self._leases.values():
            if len(set(lease.pages)) != len(lease.pages):
                raise PoolCorrupt(f"{lease.owner} holds a page twice: {lease.pages}")
            for page in lease.pages:
                counted[page] = counted.get(page, 0) + 1
        if counted != self._holds:
            wrong = sorted(p for p in set(counted) | set(self._holds) if counted.get(p) != self._holds.get(p))
            raise PoolCorrupt(f"holds of {len(wrong)} pages do not match their leases and kept states: "
                              f"{[(p, self._holds.get(p, 0), counted.get(p, 0)) for p in wrong[:8]]}")
        if self.available < 0:
            raise PoolCorrupt(f"leases reserve {self.free - self.available} untaken pages, only {self.free} are free")

    def snapshot(self) -> dict[str, int]:
        """The numbers, for /memory and logs."""
        return {"pages": self.total, "page_rows": self.page_rows, "free": self.free, "available": self.available,
                "leased": self.leased, "kept": self.kept, "leases": len(self._leases)}
