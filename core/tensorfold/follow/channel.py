"""Rank 0's messages to its followers over torch.distributed, and the world they share.

Messages are pickled attrs records sent with `broadcast_object_list` from rank 0: the engine's own StepPlan and
journal commands, so nothing is translated twice. Pickle is safe here because both ends are ranks of one server,
started by it on one host (loopback) or one trusted cluster; the port is never a client's.

Two groups, so a dead rank is found within `timeout` seconds and an idle server never times out:

    steps    gloo: the broadcast of each message (pickled on the host); rank 0 waits at most `timeout` for it, a
             follower waits forever for the next one (the server may be idle for days; rank 0's death closes the
             socket and ends the wait)
    reduce   the row-parallel reductions inside a forward (shard.Shard.reduce), `timeout` on every rank: gloo on
             the CPU, NCCL on CUDA (each rank on its own device, set current before `join`)
"""

from __future__ import annotations

import logging
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist

from tensorfold.follow.messages import Message
from tensorfold.shard import RankLost, Shard

log = logging.getLogger(__name__)
FOREVER = timedelta(days=365)   # a follower's wait for rank 0's next step: idle is not a failure


def first_line(err: BaseException) -> str:
    """`Type: first line` of an error (gloo's messages run long)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


@attrs.define
class Channel:
    """The step broadcast from rank 0 to every follower."""

    rank: int
    world: int
    group: object = attrs.field(repr=False)

    def send(self, message: Message) -> None:
        """Rank 0: every follower gets `message` (RankLost when one is gone or does not take it in time)."""
        self._broadcast([message], "sending")

    def receive(self) -> Message:
        """A follower: the next message from rank 0 (RankLost when rank 0 is gone)."""
        box: list[Message | None] = [None]
        self._broadcast(box, "waiting for")
        return box[0]

    def agree(self, ok: bool) -> bool:
        """Every rank says whether its part of a joint operation succeeded; True only when every one did (the
        same answer on every rank; RankLost when a rank is gone)."""
        flags: list[bool | None] = [None] * self.world
        try:
            dist.all_gather_object(flags, ok, group=self.group)
        except Exception as err:
            raise RankLost(f"rank {self.rank} of {self.world}: agreeing on a disk read failed, a rank is gone "
                           f"({first_line(err)})") from err
        return all(flags)

    def _broadcast(self, box: list, doing: str) -> None:
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except Exception as err:
            raise RankLost(f"rank {self.rank} of {self.world}: {doing} a step failed, a rank is gone "
                           f"({first_line(err)})") from err


@attrs.frozen
class World:
    """This process's place in a TP world: its Shard (for the family's reductions) and the step channel."""

    shard: Shard
    channel: Channel


def backend_for(device: torch.device) -> str:
    """The reductions' backend on this device: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def join(rank: int, world: int, address: str, timeout_s: float, backend: str = "gloo") -> World:
    """Join the world at `address` (`tcp://host:port`, rank 0 listening); blocks until every rank has. The steps
    travel over gloo, the reductions over `backend`."""
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    short = timedelta(seconds=timeout_s)
    steps = dist.new_group(list(range(world)), timeout=short if rank == 0 else FOREVER, backend="gloo")
    reduce = dist.new_group(list(range(world)), timeout=short, backend=backend)
    log.info("rank %d of %d joined the tensor-parallel world at %s (reductions over %s)", rank, world, address,
             backend)
    return World(shard=Shard(rank=rank, world=world, group=reduce), channel=Channel(rank, world, steps))


def leave() -> None:
    """Tear the process group down (at a clean stop)."""
    if dist.is_initialized():
        dist.destroy_process_group()
