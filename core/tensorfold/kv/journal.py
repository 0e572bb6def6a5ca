"""What a store's owner did to it outside the forward, as records a follower replays on its own store.

On rank 0 of a tensor-parallel world the store keeps a journal (`KvStore.journal`, a list; None elsewhere): each
slot cleared, page table bound, page poisoned and slot copied (a fork) is appended in order, and the follow
protocol sends the journal with the next step (follow/). None of them carries a tensor: each rank applies it to its
own part of the state, so the same record is right on every rank. Rank 0's kept-state tiers append their own
records to the same journal, in order with these (tiers/mirror.py); a follower applies those to its Mirror.
"""

from __future__ import annotations

from typing import Protocol

import attrs


class KvStore(Protocol):
    """The store methods the commands replay (kv/base.py's KvStore has them; named here to keep imports one way)."""

    def clear(self, slot: int) -> None: ...

    def bind(self, slot: int, table: list[int]) -> None: ...

    def fill(self, pages: list[int]) -> None: ...

    def copy_slot(self, src: int, dst: int, at: int) -> None: ...


@attrs.frozen
class Clear:
    """A slot readied for a new stream (its fixed states zeroed)."""

    slot: int

    def apply(self, kv: KvStore) -> None:
        """Clear the same slot here."""
        kv.clear(self.slot)


@attrs.frozen
class Bind:
    """A slot's page table set (its pages in row order)."""

    slot: int
    table: tuple[int, ...] = attrs.field(converter=tuple)

    def apply(self, kv: KvStore) -> None:
        """Bind the same table here."""
        kv.bind(self.slot, list(self.table))


@attrs.frozen
class Fill:
    """Fresh pages poisoned with NaN (TF_KV_POISON)."""

    pages: tuple[int, ...] = attrs.field(converter=tuple)

    def apply(self, kv: KvStore) -> None:
        """Poison the same pages here."""
        kv.fill(list(self.pages))


@attrs.frozen
class Copy:
    """Slot `src`'s state at row `at` copied into slot `dst` (a fork at its prompt's end)."""

    src: int
    dst: int
    at: int

    def apply(self, kv: KvStore) -> None:
        """Copy this rank's part the same way."""
        kv.copy_slot(self.src, self.dst, self.at)


Command = Clear | Bind | Fill | Copy
