"""A follower process that `tensorfold serve` starts (follow/spawn.py): check, join, load its part, report, then
replay rank 0's steps until Stop.

Rank 0 decides everything a follower needs (family, checkpoint directory, dtype, this rank's device, the
rendezvous) and hands it over in a FollowerJob; the follower reads no flags and no environment switches of its own.
Two one-way pipes tie it to rank 0:

    reports   follower → rank 0: `checked` (the family, checkpoint and this rank's Layout are fine: rank 0 may
              join), `ready` (joined, its part loaded), or `failed` with the reason (then it exits 1)
    life      rank 0 → follower, never written: its end closing means rank 0 is gone, and the follower exits at
              once rather than outlive the server

SIGINT and SIGTERM are ignored: a terminal's Ctrl-C reaches the whole process group, and a supervisor may signal
every process of the server (systemd's control group, `timeout`); rank 0 handles the signal and stops its
followers with Stop. A follower is ended by rank 0 only (Stop, or SIGKILL once the world is lost).
Exit status: 0 after Stop; 1 when it failed to start, lost rank 0 or a collective failed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import attrs
import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.follow.channel import first_line, join, leave
from tensorfold.follow.follower import follow
from tensorfold.follow.rank import load_rank, rank_layout
from tensorfold.plugins import load_families
from tensorfold.shard import RankLost

log = logging.getLogger(__name__)
STAGES = ("checked", "ready", "failed")


@attrs.frozen
class FollowerJob:
    """What one follower runs: its place in the world, the model, and where it meets rank 0."""

    rank: int
    world: int
    address: str            # tcp://127.0.0.1:PORT, rank 0 listening
    family: str
    model: Path             # the checkpoint directory rank 0 serves
    dtype: str              # a torch dtype's name: float32, bfloat16, float16
    device: str             # this rank's device: cpu, or cuda:RANK counted from rank 0's
    backend: str            # the reductions' backend: gloo or nccl
    timeout_s: float        # --tp-timeout
    log_level: int = logging.INFO
    threads: int | None = None  # torch's intra-op threads on the CPU (None: torch's default)


@attrs.frozen
class Report:
    """A follower's word to rank 0 at startup."""

    rank: int
    stage: str
    detail: str = ""

    def __attrs_post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"a follower's report is one of {', '.join(STAGES)}, not {self.stage!r}")


def run_follower(job: FollowerJob, reports: Connection, life: Connection) -> None:
    """The process's target: start (reporting each stage), follow until Stop, leave; SystemExit(1) on failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=job.log_level, format=f"%(asctime)s %(levelname)s rank {job.rank} %(name)s: "
                        "%(message)s")
    threading.Thread(target=_leave_with_rank_0, args=(life, job.rank), name="tensorfold-rank0-watch",
                     daemon=True).start()
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    try:
        family = load_families([job.family])[job.family]
        checkpoint = Checkpoint(job.model)
        device, dtype = torch.device(job.device), getattr(torch, job.dtype)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        rank_layout(family, checkpoint, dtype, job.world)
        reports.send(Report(job.rank, "checked"))
        world = join(job.rank, job.world, job.address, job.timeout_s, job.backend)
        model, layout = load_rank(family, checkpoint, dtype, device, world.shard)
        reports.send(Report(job.rank, "ready", f"pid {os.getpid()} on {device}"))
    except Exception as err:
        log.exception("rank %d of %d failed to start", job.rank, job.world)
        _say(reports, Report(job.rank, "failed", first_line(err)))
        raise SystemExit(1) from err
    try:
        follow(world.channel, model, layout, device)
    except RankLost as err:
        log.error("rank %d of %d stops: %s", job.rank, job.world, err)
        raise SystemExit(1) from err
    leave()


def _say(reports: Connection, report: Report) -> None:
    """Send a report if rank 0 still listens."""
    try:
        reports.send(report)
    except OSError:
        pass


def _leave_with_rank_0(life: Connection, rank: int) -> None:
    """Wait for rank 0's end of `life` to close (it never writes), then end this process at once."""
    try:
        life.recv()
    except (EOFError, OSError):
        pass
    log.error("rank %d: rank 0 (the server) is gone; exiting", rank)
    os._exit(1)
