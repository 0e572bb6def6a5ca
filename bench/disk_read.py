"""The disk side of the resume benchmarks (bench/resume.py, bench/resume_engine.py): which files a state on disk is,
the page cache dropped for them, and a plain sequential read of the same bytes to hold the store's reads against.

A state in the rows store is its state file and the blocks it lists (core/tensorfold/rows/__init__.py):
`<learn-dir>/<identity>/states/<key>.st` and `<learn-dir>/<identity>/blocks/<name>.blk`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tensorfold.rows.api import StateEntry

CHUNK = 8 << 20          # bytes per read call, as the store reads (rows/files.py)


def entry_files(identity_dir: Path, entry: StateEntry) -> list[Path]:
    """A state's files in the order the store reads them: the state file, then its blocks."""
    return [identity_dir / "states" / f"{entry.key}.st",
            *(identity_dir / "blocks" / f"{name}.blk" for name in entry.blocks)]


def state_files(root: Path, prompt: Sequence[int], at: int, block_rows: int) -> tuple[list[Path], StateEntry]:
    """The files of the state on disk a prompt resumed from at `at`: its rows' blocks are the prompt's (their names
    hash the tokens) and, of several such, the one used last (a read stamps its state file)."""
    from tensorfold.learned import identities
    from tensorfold.rows.names import Chain

    found = []
    for identity in identities(root):
        blocks = Chain(identity.name, block_rows, prompt[:at]).blocks(at)
        found += [(entry.used, identity.name, entry) for entry in identity.states
                  if entry.at == at and entry.blocks == blocks]
    if not found:
        raise LookupError(f"no state at {at} under {root} covers the prompt's first {at} tokens")
    _, name, entry = max(found, key=lambda item: item[0])
    return entry_files(Path(root) / name, entry), entry


def store_files(root: Path) -> list[Path]:
    """Every state and block file under a rows store's root."""
    return sorted(p for pattern in ("*/states/*.st", "*/blocks/*.blk") for p in Path(root).glob(pattern))


def drop_cache(paths: Iterable[Path]) -> None:
    """Evict files from the page cache (fsync, then POSIX_FADV_DONTNEED), so the next read of them is the disk's."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(paths: Sequence[Path], repeats: int = 3) -> tuple[int, float]:
    """Bytes of the files and bytes/s of reading them in order with plain large reads, page cache dropped before
    each pass (the median of `repeats` passes): what the disk gives these bytes, with no hashing or parsing."""
    buffer = memoryview(bytearray(CHUNK))
    seconds, total = [], 0
    for _ in range(repeats):
        drop_cache(paths)
        total = 0
        began = time.perf_counter()
        for path in paths:
            with open(path, "rb", buffering=0) as handle:
                while got := handle.readinto(buffer):
                    total += got
        seconds.append(time.perf_counter() - began)
    return total, total / max(statistics.median(seconds), 1e-9)
