"""The payoff rule: a state on disk is read only when reading it is predicted cheaper than prefilling its rows, and
the measurement of the disk's side of that prediction."""

from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path

CHUNK = 8 << 20          # bytes per read call: large sequential reads, as the store makes


def should_read(state_bytes: int, rows: int, read_bytes_per_s: float, prefill_rows_per_s: float,
                margin: float = 1.0) -> bool:
    """Whether reading `state_bytes` (at `read_bytes_per_s`) to skip prefilling `rows` (at `prefill_rows_per_s`)
    pays: read time · margin < prefill time. No rows to save, or no measured read rate, never pays; an unmeasured
    prefill rate (<= 0) counts as slow, so the read pays."""
    if rows <= 0 or not read_bytes_per_s > 0 or math.isnan(prefill_rows_per_s):
        return False
    read_s = max(state_bytes, 0) / read_bytes_per_s
    prefill_s = rows / prefill_rows_per_s if prefill_rows_per_s > 0 else math.inf
    return read_s * margin < prefill_s


def sequential_read_rate(directory: Path, nbytes: int = 64 << 20) -> float:
    """Bytes/s of a plain sequential read of a scratch file of `nbytes` written in `directory` (then removed),
    fsynced and dropped from the page cache first where the OS allows, so the disk is measured and not memory.
    The scratch file is a `.part`, so a crash mid-measure leaves nothing the store's startup keeps."""
    nbytes = max(nbytes, 1)
    path = Path(directory) / "bandwidth.part"
    pattern = memoryview(os.urandom(min(CHUNK, nbytes)))   # random: a compressing file system cannot shrink it
    try:
        _write_scratch(path, pattern, nbytes)
        buffer = memoryview(bytearray(CHUNK))
        total = 0
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as handle:
            while got := handle.readinto(buffer):
                total += got
        seconds = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    return total / max(seconds, 1e-9)


def hash_rate(nbytes: int = 16 << 20) -> float:
    """Bytes/s sha256 runs at on this machine: a read verifies every byte it reads."""
    data = os.urandom(max(nbytes, 1))
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return len(data) / max(time.perf_counter() - start, 1e-9)


def overlapped_rate(*rates: float) -> float:
    """The rate of steps that run side by side over the same bytes (the reader and the hashing thread behind it,
    rows/files.py): the slowest one's."""
    return min(rates)


def observed_rate(before: float, nbytes: int, seconds: float, weight: float = 0.5) -> float:
    """The payoff rule's read rate after a resume read `nbytes` in `seconds` (read, verify and put back): the
    measurement replaces the startup estimate's half, so one odd read cannot swing it all the way."""
    seen = nbytes / max(seconds, 1e-9)
    return seen if before <= 0 else (1 - weight) * before + weight * seen


def _write_scratch(path: Path, pattern: memoryview, nbytes: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, pattern[: min(left, len(pattern))])
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
