"""The rows store's one I/O thread: states staged in host memory are written in arrival order, so no step ever
waits on the disk.

    put      from the engine thread: never blocks; a job past the staging bound (`stage_bytes` of host memory
             waiting to be written) is dropped and counted, unless nothing waits (a state larger than the bound
             is still written, alone)
    flush    at shutdown: wait for the queue to empty within a deadline; what is left then is dropped and counted
    close    stop the thread after the job in hand
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import attrs

log = logging.getLogger(__name__)
J = TypeVar("J")


@attrs.frozen
class Flushed:
    """What a flush achieved: jobs written while it waited, jobs dropped at its deadline, seconds it took."""

    written: int
    dropped: int
    seconds: float


class Writer(Generic[J]):
    """One daemon thread calling `write(job)` for each job put, oldest first; `size(job)` is its staged bytes."""

    def __init__(self, write: Callable[[J], None], size: Callable[[J], int], stage_bytes: int,
                 name: str = "tensorfold-rows-writer") -> None:
        if stage_bytes < 1:
            raise ValueError(f"the staging bound must be at least 1 byte, got {stage_bytes}")
        self._write = write
        self._size = size
        self.stage_bytes = stage_bytes
        self._jobs: deque[J] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._hand: J | None = None
        self._stopping = False
        self.staged_bytes = 0   # bytes of the jobs waiting and the job in hand
        self.done = 0           # jobs written (or failed and logged)
        self.failed = 0         # jobs whose write raised
        self.dropped = 0        # jobs never written: past the staging bound, or left at a flush's deadline
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Jobs queued and in hand."""
        with self._cond:
            return len(self._jobs) + int(self._busy)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def put(self, job: J) -> bool:
        """Queue a job; False (counted as dropped) when it would pass the staging bound or the writer is closed."""
        nbytes = self._size(job)
        with self._cond:
            idle = not self._jobs and not self._busy
            if self._stopping or (not idle and self.staged_bytes + nbytes > self.stage_bytes):
                self.dropped += 1
                return False
            self._jobs.append(job)
            self.staged_bytes += nbytes
            self._cond.notify_all()
        return True

    def put_waiting(self, job: J, deadline: float) -> bool:
        """Queue a job, waiting (until the monotonic `deadline`) for room below the staging bound: for shutdown,
        when no step runs."""
        nbytes = self._size(job)
        with self._cond:
            while (self._jobs or self._busy) and self.staged_bytes + nbytes > self.stage_bytes and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return self.put(job)

    def settle(self, timeout: float) -> bool:
        """Wait until nothing is queued or in hand; False when `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def flush(self, timeout: float) -> Flushed:
        """Write what is queued within `timeout` seconds; drop (and count) what is left after it."""
        began = time.monotonic()
        before = self.done
        self.settle(timeout)
        with self._cond:
            left = len(self._jobs)
            self._jobs.clear()
            self.dropped += left
            self.staged_bytes = self._size(self._hand) if self._hand is not None else 0
        return Flushed(written=self.done - before, dropped=left, seconds=time.monotonic() - began)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread once the job in hand is done (queued jobs are dropped: flush first to write them)."""
        with self._cond:
            self._stopping = True
            self.dropped += len(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._hand = self._jobs.popleft()
                self._busy = True
            try:
                self._write(job)
            except Exception:
                self.failed += 1
                log.exception("writing a kept state to disk failed; a turn that needs it prefills")
            finally:
                with self._cond:
                    self._busy = False
                    self._hand = None
                    self.done += 1
                    self.staged_bytes -= self._size(job)
                    self._cond.notify_all()
