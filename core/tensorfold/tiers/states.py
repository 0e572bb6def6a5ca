"""The kept states each tier holds, as plain records every tier may read: a tier takes in what the tier above lets
go, so it reads that tier's states without importing that tier (tiers/chain.py wires them)."""

from __future__ import annotations

import attrs
import torch

from tensorfold.rows.api import StateEntry

Copies = tuple[tuple[int, str, torch.Tensor], ...]


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes one tensor holds."""
    return tensor.numel() * tensor.element_size()


def copies_bytes(*copies: Copies) -> int:
    """Bytes of every tensor in `copies`."""
    return sum(tensor_bytes(t) for part in copies for _, _, t in part)


@attrs.define(eq=False)
class KeptState:
    """A stream's state at `at` on the device (tiers/device.py): the prompt prefix, the cold cuts up to `at`, shared
    full pages and copies; `why` the keep points it stands for, `passed` whether a later kept state moved past it,
    `partition` who may resume from it (tiers/policy.py)."""

    tokens: tuple[int, ...]
    at: int
    cuts: tuple[int, ...]
    pages: tuple[int, ...]
    tail_start: int
    tail: Copies = attrs.field(repr=False)
    fixed: Copies = attrs.field(repr=False)
    hits: int = 0
    why: frozenset[str] = frozenset()
    passed: bool = False
    partition: str = ""
    key: int = 0              # at TP above 1: rank 0's name for it in the journal (tiers/mirror.py)

    @property
    def copy_bytes(self) -> int:
        """Bytes of the tail and fixed copies (the pages are counted by the tier, once each)."""
        return copies_bytes(self.tail, self.fixed)


@attrs.define(eq=False)
class HostState:
    """A state at `at` held as host copies (tiers/host.py): `rows` every row state's entries [0, at), `fixed` every
    fixed state; `partition` who may resume from it (tiers/policy.py); `landed` what a reader on the host waits for
    (`settle`) while the copies into it may still run."""

    tokens: tuple[int, ...]
    at: int
    cuts: tuple[int, ...]
    rows: Copies = attrs.field(repr=False)
    fixed: Copies = attrs.field(repr=False)
    why: frozenset[str] = frozenset()
    passed: bool = False
    hits: int = 0
    partition: str = ""
    landed: object | None = attrs.field(default=None, repr=False)  # on CUDA: its copies in are done at this event
    key: int = 0              # at TP above 1: rank 0's name for it in the journal (tiers/mirror.py)

    @property
    def pages(self) -> tuple[int, ...]:
        """A host state shares no page: a resumer's lease starts empty."""
        return ()

    @property
    def nbytes(self) -> int:
        """Bytes of its row and fixed copies."""
        return copies_bytes(self.rows, self.fixed)

    def settle(self) -> None:
        """Wait until its copies have landed, before the host reads them (the disk's I/O thread)."""
        if self.landed is not None:
            self.landed.synchronize()


@attrs.define(eq=False)
class DiskState:
    """A state on disk a request may resume from (tiers/disk.py): the store's index entry, the prompt prefix it
    covers and the partition it was found in (its names fold the partition in: rows/names.py)."""

    tokens: tuple[int, ...]
    at: int
    cuts: tuple[int, ...]
    entry: StateEntry
    why: frozenset[str] = frozenset()
    passed: bool = False
    hits: int = 0
    read_s: float = 0.0       # seconds its last read took (read and verify)
    partition: str = ""

    @property
    def pages(self) -> tuple[int, ...]:
        """A disk state shares no page: a resumer's lease starts empty."""
        return ()
