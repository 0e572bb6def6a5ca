"""The disk tier: kept prompt states in the rows store (`--learn-conversations`), below the host tier, across
evictions and restarts.

    in      a state the host tier lets go (the device tier's, with the host tier off; or a keep point every faster
            tier refuses) is staged as host copies and handed to the one I/O thread (rows/writer.py), which makes
            its image and writes it (tiers/disk_write.py), unless that state is on disk already; the step that
            let it go never waits on the disk. Copies out of the device go into the tier's arena
            (tiers/arena.py, pinned on CUDA) through its Lane, asynchronously (tiers/copy_out.py): the step never
            waits for them either, and the I/O thread waits for them to land before it reads them
    lookup  after the device and host tiers: the store's longest state a pass over the prompt may resume from
            (its tokens a prefix, its cuts the pass's own, written in the request's partition, which the store
            folds into every name: rows/names.py), if longer than theirs; it is read only when the payoff
            rule (rows/payoff.py) says reading its bytes beats prefilling the rows it saves, with the model's
            prefill rate measured at startup and the store's read rate estimated at startup (sequential read and
            sha256) then taken from each resume's read and put back; a decline is counted and logged
    out     at admission, before the stream's first step: read (the store verifies lengths, hashes and words: one
            reader thread, hashing behind it, each block put back as it is verified, rows/assemble.py) into a
            buffer carved from the tier's arena and given back after (no allocation per read), put back into the
            fresh claim's slot (image.put_back); a read that fails is counted and the store forgets
            the state; the chain (chain.py) then falls back to the next shorter state on the host or on disk, else
            the request prefills from row 0, so its reply equals a fresh run's
    close   at shutdown the states still kept on the device and the host are staged too (most recently used
            first), and the queue is flushed within `flush_s` seconds; what is left is dropped, and the log says
            how many were written and dropped
    TP > 1  (`lead`) every rank keeps its own part of each state in its own rows store; rank 0 decides, and records
            each setup, write and read in the store's journal for its followers (tiers/disk_mirror.py DiskLeader);
            a read is sent at once and every rank votes on it: when any part fails, every rank forgets the state
            and rank 0 clears the claim, so the request prefills (or falls back) the same on every rank
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from tensorfold.image import ImageFormat, StateImage, put_back
from tensorfold.image_rows import RowsTable, put_rows_part
from tensorfold.memory import Claim, StreamMemory
from tensorfold.memory_plan import size
from tensorfold.pool.pages import PoolCorrupt
from tensorfold.rows.api import Damaged, StateEntry
from tensorfold.rows.payoff import observed_rate, should_read
from tensorfold.rows.writer import Writer
from tensorfold.tiers.arena import HostArena
from tensorfold.tiers.disk_mirror import DiskLeader, Ranks
from tensorfold.tiers.disk_write import DiskWrites
from tensorfold.tiers.lanes import Lane
from tensorfold.tiers.staged import Staged, from_slot, from_state
from tensorfold.tiers.states import DiskState, HostState, KeptState
from tensorfold.tiers.stats import TierStats

if TYPE_CHECKING:
    from tensorfold.rows.store import RowsStore

log = logging.getLogger(__name__)

STAGE_BYTES = 2**30   # host memory states may take while they wait for the I/O thread
DISK_RESERVE_BYTES = 4 * 2**30  # at most this much host memory carved ready at startup (boot.build_disk): a read
                                # buffer of the longest state, then its next turn's state staged in the same room
FLUSH_S = 10.0        # how long shutdown waits for the queue to be written
IN_HAND_S = 5.0       # past that, how long it waits for the one state being written
SPILL_STEP_S = 1e-6   # at shutdown, each state is stamped this much less recently used than the one before it


class DiskTier:
    """Kept states in one rows store (`store`, a RowsStore) for one StreamMemory."""

    name = "disk"

    def __init__(self, memory: StreamMemory, store: RowsStore, fmt: ImageFormat, read_bytes_per_s: float,
                 prefill_rows_per_s: float, verify: bool = False, stage_bytes: int = STAGE_BYTES,
                 flush_s: float = FLUSH_S, margin: float = 1.0, reserve: int = 0) -> None:
        self.memory = memory
        self.lane = Lane(memory.kv.device)
        self.pin = memory.kv.device.type == "cuda"
        self.arena = HostArena(self.pin, limit=2 * (stage_bytes + reserve))
        if self.pin and reserve:
            self.arena.reserve(reserve)         # one slab: a whole state (or its rows part) fits in it
        self.store = store
        self.fmt = fmt
        self.read_bytes_per_s = read_bytes_per_s
        self.prefill_rows_per_s = prefill_rows_per_s
        self.verify = verify
        self.flush_s = flush_s
        self.margin = margin
        self.hits = self.misses = self.declined = self.failed_reads = self.cached_tokens = 0
        self.read_seconds = 0.0
        self.restored_bytes = 0
        self.restore_seconds = 0.0
        self.staged = 0
        self._declining: tuple[StateEntry, int] | None = None
        self._deadline: float | None = None
        self._at_shutdown = (0, 0)
        self._closed = False
        self.stage_bytes = stage_bytes
        self.reserve = reserve
        self.leader: DiskLeader | None = None
        self.writes = DiskWrites(memory.kv, store, fmt, verify)
        self.writer: Writer[Staged] = Writer(self.writes.write, lambda job: job.nbytes, stage_bytes)

    def lead(self, ranks: Ranks) -> None:
        """At TP above 1: open every follower's own rows store (its part of each state) and mirror from now on."""
        self.leader = DiskLeader(self.memory.kv, ranks)
        self.leader.setup(self.store, self.fmt, self.stage_bytes, self.reserve, self.flush_s)

    # -- taking states in ---------------------------------------------------------------------------------------

    def take(self, state: KeptState | HostState, spare: object | None = None) -> bool:
        """Stage a state a faster tier lets go and queue it for the I/O thread; False when the queue is full or the
        store writes nothing (a full or read-only disk at startup: nothing is staged)."""
        return self.store.writes_off is None and self._queue(self.stage(state), state.key)

    def keep_from(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...],
                  why: frozenset[str] = frozenset(), partition: str = "") -> bool:
        """Stage the state a slot holds at `len(tokens)` (no faster tier took it), kept in `partition`, and queue
        it; False as `take` says."""
        return self.store.writes_off is None and self._queue(
            from_slot(self.memory.kv, self.lane, self.arena, claim, tokens, cuts, why, partition), 0, claim)

    def stage(self, state: KeptState | HostState, used: float | None = None) -> Staged:
        """Host copies of a device or host state (tiers/staged.py); `used` its last use, when not now."""
        return from_state(self.memory.kv, self.lane, self.arena, state, used)

    def _queue(self, staged: Staged, key: int, claim: Claim | None = None) -> bool:
        if self._deadline is not None:
            queued = self.writer.put_waiting(staged, self._deadline)
        else:
            queued = self.writer.put(staged)
        if queued:
            self.staged += 1
            if self.leader is not None:
                self.leader.stage(staged, key, claim, self._deadline is not None)
            if self.pin:
                self.arena.ahead(staged.nbytes)      # room for one more like it, grown off the engine's thread
        elif self._closed or not self.writer.alive:
            log.warning("not kept on disk at %s: the disk tier is closed", f"{staged.at:,}")
        else:
            log.warning("not kept on disk at %s: %s of states already wait for the disk", f"{staged.at:,}",
                        size(self.writer.staged_bytes))
        return queued

    # -- resuming -----------------------------------------------------------------------------------------------

    def find(self, prompt: tuple[int, ...], cuts: tuple[int, ...], beyond: int = 0,
             partition: str = "") -> DiskState | None:
        """The longest state on disk kept in `partition` a pass over `prompt` cut at `cuts` may resume from, if
        longer than `beyond` (what a faster tier offers) and worth reading; counts nothing (a decline is counted
        at admission)."""
        self._declining = None
        entry = self.store.lookup(prompt, cuts, partition)
        if entry is None or entry.at <= beyond:
            return None
        saved = entry.at - beyond
        if not should_read(entry.nbytes, saved, self.read_bytes_per_s, self.prefill_rows_per_s, self.margin):
            self._declining = (entry, saved)
            return None
        return DiskState(tokens=tuple(prompt[: entry.at]), at=entry.at, cuts=tuple(entry.cuts), entry=entry,
                         partition=partition)

    def candidates(self, prompt: tuple[int, ...], cuts: tuple[int, ...], partition: str = "") -> list[DiskState]:
        """Every state on disk kept in `partition` a pass over `prompt` cut at `cuts` may resume from, longest
        first; counts nothing (the chain weighs them against the other tiers', chain.py)."""
        self._declining = None
        return [DiskState(tokens=tuple(prompt[: entry.at]), at=entry.at, cuts=tuple(entry.cuts), entry=entry,
                          partition=partition) for entry in self.store.candidates(prompt, cuts, partition)]

    def decline(self, state: DiskState, saved: int) -> None:
        """The chain chose another resume point than `state`, which would have saved `saved` more rows: counted
        and logged once the request is admitted (`looked_up`)."""
        self._declining = (state.entry, saved)

    @property
    def bytes_per_s(self) -> float:
        """The read rate the choice of a resume point predicts with (startup probe, then measured reads)."""
        return self.read_bytes_per_s

    def restore_bytes(self, state: DiskState) -> int:
        """Bytes a restore of `state` reads: its state file and blocks."""
        return state.entry.nbytes

    def touch(self, state: DiskState) -> None:
        """The store marks a state used when it is read."""

    def looked_up(self, owner: str) -> None:
        """A request was admitted after the last `find`: count and log a read the payoff rule declined."""
        if self._declining is None:
            return
        entry, saved = self._declining
        self._declining = None
        self.declined += 1
        self.store.count_declined()
        log.info("%s: declined the state at %s on disk: reading %s at %s/s costs more than prefilling %s rows at "
                 "%s rows/s", owner, f"{entry.at:,}", size(entry.nbytes), size(self.read_bytes_per_s),
                 f"{saved:,}", f"{self.prefill_rows_per_s:,.0f}")

    def load(self, state: DiskState, claim: Claim, owner: str = "") -> int | None:
        """Read a state into a fresh claim (no shared pages), each block's rows put back as soon as it is read and
        verified while the later blocks are still read (rows/assemble.py), then its fixed states and last rows;
        the rows resumed, or None when the read failed its check or the image does not fit the Layout (counted
        and logged; the store forgets a damaged state; the claim is made fresh again, so a fallback restores into
        it as if first)."""
        kv = self.memory.kv
        if claim.lease is not None and claim.lease.pages:
            raise ValueError("a disk state is restored into a claim that shares no pages")
        table = RowsTable.of(kv, self.fmt.rows)
        done = [0]

        def put(first: int, rows: int, data: memoryview) -> None:
            put_rows_part(kv, claim.slot, data, first, first + rows, table)
            done[0] = max(done[0], first + rows)

        def into(nbytes: int) -> memoryview:
            return memoryview(self.arena.empty((nbytes,), torch.uint8).numpy())

        began = time.perf_counter()
        sent = False
        error: Exception | None = None
        try:
            self.memory.extend(claim, state.at)
            if self.leader is not None:
                self.leader.send_read(state, claim.slot)
                sent = True
            image = self.store.read(state.entry, put=put, into=into)
            if image.at != state.at:
                raise Damaged(f"the state file says at {image.at}, its index entry {state.at}")
            read_s = time.perf_counter() - began
            put_back(kv, claim.slot, image, self.fmt, start=done[0])
        except (Damaged, OSError, ValueError) as err:
            error = err
        if self.leader is not None:
            error = self.leader.vote(self.store, state, sent, error)
        if error is not None:
            self._failed(state, owner, error)
            self.memory.reset(claim)
            return None
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        seconds = time.perf_counter() - began
        self.read_seconds += read_s
        state.read_s = read_s
        log.info("%s: read the state at %s from disk: %s in %.1f ms (%s/s), put back as read", owner,
                 f"{state.at:,}", size(state.entry.nbytes), seconds * 1e3,
                 size(state.entry.nbytes / max(seconds, 1e-9)))
        self._measured(state, seconds)
        return state.at

    def _measured(self, state: DiskState, seconds: float) -> None:
        """A resume from `state` took `seconds` (read, verify and put back): the read rate moves toward it; counted
        as a hit."""
        before = self.read_bytes_per_s
        self.read_bytes_per_s = observed_rate(before, state.entry.nbytes, seconds)
        self.restored_bytes += state.entry.nbytes
        self.restore_seconds += seconds
        log.info("the payoff rule now reads at %s/s (was %s/s): measured on this resume", size(self.read_bytes_per_s),
                 size(before))
        state.hits += 1
        self.hits += 1
        self.cached_tokens += state.at

    def restore(self, state: DiskState, claim: Claim, owner: str = "") -> int:
        """Read a state and put it into a fresh claim (no shared pages); the rows resumed, or 0 when the read
        failed verification (counted; the store has forgotten it; the slot is cleared and the request prefills).
        Rank 0's part alone: the engine resumes through `load`, which every rank of a TP world follows."""
        image = self.read(state, owner)
        return 0 if image is None else self.put(state, image, claim, owner)

    def read(self, state: DiskState, owner: str = "") -> StateImage | None:
        """The state's verified image, or None when it failed its check (counted and logged; the store has
        forgotten it, so a lookup now finds at most a shorter state)."""
        began = time.perf_counter()
        try:
            image = self.store.read(state.entry)
            if image.at != state.at:
                raise Damaged(f"the state file says at {image.at}, its index entry {state.at}")
        except (Damaged, OSError) as err:
            self._failed(state, owner, err)
            return None
        seconds = time.perf_counter() - began
        self.read_seconds += seconds
        state.read_s = seconds
        log.info("%s: read the state at %s from disk: %s in %.1f ms (%s/s)", owner, f"{state.at:,}",
                 size(state.entry.nbytes), seconds * 1e3, size(state.entry.nbytes / max(seconds, 1e-9)))
        return image

    def put(self, state: DiskState, image: StateImage, claim: Claim, owner: str = "") -> int:
        """Put a read image into a fresh claim (no shared pages); the rows resumed, or 0 when it does not fit
        the Layout (counted; the slot is cleared and the request prefills)."""
        kv = self.memory.kv
        if claim.lease is not None and claim.lease.pages:
            raise ValueError("a disk state is restored into a claim that shares no pages")
        began = time.perf_counter()
        try:
            self.memory.extend(claim, state.at)
            put_back(kv, claim.slot, image, self.fmt)
        except (ValueError, OSError) as err:
            self._failed(state, owner, err)
            kv.clear(claim.slot)
            return 0
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        self._measured(state, state.read_s + time.perf_counter() - began)
        return state.at

    def _failed(self, state: DiskState, owner: str, err: Exception) -> None:
        self.failed_reads += 1
        log.warning("%s: the state at %s on disk failed its check (%s)", owner, f"{state.at:,}", err)

    def ready(self) -> None:
        """Restores are synchronous: nothing to wait for."""

    # -- shutdown -----------------------------------------------------------------------------------------------

    def spill(self, states: Iterable[KeptState | HostState]) -> int:
        """Stage states still kept in RAM at shutdown, most recently used first (waiting for room while the
        deadline allows); how many. Each is stamped a little less recently used than the one before it, so that
        --learn-gib keeps the states used last, not the ones written last."""
        self._shutting_down()
        if self.store.writes_off is not None:
            return 0
        began = time.time()
        spilled = sum(1 for rank, state in enumerate(states)
                      if self._queue(self.stage(state, used=began - rank * SPILL_STEP_S), state.key))
        if self.leader is not None:
            self.leader.flush()         # the followers stage and write their parts while rank 0 writes its own
        return spilled

    def close(self) -> None:
        """Flush the queue within the shutdown deadline, stop the I/O thread once the state in hand is written,
        release the store, and log how many states were written and dropped since shutdown began."""
        if self._closed:
            return
        self._shutting_down()
        written, dropped = self._at_shutdown
        flushed = self.writer.flush(max(0.0, self._deadline - time.monotonic()))
        self.writer.close(timeout=IN_HAND_S)
        self._closed = True
        stats = self.store.stats()
        self.store.close()
        log.info("disk tier closed: %d states written at shutdown in %.2f s, %d dropped (flush bound %.0f s); "
                 "%d on disk", stats.written - written, flushed.seconds, self.writer.dropped - dropped,
                 self.flush_s, stats.states)

    def _shutting_down(self) -> None:
        if self._deadline is None:
            self._deadline = time.monotonic() + self.flush_s
            self._at_shutdown = (self.store.stats().written, self.writer.dropped)

    # -- accounting ---------------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The I/O thread runs, the staged bytes add up, and the store is within its cap."""
        if not self._closed and not self.writer.alive:
            raise PoolCorrupt("the disk tier's I/O thread has stopped")
        if self.writer.staged_bytes < 0 or (self.writer.waiting == 0 and self.writer.staged_bytes != 0):
            raise PoolCorrupt(f"the disk tier counts {self.writer.staged_bytes} staged bytes with "
                              f"{self.writer.waiting} states waiting")
        stats = self.store.stats()
        if stats.bytes > stats.budget:
            raise PoolCorrupt(f"the disk tier holds {stats.bytes} bytes, over --learn-gib's {stats.budget}")

    def stats(self) -> TierStats:
        """Counters and use now (read from other threads: numbers may be a step old)."""
        store = self.store.stats()
        return TierStats(tier=self.name, states=store.states, bytes=store.bytes, budget=store.budget,
                         kept=store.written, hits=self.hits, misses=self.misses, evicted=store.evicted,
                         refused=store.skipped_cap + store.skipped_daily + store.skipped_floor + store.write_failed
                         + self.writer.dropped,
                         cached_tokens=self.cached_tokens)

    def describe(self) -> dict[str, object]:
        """Numbers for /memory."""
        store = self.store.stats()
        return {"disk_states": store.states, "disk_bytes": store.bytes, "disk_budget": store.budget,
                "disk_hits": self.hits, "disk_written": store.written, "disk_written_bytes": store.written_bytes,
                "disk_read_bytes": store.read_bytes, "disk_read_seconds": round(self.read_seconds, 6),
                "disk_restored_bytes": self.restored_bytes, "disk_restore_seconds": round(self.restore_seconds, 6),
                "disk_damaged": store.damaged,
                "disk_failed_reads": self.failed_reads, "disk_declined": self.declined,
                "disk_skipped_daily": store.skipped_daily, "disk_skipped_floor": store.skipped_floor,
                "disk_skipped_cap": store.skipped_cap, "disk_evicted": store.evicted,
                "disk_staged": self.staged, "disk_waiting": self.writer.waiting,
                "disk_waiting_bytes": self.writer.staged_bytes, "disk_dropped": self.writer.dropped,
                "disk_write_failed": store.write_failed, "disk_write_errors": self.writer.failed,
                "disk_parts_removed": store.parts_removed, "disk_orphans_removed": store.orphans_removed,
                "disk_on_disk_already": self.writes.on_disk_already,
                "disk_verified": self.writes.verified, "disk_verify_mismatches": self.writes.mismatches,
                "disk_read_bytes_per_s": round(self.read_bytes_per_s),
                "disk_prefill_rows_per_s": round(self.prefill_rows_per_s)}

