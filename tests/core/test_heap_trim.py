"""The heap trimmer: it trims only after RSS grew past its level after the last trim, and on glibc a trim gives
back memory that free() kept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tensorfold.heap_trim import MIB, HeapTrimmer, malloc_trim

# Allocates 128 MiB in 64 KiB blocks (below the mmap threshold, so from the heap) with a small block after them so
# the heap's top cannot shrink, touches every page, frees the blocks, then lets a HeapTrimmer check.
FRAGMENTED = """
import ctypes, json
from tensorfold.heap_trim import HeapTrimmer, malloc_trim, resident_bytes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
start = resident_bytes()
blocks = [libc.malloc(64 << 10) for _ in range(2048)]
pin = libc.malloc(64)
for block in blocks:
    ctypes.memset(block, 1, 64 << 10)
trimmer = HeapTrimmer(malloc_trim(), grow_bytes=64 << 20)
trimmer.floor = start
full = resident_bytes()
for block in blocks:
    libc.free(block)
freed = resident_bytes()
print(json.dumps({"start": start, "full": full, "freed": freed, "trimmed": trimmer.check(),
                  "after": resident_bytes(), "released": trimmer.released_bytes, "floor": trimmer.floor}))
"""


class Readings:
    """RSS values in MiB, read in turn."""

    def __init__(self, *mib: int) -> None:
        self.left = list(mib)

    def __call__(self) -> int:
        return self.left.pop(0) * MIB


def test_trims_only_once_rss_grew_past_its_level_after_the_last_trim() -> None:
    trims: list[int] = []
    readings = Readings(100, 150, 170, 120, 90, 153, 154, 100, 163)
    trimmer = HeapTrimmer(lambda: trims.append(1) is None, rss=readings, grow_bytes=64 * MIB)
    assert trimmer.floor == 100 * MIB
    assert trimmer.check() is False          # 150: grew 50
    assert trimmer.check() is True           # 170: grew 70, trimmed to 120
    assert (trimmer.floor, trimmer.trims, trimmer.released_bytes) == (120 * MIB, 1, 50 * MIB)
    assert trimmer.check() is False          # 90: below the level, which follows it down
    assert trimmer.floor == 90 * MIB
    assert trimmer.check() is False          # 153: grew 63
    assert trimmer.check() is True           # 154: grew 64, trimmed to 100
    assert (trimmer.floor, trimmer.trims, trimmer.released_bytes) == (100 * MIB, 2, 104 * MIB)
    assert trimmer.check() is False          # 163: grew 63 past the new level
    assert len(trims) == 2 and readings.left == []


@pytest.mark.skipif(malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_a_trim_gives_back_what_free_kept() -> None:
    found = json.loads(subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True,
                                      check=True).stdout)
    allocated = 128 * MIB
    assert found["full"] - found["start"] >= allocated
    assert found["full"] - found["freed"] < allocated // 4      # free() alone gives back next to nothing
    assert found["trimmed"] is True
    assert found["freed"] - found["after"] >= allocated * 3 // 4  # the trim gives it back
    # the trimmer's own RSS readings, a moment before this process's next read: a page or two may move between them
    assert abs(found["released"] - (found["freed"] - found["after"])) <= MIB
    assert abs(found["floor"] - found["after"]) <= MIB
