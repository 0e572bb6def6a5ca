"""Slots: where a running stream's fixed states live; one per stream, `--parallel` of them."""

from __future__ import annotations


class SlotPool:
    """A free list of slot indices."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count - 1, -1, -1))

    @property
    def free(self) -> int:
        """Slots not in use."""
        return len(self._free)

    def take(self) -> int:
        """A free slot; the caller checked `free` first."""
        if not self._free:
            raise RuntimeError("no free slot")
        return self._free.pop()

    def give(self, slot: int) -> None:
        """Return a slot."""
        if slot in self._free or not 0 <= slot < self.count:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)
