"""Rank 0's side of `tensorfold serve --tensor-parallel-size N`: it starts ranks 1..N-1 as spawned child processes
(follow/child.py), waits for them, joins them, watches them and stops them.

    start     each follower is spawned with its FollowerJob; its pid is logged (`rank K of N follows: pid P on D`)
              and listed in /memory's plan (`ranks`)
    join      once every follower has checked its family, checkpoint and Layout, rank 0 joins the world at a free
              loopback port (torch.distributed's TCP rendezvous, rank 0 listening); a follower that fails or dies
              first ends startup with its reason (FollowerFailed), never a wait for the rendezvous's timeout
    ready     rank 0 loads its own part meanwhile, then waits for every follower's `ready`, however long its
              load takes (a large checkpoint), as long as the process lives
    watch     a thread waits on the followers' process sentinels: one that exits while serving is a lost rank,
              handed to `on_lost` (the engine's `die`) at once, idle or not
    close     a clean stop sends Stop (followers exit 0) and waits for them; after a failure (a lost rank, a
              startup that failed) the others are killed (they ignore SIGTERM: follow/child.py); any follower
              still alive after the grace is killed; every one is reaped
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import attrs
import torch

from tensorfold.family import FamilyModel
from tensorfold.follow.channel import World, backend_for, join, leave
from tensorfold.follow.child import FollowerJob, Report, run_follower
from tensorfold.follow.leader import Leader
from tensorfold.follow.rank import rank_device
from tensorfold.kv import KvStore
from tensorfold.ports import free_port
from tensorfold.shard import RankLost

log = logging.getLogger(__name__)
STOP_GRACE_S = 10.0   # a follower told to stop has this long to exit before it is killed


class FollowerFailed(RuntimeError):
    """A follower did not start: which rank, and why (its own reason, or how its process ended)."""


def ended(code: int | None) -> str:
    """How a process ended, for a person: its exit status or the signal that killed it."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@attrs.define
class Follower:
    """One follower process and rank 0's ends of its pipes."""

    rank: int
    device: torch.device
    process: Any = attrs.field(repr=False)          # a spawn-context multiprocessing.Process
    reports: Connection = attrs.field(repr=False)
    life: Connection = attrs.field(repr=False)

    @property
    def name(self) -> str:
        """The rank and pid, for messages."""
        return f"rank {self.rank} (pid {self.process.pid})"


class Ranks:
    """Rank 0's tensor-parallel world: the followers it started, its own place in the world, and its Leader."""

    def __init__(self, world: int, family: str, model: Path, dtype: torch.dtype, device: torch.device,
                 timeout_s: float) -> None:
        self.world = world
        self.device = device
        self.timeout_s = timeout_s
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.backend = backend_for(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)     # NCCL's communicator runs on the current device
        self.joined: World | None = None
        self.leader: Leader | None = None
        self.stop_grace_s = STOP_GRACE_S     # longer with the disk tier on: each follower flushes its writes
        self._stopping = threading.Event()
        self._closed = False
        atexit.register(self.close, failure="the server exits")  # before multiprocessing's join of its children
        context = multiprocessing.get_context("spawn")
        threads = max(1, torch.get_num_threads() // world) if device.type == "cpu" else None
        self.followers: list[Follower] = []
        try:
            for rank in range(1, world):
                job = FollowerJob(rank=rank, world=world, address=self.address, family=family, model=Path(model),
                                  dtype=str(dtype).removeprefix("torch."), device=str(rank_device(device, rank)),
                                  backend=self.backend, timeout_s=timeout_s,
                                  log_level=logging.getLogger().getEffectiveLevel(), threads=threads)
                self.followers.append(self._spawn(context, job))
        except BaseException:
            self.close(failure="startup failed")
            raise
        if threads is not None:
            torch.set_num_threads(threads)

    def _spawn(self, context: Any, job: FollowerJob) -> Follower:
        reports, their_reports = context.Pipe(duplex=False)
        their_life, life = context.Pipe(duplex=False)
        process = context.Process(target=run_follower, args=(job, their_reports, their_life),
                                  name=f"tensorfold-rank{job.rank}", daemon=True)
        process.start()
        their_reports.close()
        their_life.close()
        log.info("rank %d of %d follows: pid %d on %s", job.rank, self.world, process.pid, job.device)
        return Follower(rank=job.rank, device=torch.device(job.device), process=process, reports=reports, life=life)

    def join(self) -> World:
        """Wait for every follower's check, then join the world with them (rank 0 listening)."""
        self._wait("checked")
        self.joined = join(0, self.world, self.address, self.timeout_s, self.backend)
        return self.joined

    def wait_ready(self) -> None:
        """Block until every follower has loaded its part (FollowerFailed with the first one that cannot)."""
        self._wait("ready")
        log.info("tensor parallelism: %d ranks ready (reductions over %s)", self.world, self.backend)

    def _wait(self, stage: str) -> None:
        waiting = {f.reports: f for f in self.followers}
        exits = {f.process.sentinel: f for f in self.followers}
        while waiting:
            for item in wait([*waiting, *exits]):
                follower = waiting.get(item) or exits[item]
                report = _read(follower)
                if report is None and follower.process.is_alive() and item in waiting:
                    follower.process.join(STOP_GRACE_S)   # its reports closed: it is ending
                if report is None:
                    raise FollowerFailed(f"rank {follower.rank} of {self.world} (pid {follower.process.pid}) "
                                         f"ended before it was {stage}: {ended(follower.process.exitcode)}")
                if report.stage == "failed":
                    raise FollowerFailed(f"rank {report.rank} of {self.world} (pid {follower.process.pid}) failed "
                                         f"to start: {report.detail}")
                if report.stage == stage:
                    waiting.pop(follower.reports, None)

    def lead(self, model: FamilyModel, kv: KvStore) -> Leader:
        """Rank 0's model, sending each step to the followers (the store's shape first)."""
        if self.joined is None:
            raise RuntimeError("rank 0 leads only after it has joined its followers")
        self.leader = Leader(model, kv, self.joined.channel)
        return self.leader

    def watch(self, on_lost: Callable[[RankLost], None]) -> None:
        """From now on, a follower whose process ends before close() is a lost rank, handed to `on_lost`."""
        threading.Thread(target=self._watch, args=(on_lost,), name="tensorfold-ranks-watch", daemon=True).start()

    def _watch(self, on_lost: Callable[[RankLost], None]) -> None:
        exits = {f.process.sentinel: f for f in self.followers}
        gone = min((exits[item] for item in wait(list(exits))), key=lambda follower: follower.rank)
        if self._stopping.is_set():
            return
        gone.process.join(STOP_GRACE_S)
        lost = RankLost(f"rank {gone.rank} of {self.world} (pid {gone.process.pid}) exited: "
                        f"{ended(gone.process.exitcode)}")
        log.error("tensor parallelism: %s", lost)
        on_lost(lost)

    def describe(self) -> list[dict[str, Any]]:
        """Every rank's pid and device, for /memory's plan (rank 0 is this process)."""
        return [{"rank": 0, "pid": os.getpid(), "device": str(self.device)},
                *({"rank": f.rank, "pid": f.process.pid, "device": str(f.device)} for f in self.followers)]

    def close(self, failure: str | None) -> None:
        """Stop every follower and reap it: Stop after a clean run (they exit 0), SIGKILL after a failure (the
        world is lost) and for any still alive after STOP_GRACE_S; then leave the world. Once; also at exit, so
        no follower outlives this process however it ends."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        clean = failure is None and self.leader is not None
        if clean:
            self.leader.stop("the server stops")
        for follower in self.followers:
            if not clean and follower.process.is_alive():
                follower.process.kill()
        for follower in self.followers:
            follower.process.join(self.stop_grace_s)
            if follower.process.is_alive():
                log.warning("tensor parallelism: %s did not exit within %g s: killed", follower.name,
                            self.stop_grace_s)
                follower.process.kill()
                follower.process.join()
            log.info("tensor parallelism: %s ended: %s", follower.name, ended(follower.process.exitcode))
            follower.reports.close()
            follower.life.close()
        if self.joined is not None:
            leave()
        atexit.unregister(self.close)


def _read(follower: Follower) -> Report | None:
    """The follower's next report, or None when its end is closed (the process ended or is ending)."""
    try:
        if follower.reports.poll():
            return follower.reports.recv()
    except (EOFError, OSError):
        return None
    return None
