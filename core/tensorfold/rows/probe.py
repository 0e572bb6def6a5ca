"""The payoff rule's read rate estimated at startup on whatever the store's disk allows: a scratch file of half the
room above the free-space floor (at least MIN_PROBE, at most the size asked); where the disk refuses it (full,
read-only) or the store writes nothing, the state and block files already kept; with none, sha256 alone (nothing
kept to read; the first resume's measurement corrects it). Each read is weighed with sha256 over the same bytes, as
a state read verifies every byte: the slower of the two, since a state's reader runs ahead of its hashing thread."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from tensorfold.rows.files import open_plain
from tensorfold.rows.guard import no_room
from tensorfold.rows.payoff import CHUNK, hash_rate, overlapped_rate, sequential_read_rate

MIN_PROBE = 1 << 20     # the smallest scratch file, written even below the floor (a full disk refuses it)
HASHED = 16 << 20       # bytes sha256 is timed over


def read_rate(directory: Path, nbytes: int, min_free_bytes: int, writes: bool) -> tuple[float, str | None]:
    """(bytes/s, why the store must write nothing or None): the scratch file is written only when `writes`; a
    disk that refuses it (full, read-only) gives the reason."""
    why = None
    if writes:
        size = min(nbytes, max(_room(directory, min_free_bytes) // 2, MIN_PROBE))
        try:
            return overlapped_rate(sequential_read_rate(directory, size), hash_rate(min(size, HASHED))), None
        except OSError as error:
            if not no_room(error):
                raise
            why = f"the read probe's scratch file ({size} bytes) could not be written in {directory}: {error}"
    kept = kept_rate(directory, nbytes)
    hashed = hash_rate(min(max(nbytes, 1), HASHED))
    return (hashed if kept is None else overlapped_rate(kept, hashed)), why


def kept_rate(directory: Path, nbytes: int) -> float | None:
    """Bytes/s of a sequential read of up to `nbytes` of the block and state files already in `directory`, each
    dropped from the page cache first where the OS allows; None when there is nothing to read."""
    paths = [*sorted((directory / "blocks").glob("*.blk")), *sorted((directory / "states").glob("*.st"))]
    buffer = memoryview(bytearray(CHUNK))
    total, seconds = 0, 0.0
    for path in paths:
        if total >= nbytes:
            break
        try:
            with open_plain(path, buffering=0) as handle:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                start = time.perf_counter()
                while total < nbytes and (got := handle.readinto(buffer)):
                    total += got
                seconds += time.perf_counter() - start
        except OSError:
            continue
    return total / max(seconds, 1e-9) if total else None


def _room(directory: Path, min_free_bytes: int) -> int:
    try:
        return shutil.disk_usage(directory).free - min_free_bytes
    except OSError:
        return 0
