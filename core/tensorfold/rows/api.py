"""The rows store's interface, as the disk tier (tiers/disk.py) and the `tensorfold learned` command use it.

Written first so the store and the tier can be built side by side; rows/store.py implements `RowsStore`.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs


@attrs.frozen
class StateEntry:
    """One state on disk, as the index knows it (no bytes read)."""

    key: str                      # the state's name: chained hash of the identity, tokens [0, at) and cuts
    at: int                       # rows the state covers
    cuts: tuple[int, ...]         # the cold pass's cuts up to `at` (a resumer must make the same cuts)
    blocks: tuple[str, ...]       # names of its full blocks, in order
    nbytes: int                   # bytes of its state file and its blocks (shared blocks counted in full)
    written: float                # unix time written
    used: float                   # unix time last read (or written)
    hits: int                     # reads served


@attrs.frozen
class StoreStats:
    """Counters since startup, for /metrics and the logs."""

    states: int
    bytes: int                    # bytes of this identity's state and block files
    budget: int                   # --learn-gib in bytes (all identities together)
    written: int                  # states written
    written_bytes: int
    reads: int                    # states read back and verified
    read_bytes: int
    damaged: int                  # reads (or startup checks) that failed verification: the state was forgotten
    declined: int                 # reads the payoff rule declined
    skipped_daily: int            # writes skipped: --learn-daily-gib spent
    skipped_floor: int            # writes skipped: free disk below --learn-min-free-gib
    skipped_cap: int              # writes skipped: the state alone exceeds --learn-gib
    evicted: int                  # states removed to stay within --learn-gib
    write_failed: int = 0         # writes the file system refused (read-only, full, gone): logged, nothing kept
    parts_removed: int = 0        # `.part` files removed at startup: writes a crash or a kill cut short
    orphans_removed: int = 0      # block files no state lists, removed at startup (every identity's)


class Damaged(Exception):
    """A file failed verification (length, trailer hash, words); the message names the file and what is wrong."""

    def __init__(self, message: str, path: str = "", problem: str = "") -> None:
        super().__init__(message)
        self.path = path              # the file that failed, so the store knows which states it takes down
        self.problem = problem


class StoreRefused(Exception):
    """The store cannot be opened: locked by another server (its pid named), an unknown format version (named), or
    a directory the file system refuses (read-only, not a directory)."""


def identity_hash(facts: Mapping[str, str]) -> str:
    """The identity directory's name: sha256 over the sorted facts, 32 hex digits."""
    import hashlib
    import json

    text = json.dumps(dict(sorted(facts.items())), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def why_skipped(before: StoreStats, after: StoreStats) -> str:
    """Why the store wrote nothing of a state, from its counters before and after the write (for the log)."""
    if after.skipped_daily > before.skipped_daily:
        return "the day's write budget (--learn-daily-gib) is spent"
    if after.skipped_floor > before.skipped_floor:
        return "free disk space is below --learn-min-free-gib: writing pauses, serving goes on"
    if after.skipped_cap > before.skipped_cap:
        return "the state alone is larger than --learn-gib"
    if after.write_failed > before.write_failed:
        return "the file system refused the write"
    if after.evicted > before.evicted:
        return "--learn-gib evicted it as soon as it was written: every state it keeps was used more recently"
    return "the store skipped it"
