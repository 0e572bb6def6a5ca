"""RowsStore: kept states on disk for one identity, under a root every identity shares (layout: rows/__init__.py,
bytes: docs/formats.md "The rows store on disk").

Threads. The tier's I/O thread writes; any thread may look up and read. Writes are serialised among themselves;
the index is guarded by one lock held only for bookkeeping and unlinks, never across a file's contents, so a
lookup never waits for a write's I/O. A state being read is never evicted, and blocks a write in progress relies on
are never removed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import attrs

from tensorfold.image import StateImage
from tensorfold.rows.api import Damaged, StateEntry, StoreRefused, StoreStats, identity_hash
from tensorfold.rows.assemble import Into, Put, assemble
from tensorfold.rows.caps import cap_reason, evict_lru
from tensorfold.rows.files import (
    BLOCK,
    STATE,
    damaged,
    file_size,
    fsync_dir,
    read_prefix,
    write_file,
    write_json,
)
from tensorfold.rows.guard import guard_root
from tensorfold.rows.names import Chain, state_key, token_bytes, tokens_from
from tensorfold.rows.opening import attempt, lock_root, make_folders, other_shelves, remove_parts
from tensorfold.rows.probe import read_rate
from tensorfold.rows.root import IDENTITY, DailyBudget, check_format, list_identities, read_json, release_lock
from tensorfold.rows.shelf import Shelf, block_words, state_words, unlink

__all__ = ["RowsStore", "list_identities"]

log = logging.getLogger(__name__)


class RowsStore:
    """Kept states of one identity on disk, within caps shared by every identity under `root`."""

    def __init__(self, root: Path, facts: Mapping[str, str], *, row_offset: Callable[[int], int],
                 block_rows: int = 256, cap_bytes: int = 32 << 30, daily_bytes: int | None = None,
                 min_free_bytes: int = 4 << 30, clock: Callable[[], float] = time.time) -> None:
        if block_rows < 1:
            raise ValueError(f"block rows must be >= 1, got {block_rows}")
        self.root = Path(root)
        self.facts = dict(facts)
        self.identity = identity_hash(facts)
        self.directory = self.root / self.identity
        self.block_rows = block_rows
        self.cap_bytes = cap_bytes
        self.daily_bytes = daily_bytes
        self.min_free_bytes = min_free_bytes
        self._row_offset = row_offset
        self._clock = clock
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self._reading: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()
        self._said: set[str] = set()
        self._counts: Counter[str] = Counter()
        self._lock_fd: int | None = None
        self._closed = False
        self.writes_off: str | None = None   # why the store writes nothing (a full or read-only disk at startup)
        try:
            self._off(guard_root(self.root))
            self._lock_fd, why = lock_root(self.root)
            self._off(why)
            self._off(check_format(self.root))
            self._open()
        except OSError as error:
            self.close()
            raise StoreRefused(f"{self.root}: the rows store cannot be opened: {error}") from error
        except BaseException:
            self.close()
            raise

    # -- opening ------------------------------------------------------------------------------------------------

    def _open(self) -> None:
        self._off(make_folders(self.directory))
        parts = remove_parts(self.root)
        if parts:
            self._counts["parts_removed"] += len(parts)
            log.warning("rows store: removed %d leftover .part files at startup (writes a crash or a kill cut "
                        "short): %s", len(parts), ", ".join(str(p.relative_to(self.root)) for p in parts[:4]))
        if self.writes_off is None and read_json(self.directory / IDENTITY) != self.facts:
            self._off(attempt(lambda: write_json(self.directory / IDENTITY, self.facts), IDENTITY))
        self._own = Shelf(self.directory)
        for file, problem in self._own.load(self._row_offset, repair=True):
            self._counts["damaged"] += 1
            log.warning("rows store: forgot %s at startup: %s", file, problem)
        self._others = other_shelves(self.root, self.identity)
        orphans = sum(shelf.orphans_removed for shelf in (self._own, *self._others))
        if orphans:
            self._counts["orphans_removed"] += orphans
            log.warning("rows store: removed %d block files no state lists at startup (left by a write cut short "
                        "or a state forgotten)", orphans)
        self._budget = DailyBudget(self.root, self._clock)
        with self._lock:
            self._evict(keep=())     # --learn-gib may have been lowered since the last server

    def _off(self, why: str | None) -> None:
        """Write nothing from now on, saying why in one line (the first reason a startup write met)."""
        if why is not None and self.writes_off is None:
            self.writes_off = why
            log.warning("rows store: writes nothing to %s: %s; serving goes on, and states already there may still "
                        "be read", self.root, why)

    def close(self) -> None:
        """Save each state's last use and hits (unless the store writes nothing), and release the lock (the store
        is unusable after)."""
        if self._closed:
            return
        self._closed = True
        try:
            if hasattr(self, "_own") and self.writes_off is None:
                with self._lock:
                    self._own.save_usage()
        except OSError as error:
            log.warning("rows store: could not save usage in %s: %s", self.directory, error)
        finally:
            if self._lock_fd is not None:
                release_lock(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> RowsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- finding and reading ------------------------------------------------------------------------------------

    def lookup(self, prompt: Sequence[int], cuts: Sequence[int], partition: str = "") -> StateEntry | None:
        """The longest state written in `partition` a pass over `prompt` cut at `cuts` may resume from: its tokens
        prompt[:at], `at` a cut below len(prompt), its cuts the pass's own up to `at` (tiers/policy.py resumable);
        the partition is in the names (names.py), so another partition's states never match."""
        return next(iter(self.candidates(prompt, cuts, partition, first=True)), None)

    def candidates(self, prompt: Sequence[int], cuts: Sequence[int], partition: str = "",
                   first: bool = False) -> list[StateEntry]:
        """Every state `lookup` could answer, longest first (only the longest with `first`)."""
        with self._lock:
            ats = sorted({c for c in cuts if 0 < c < len(prompt) and c in self._own.ats}, reverse=True)
        if not ats:
            return []
        chain = Chain(self.identity, self.block_rows, prompt[: ats[0]], partition)
        found = []
        for at in ats:
            want = tuple(c for c in cuts if c <= at)
            hexed = chain.at(at).hex()
            with self._lock:
                for key in self._own.by_chain.get(hexed, ()):
                    entry = self._own.states[key]
                    if entry.at == at and entry.cuts == want:
                        found.append(entry)
                        break
            if found and first:
                break
        return found

    def exact(self, tokens: Sequence[int], cuts: Sequence[int], partition: str = "") -> StateEntry | None:
        """The state kept for exactly `tokens` cut at `cuts` in `partition`, if any (a follower's part of the state
        rank 0 chose: tiers/disk_mirror.py)."""
        at, want = len(tokens), tuple(cuts)
        if at < 1:
            return None
        hexed = Chain(self.identity, self.block_rows, tokens, partition).at(at).hex()
        with self._lock:
            for key in self._own.by_chain.get(hexed, ()):
                entry = self._own.states[key]
                if entry.at == at and tuple(entry.cuts) == want:
                    return entry
        return None

    def read(self, entry: StateEntry, use: bool = True, put: Put | None = None,
             into: Into | None = None) -> StateImage:
        """The state's image, every byte verified; on any failure the state is forgotten, counted, and Damaged
        raised naming the file and the problem (a state evicted since its lookup raises Damaged uncounted). A
        read with `use` off (TF_IMPRINT_VERIFY's read-back) leaves its last use, hits and read counters alone.
        Its files are read in one pipeline (assemble.py); with `put`, each verified block's rows are handed to it
        as they land, before the whole state is verified: a caller that puts them somewhere undoes that when the
        read raises. With `into`, the rows part is read into the caller's buffer (reused across reads)."""
        path = self._own.state_path(entry.key)
        with self._lock:
            current = self._own.states.get(entry.key)
            if current is None:
                raise damaged(path, "no longer kept (removed since it was looked up)")
            block_rows = self._own.block_rows.get(entry.key)
            self._reading[entry.key] += 1
        try:
            image = assemble(self._own, self.identity, current, self._row_offset, block_rows, put, into)
        except Damaged as error:
            self._forget(current, error)
            raise
        finally:
            with self._lock:
                self._reading[entry.key] -= 1
                if not self._reading[entry.key]:
                    del self._reading[entry.key]
        if not use:
            return image
        now = self._clock()
        with self._lock:
            latest = self._own.states.get(entry.key)
            if latest is not None:
                self._own.touch(attrs.evolve(latest, used=now, hits=latest.hits + 1))
            self._counts["reads"] += 1
            self._counts["read_bytes"] += current.nbytes
        self._stamp(path, now)
        return image

    @staticmethod
    def _stamp(path: Path, used: float) -> None:
        """A state file's mtime is its last use, so the LRU order outlives a crash before close saves usage."""
        try:
            os.utime(path, (used, used))
        except OSError:
            pass

    def _forget(self, entry: StateEntry, error: Damaged) -> None:
        """Forget the state a failed read names, and every state listing the block that failed, if one did."""
        bad = Path(error.path) if error.path else None
        block = bad.stem if bad is not None and bad.suffix == ".blk" else None
        with self._lock:
            victims = [entry.key]
            if block is not None:
                victims += [k for k, e in self._own.states.items() if block in e.blocks and k != entry.key]
            for key in victims:
                if key in self._own.states:
                    self._own.drop(key, keep=self._pending)
                    self._counts["damaged"] += 1
            if block is not None:
                self._own.bytes -= unlink(bad)
        log.warning("rows store: forgot %d state(s): %s", len(victims), error)

    def tokens(self, entry: StateEntry) -> tuple[int, ...]:
        """The tokens a state covers, read from its file (for `tensorfold learned show`)."""
        return tokens_from(read_prefix(self._own.state_path(entry.key), STATE, 4 * entry.at))

    # -- writing ------------------------------------------------------------------------------------------------

    def write(self, tokens: Sequence[int], cuts: Sequence[int], image: StateImage, used: float | None = None,
              partition: str = "") -> StateEntry | None:
        """Write a state (synchronously: the tier's I/O thread calls this); None when skipped by a cap or refused
        by the file system, counted and logged once per reason, or when --learn-gib evicted it at once (it was
        the least recently used). `used` is when it was last used (now when not given; the tier passes an older
        time for a state it writes at shutdown, so the cap keeps the states used last, whatever the order they
        are written in). An existing state is only marked used. `partition` ("" or a sha256 hex digest, recorded
        in the words) is folded into every name (names.py)."""
        at = image.at
        mine = tuple(c for c in cuts if c <= at)
        if at < 1 or len(tokens) != at:
            raise ValueError(f"a state at {at} needs {at} >= 1 tokens, got {len(tokens)}")
        if not mine or mine[-1] != at or list(mine) != sorted(set(mine)):
            raise ValueError(f"cuts {mine[:8]} must rise to the state's at {at}")
        if len(image.rows) != self._row_offset(at):
            raise ValueError(f"image rows part is {len(image.rows)} bytes, {at} rows make {self._row_offset(at)}")
        with self._writing:
            chain = Chain(self.identity, self.block_rows, tokens, partition)
            head = chain.at(at)
            key = state_key(head, mine)
            with self._lock:
                if key in self._own.states:
                    old = self._own.states[key]
                    entry = attrs.evolve(old, used=max(old.used, self._clock() if used is None else used))
                    self._own.touch(entry)
                    return entry
            names = chain.blocks(at)
            with self._lock:
                self._pending.update(names)
            try:
                return self._write(key, head.hex(), tokens, mine, names, image, used, partition)
            except OSError as error:
                self._clean_after(key, names)
                self._say("failed", f"rows store: cannot write to {self.directory}: {error}; states stay in RAM only")
                self._counts["write_failed"] += 1
                return None
            finally:
                with self._lock:
                    for name in names:
                        self._pending[name] -= 1
                        if self._pending[name] <= 0:
                            del self._pending[name]

    def _clean_after(self, key: str, names: tuple[str, ...]) -> None:
        """Remove what a failed write left that nothing lists (where the file system still allows it)."""
        with self._lock:
            paths = [self._own.block_path(n) for n in names if n not in self._own.refs]
            if key not in self._own.states:
                paths.append(self._own.state_path(key))
            for path in paths:
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    pass
            try:
                self._own.bytes = self._own.measure()
            except OSError:
                pass

    def _write(self, key: str, chain: str, tokens: Sequence[int], cuts: tuple[int, ...], names: tuple[str, ...],
               image: StateImage, used: float | None, partition: str) -> StateEntry | None:
        at, rows = image.at, memoryview(image.rows)
        tail = len(image.rows) - self._row_offset(len(names) * self.block_rows)
        words = state_words(key, chain, cuts, names, image, tail, self.block_rows, self._clock(), partition)
        plan, sizes, new_bytes, replaced = [], {}, file_size(words), 0
        for index, name in enumerate(names):
            block = block_words(index, self.block_rows, self._row_offset)
            sizes[name] = file_size(block)
            try:
                have = self._own.block_path(name).stat().st_size
            except FileNotFoundError:
                have = None
            if have != sizes[name]:
                plan.append((name, block))
                new_bytes += sizes[name]
                replaced += have or 0
        state_bytes = file_size(words) + sum(sizes.values())
        if self._skipped(state_bytes, new_bytes):
            return None
        for name, block in plan:
            body = rows[block["start"]: block["start"] + block["body"]]
            write_file(self._own.block_path(name), BLOCK, block, [body], sync_dir=False)
        if plan:
            fsync_dir(self.directory / "blocks")
        write_file(self._own.state_path(key), STATE, words, [token_bytes(tokens), image.own, rows[len(rows) - tail:]])
        now = self._clock() if used is None else min(used, self._clock())
        self._stamp(self._own.state_path(key), now)
        entry = StateEntry(key=key, at=at, cuts=cuts, blocks=names, nbytes=state_bytes, written=words["written"],
                           used=now, hits=0)
        self._spend(new_bytes)
        with self._lock:      # published and evicted at once: stats() never shows the store over its cap
            self._own.add(entry, chain, self.block_rows)
            self._own.bytes += new_bytes - replaced
            self._counts["written"] += 1
            self._counts["written_bytes"] += new_bytes
            # listed now, its blocks need no pending mark: the state itself may go if it is the least recently used
            self._evict(keep={n for n in self._pending if n not in names})
            if key not in self._own.states:
                self._say("older", "rows store: a state older than every state --learn-gib keeps was evicted as "
                          "soon as it was written")
                return None
        return entry

    def _skipped(self, state_bytes: int, new_bytes: int) -> bool:
        """Whether a write of `new_bytes` new bytes (a state of `state_bytes`) is skipped by a cap; counted."""
        found = cap_reason(self, self._budget, state_bytes, new_bytes)
        return found is not None and self._skip(*found)

    def _skip(self, counter: str, why: str) -> bool:
        self._counts[counter] += 1
        self._say(counter, "rows store: " + why)
        return True

    def _say(self, reason: str, message: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            log.warning(message)

    def _spend(self, nbytes: int) -> None:
        """Add bytes written today to budget.json (every identity's writes count)."""
        try:
            self._budget.spend(nbytes)
        except OSError as error:
            log.warning("rows store: could not record the day's writes in %s: %s", self._budget.path, error)

    def _evict(self, keep: Collection[str]) -> None:
        """Every identity's bytes back within `cap_bytes` (rows/caps.py evict_lru). The caller holds the lock."""
        self._counts["evicted"] += evict_lru([self._own, *self._others], self._reading, self.cap_bytes, keep)

    # -- the rest -------------------------------------------------------------------------------------------------

    def entries(self) -> list[StateEntry]:
        """This identity's states, least recently used first."""
        with self._lock:
            return list(self._own.states.values())

    def remove(self, key: str) -> None:
        """Remove a state and the blocks no other state lists (a no-op for a state not kept)."""
        with self._lock:
            self._own.drop(key, keep=self._pending)

    def count_declined(self) -> None:
        """Count a read the payoff rule declined (the tier decides; the store keeps the counter)."""
        with self._lock:
            self._counts["declined"] += 1

    def verify(self) -> list[tuple[str, str]]:
        """(file, problem) for every state or block file of this identity that fails its checks, reading every
        byte; nothing is removed."""
        found: list[tuple[str, str]] = []
        for path in sorted((self.directory / "states").glob("*.st")):
            entry = self._own.states.get(path.stem)
            if entry is None:
                found.append((str(path), "not in the index"))
                continue
            try:
                assemble(self._own, self.identity, entry, self._row_offset)
            except Damaged as error:
                found.append((error.path or str(path), error.problem or str(error)))
        for path in sorted((self.directory / "blocks").glob("*.blk")):
            if path.stem not in self._own.refs:
                found.append((str(path), "no state lists this block"))
        return found

    def stats(self) -> StoreStats:
        """Counters since startup and bytes now."""
        c = self._counts
        return StoreStats(states=len(self._own.states), bytes=self._own.bytes, budget=self.cap_bytes,
                          written=c["written"], written_bytes=c["written_bytes"], reads=c["reads"],
                          read_bytes=c["read_bytes"], damaged=c["damaged"], declined=c["declined"],
                          skipped_daily=c["skipped_daily"], skipped_floor=c["skipped_floor"],
                          skipped_cap=c["skipped_cap"], evicted=c["evicted"], write_failed=c["write_failed"],
                          parts_removed=c["parts_removed"], orphans_removed=c["orphans_removed"])

    def read_bandwidth(self, nbytes: int = 64 << 20) -> float:
        """Bytes/s a state read is estimated at before any was made, the payoff rule's denominator: a sequential
        read of a scratch file written in the store (of the states kept, where the disk has no room for one), or
        sha256 over the same bytes, whichever is slower (rows/probe.py); a disk that refuses the scratch file turns
        writing off."""
        rate, why = read_rate(self.directory, nbytes, self.min_free_bytes, writes=self.writes_off is None)
        self._off(why)
        return rate
