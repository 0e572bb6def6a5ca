"""The disk tier at tensor-parallel size N > 1: each rank keeps its own part of every state in its own rows store,
rank 0 decides (docs/architecture.md, "Tensor parallelism").

Rank 0's disk tier (tiers/disk.py) records its decisions in the store's journal through its `DiskLeader`, as the
device and host tiers do (tiers/mirror.py); a follower replays them on its `DiskPart`:

    DiskSetup  once, at startup: open this rank's rows store under `<learn-dir>/rank-<k>` with rank 0's identity
               facts and this rank's number, and start its writer thread
    DiskStage  a state rank 0 queued for its disk: this rank's part of it (a kept part by rank 0's key, or the
               slot's rows) staged and queued for this rank's writer
    DiskRead   rank 0 chose a state on disk for a claim (sent at once, with the journal before it, not at the next
               step): this rank reads its part into the slot, then every rank says whether its read succeeded
               (an all-gather on the steps' group); when any failed, every rank forgets that state and rank 0
               clears the claim, so the request prefills the same on every rank
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import attrs
import torch

from tensorfold.image import ImageFormat, put_back, read_out, row_offset
from tensorfold.kv import KvStore
from tensorfold.memory import Claim
from tensorfold.rows.api import Damaged, StoreRefused
from tensorfold.rows.writer import Writer
from tensorfold.tiers.arena import HostArena
from tensorfold.tiers.lanes import Lane
from tensorfold.tiers.mirror import Mirror
from tensorfold.tiers.staged import CopiesView, Staged, from_pages, from_state

if TYPE_CHECKING:
    from tensorfold.rows.store import RowsStore
    from tensorfold.tiers.states import DiskState

log = logging.getLogger(__name__)


def rank_root(root: Path, rank: int) -> Path:
    """Where rank `rank` keeps its parts: rank 0 the --learn-dir itself, rank k its own `rank-<k>` below it."""
    return root if rank == 0 else root / f"rank-{rank}"


@attrs.frozen
class DiskSetup:
    """The disk tier exists: rank 0's --learn-dir, identity facts (this rank adds its number), caps and queue."""

    root: str
    facts: dict[str, str]
    block_rows: int
    cap_bytes: int
    daily_bytes: int | None
    min_free_bytes: int
    fmt: ImageFormat
    stage_bytes: int
    reserve: int
    flush_s: float


@attrs.frozen
class DiskStage:
    """Rank 0 queued a state for its disk: device or host state `key`, or (key 0) `slot`'s rows up to the end."""

    key: int
    slot: int
    pages: tuple[int, ...] | None   # the slot's pages (None: a window store, or a state by key)
    tokens: tuple[int, ...]
    cuts: tuple[int, ...]
    why: frozenset[str]
    partition: str
    used: float | None
    waiting: bool        # at shutdown: wait for room in the queue until the flush bound


@attrs.frozen
class DiskRead:
    """Rank 0 resumes `slot` from the state for `tokens` cut at `cuts`; slot -1: rank 0 failed before reading."""

    tokens: tuple[int, ...]
    cuts: tuple[int, ...]
    partition: str
    slot: int


DiskCommand = DiskSetup | DiskStage | DiskRead
DISK_COMMANDS = (DiskSetup, DiskStage, DiskRead)


class Ranks(Protocol):
    """Rank 0's side of a tensor-parallel world, as the disk tier needs it (follow/leader.py Leader)."""

    def flush(self) -> None:
        """Send the journal to the followers now."""

    def agree(self, ok: bool) -> bool:
        """Whether every rank's part succeeded."""


class DiskLeader:
    """Rank 0's side: its disk tier's setup, stages and reads recorded in the journal for the followers (the
    journal is the store's own, taken anew at each use: every send replaces it), and the ranks' vote on a read."""

    def __init__(self, kv: KvStore, ranks: Ranks) -> None:
        self.kv = kv
        self.ranks = ranks

    def _journal(self) -> list:
        journal = self.kv.journal
        if journal is None:
            raise RuntimeError("the disk tier leads followers only over a store that keeps a journal")
        return journal

    def setup(self, store: RowsStore, fmt: ImageFormat, stage_bytes: int, reserve: int, flush_s: float) -> None:
        """Open every follower's own rows store (its part of each state) now, with rank 0's facts and caps."""
        self._journal().append(DiskSetup(str(store.root), store.facts, store.block_rows, store.cap_bytes,
                                         store.daily_bytes, store.min_free_bytes, fmt, stage_bytes, reserve,
                                         flush_s))
        self.ranks.flush()

    def stage(self, staged: Staged, key: int, claim: Claim | None, waiting: bool) -> None:
        """Rank 0 queued a state: each follower stages its part, by rank 0's key or from its slot's rows."""
        pages = None
        if claim is not None and claim.lease is not None:
            pages = tuple(claim.lease.pages)
        self._journal().append(DiskStage(key=key, slot=claim.slot if claim is not None else -1, pages=pages,
                                         tokens=staged.tokens, cuts=staged.cuts, why=staged.why,
                                         partition=staged.partition, used=staged.used, waiting=waiting))

    def flush(self) -> None:
        """Send the journal now (at shutdown: the followers stage and write their parts while rank 0 writes)."""
        self.ranks.flush()

    def send_read(self, state: DiskState, slot: int) -> None:
        """Send the journal and the read to every follower now (they read while rank 0 does); slot -1: rank 0
        failed before reading."""
        self._journal().append(DiskRead(state.tokens, state.cuts, state.partition, slot))
        self.ranks.flush()

    def vote(self, store: RowsStore, state: DiskState, sent: bool, error: Exception | None) -> Exception | None:
        """After rank 0's read of `state` (`sent` when the read went out first; `error` when its own part failed):
        every rank votes; rank 0's error, or when another rank's part failed, the store forgets it and says why."""
        if sent:
            self._journal().clear()   # what rank 0's read recorded (put_back's clear): each rank's read does it
        else:
            self.send_read(state, -1)
        if self.ranks.agree(error is None) or error is not None:
            return error
        store.remove(state.entry.key)      # another rank's part failed: forgotten on every rank
        return Damaged("another rank's part of it failed its read (every rank forgets it)")


class DiskPart:
    """A follower's rows store and writer, driven by rank 0's disk commands; `agree` is the ranks' vote on a read."""

    def __init__(self, kv: KvStore, mirror: Mirror, rank: int, agree: Callable[[bool], bool]) -> None:
        self.kv = kv
        self.mirror = mirror
        self.rank = rank
        self.agree = agree
        self.store: RowsStore | None = None
        self.writer: Writer[Staged] | None = None
        self.setup: DiskSetup | None = None
        self.lane = Lane(kv.device)
        self.arena: HostArena | None = None
        self.reads = self.failed_reads = self.dropped = 0

    def apply(self, command: DiskCommand) -> None:
        """Do this rank's part of what rank 0's disk tier did."""
        if isinstance(command, DiskSetup):
            self._setup(command)
        elif isinstance(command, DiskStage):
            self._stage(command)
        else:
            self._read(command)

    def _setup(self, c: DiskSetup) -> None:
        from tensorfold.rows.store import RowsStore

        self.setup = c
        self.arena = HostArena(self.kv.device.type == "cuda", limit=2 * (c.stage_bytes + c.reserve))
        root = rank_root(Path(c.root), self.rank)
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.store = RowsStore(root, {**c.facts, "tp_rank": str(self.rank)},
                                   row_offset=lambda position: row_offset(self.kv.layout, c.fmt, position),
                                   block_rows=c.block_rows, cap_bytes=c.cap_bytes, daily_bytes=c.daily_bytes,
                                   min_free_bytes=c.min_free_bytes)
        except (StoreRefused, OSError) as err:
            log.warning("rank %d: no rows store at %s (%s): every state on disk reads as missing here, so every "
                        "rank prefills instead", self.rank, root, err)
            return
        self.writer = Writer(self._write, lambda job: job.nbytes, c.stage_bytes)
        log.info("rank %d: its parts of the states on disk are in %s (%d kept)", self.rank, self.store.directory,
                 self.store.stats().states)

    def _stage(self, c: DiskStage) -> None:
        if self.writer is None or self.store is None or self.store.writes_off is not None or self.arena is None:
            return
        if c.key:
            staged = from_state(self.kv, self.lane, self.arena, self.mirror.parts[c.key], c.used)
        else:
            pages = list(c.pages) if c.pages is not None else None
            staged = from_pages(self.kv, self.lane, self.arena, c.slot, pages, c.tokens, c.cuts, c.why)
        staged = attrs.evolve(staged, tokens=c.tokens, cuts=c.cuts, why=c.why, partition=c.partition, used=c.used)
        assert self.setup is not None
        queued = (self.writer.put_waiting(staged, time.monotonic() + self.setup.flush_s) if c.waiting
                  else self.writer.put(staged))
        if not queued:
            self.dropped += 1
            log.warning("rank %d: its part of the state at %s is not kept on disk: the queue is full", self.rank,
                        f"{len(c.tokens):,}")

    def _write(self, job: Staged) -> None:
        assert self.store is not None and self.setup is not None
        job.settle()
        image = read_out(CopiesView(self.kv.layout, job), 0, job.at, self.setup.fmt)
        self.store.write(job.tokens, job.cuts, image, used=job.used, partition=job.partition)

    def _read(self, c: DiskRead) -> None:
        entry = self.store.exact(c.tokens, c.cuts, c.partition) if self.store is not None else None
        problem = "rank 0 failed before reading" if c.slot < 0 else "not kept on this rank" if entry is None else ""
        if not problem:
            try:
                image = self.store.read(entry)
                if image.at != len(c.tokens):
                    raise Damaged(f"the state file says at {image.at}, rank 0 reads at {len(c.tokens)}")
                put_back(self.kv, c.slot, image, self.setup.fmt)
            except (Damaged, OSError, ValueError) as err:
                problem = str(err)
            if self.kv.device.type == "cuda":
                torch.cuda.synchronize(self.kv.device)
        if problem:
            self.failed_reads += 1
            log.warning("rank %d: its part of the state at %s did not read: %s", self.rank, f"{len(c.tokens):,}",
                        problem)
        if self.agree(not problem):
            self.reads += 1
            return
        if entry is not None and not problem:
            self.store.remove(entry.key)         # another rank's part failed: the state is forgotten everywhere

    def close(self) -> None:
        """At Stop: write what rank 0's shutdown queued within the flush bound, then release the store."""
        if self.writer is not None and self.setup is not None:
            flushed = self.writer.flush(self.setup.flush_s)
            self.writer.close(timeout=self.setup.flush_s / 2)
            log.info("rank %d: disk parts flushed in %.2f s, %d dropped", self.rank, flushed.seconds,
                     self.writer.dropped + self.dropped)
        if self.store is not None:
            self.store.close()

