"""Freed heap handed back to the system. glibc keeps what its arenas free (a large body's text, the tokenizer's
buffers, a step's tensors, freed across several threads) for reuse, so after a burst the server's RSS stays at its
peak and under steady load it creeps up as the arenas fragment; malloc_trim(0) returns those free pages.

A thread checks RSS every few seconds and trims once it has grown `grow_bytes` past what it was after the last
trim: nothing is done while memory is flat, and a trim (tens of milliseconds for hundreds of MiB) only follows growth.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
MIB = 1 << 20
GROW_BYTES = 64 * MIB
EVERY_S = 5.0
M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has malloc_trim), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def malloc_trim() -> Callable[[], bool] | None:
    """glibc's malloc_trim(0) (True when it released memory), or None where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return None
    return lambda: bool(libc.malloc_trim(0))


def limit_arenas(count: int) -> bool:
    """At most `count` malloc arenas for threads started from now on (MALLOC_ARENA_MAX); False without glibc."""
    libc = _glibc()
    return libc is not None and libc.mallopt(M_ARENA_MAX, count) == 1


def resident_bytes() -> int:
    """This process's resident set, from /proc/self/statm (a cheap read)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class HeapTrimmer:
    """Trims the heap when RSS has grown `grow_bytes` past its level after the last trim."""

    def __init__(self, trim: Callable[[], bool], rss: Callable[[], int] = resident_bytes,
                 grow_bytes: int = GROW_BYTES, every_s: float = EVERY_S) -> None:
        self.trim = trim
        self.rss = rss
        self.grow_bytes = grow_bytes
        self.every_s = every_s
        self.floor = rss()
        self.trims = 0
        self.released_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorfold-heap-trim", daemon=True)

    def check(self) -> bool:
        """Trim if RSS grew enough since the last trim; True when it trimmed."""
        now = self.rss()
        if now - self.floor < self.grow_bytes:
            self.floor = min(self.floor, now)
            return False
        self.trim()
        after = self.rss()
        self.trims += 1
        self.released_bytes += max(0, now - after)
        log.debug("heap trimmed: RSS %d -> %d MiB", now // MIB, after // MIB)
        self.floor = after
        return True

    def start(self) -> None:
        """Check every `every_s` seconds in a daemon thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except OSError as err:  # /proc unreadable: stop checking, never stop the server
                log.warning("heap trimming stopped: %s", err)
                return


def start_heap_trimmer(grow_bytes: int = GROW_BYTES, every_s: float = EVERY_S) -> HeapTrimmer | None:
    """A started HeapTrimmer, or None where there is no glibc malloc_trim or no /proc."""
    trim = malloc_trim()
    if trim is None or not os.path.exists("/proc/self/statm"):
        return None
    trimmer = HeapTrimmer(trim, grow_bytes=grow_bytes, every_s=every_s)
    trimmer.start()
    return trimmer
