"""Rank 0's side: its model, wrapped so each forward is sent to the followers before it runs."""

from __future__ import annotations

import torch

from tensorfold.family import FamilyModel
from tensorfold.follow.channel import Channel, first_line
from tensorfold.follow.messages import Apply, Start, Step, Stop
from tensorfold.kv import KvStore, PagedStore, WindowStore
from tensorfold.plan import StepPlan
from tensorfold.shard import RankLost


def start_of(kv: KvStore) -> Start:
    """The store's shape, for the followers to build theirs alike."""
    if isinstance(kv, PagedStore):
        return Start(paged=True, slots=kv.slots, pages=kv.pages, page_rows=kv.page_rows, capacity=0,
                     poison=kv.poison)
    if isinstance(kv, WindowStore):
        return Start(paged=False, slots=kv.slots, pages=0, page_rows=0, capacity=kv.capacity, poison=kv.poison)
    raise TypeError(f"the follow protocol knows PagedStore and WindowStore, not {type(kv).__name__}")


class Leader:
    """A FamilyModel whose forward first sends the step (the store's journal since the last one and the plan) to
    every follower, then runs rank 0's part. It offers no tensor-only `decode`: at TP above 1 every step is a
    planned one (no CUDA graphs, no launch ahead)."""

    def __init__(self, model: FamilyModel, kv: KvStore, channel: Channel) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.channel = channel
        self.kv = kv
        self.stopped = False
        kv.journal = []
        channel.send(start_of(kv))

    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """Send the step, then run it here. Any failure is a lost world: the ranks' collectives would be out of
        step (a follower replays the step whatever rank 0's forward does), so the engine stops."""
        if kv is not self.kv:
            raise ValueError("the leader's forward runs on the store its followers mirror")
        commands, kv.journal = tuple(kv.journal), []
        self.channel.send(Step(commands, plan))
        try:
            return self.model.forward(plan, kv)
        except RankLost:
            raise
        except Exception as err:
            raise RankLost(f"rank 0's forward raised at TP={self.channel.world}; the ranks cannot stay in step: "
                           f"{first_line(err)}") from err

    def flush(self) -> None:
        """Send the journal now, without a step (a disk read at admission, the disk writes of a shutdown)."""
        commands, self.kv.journal = tuple(self.kv.journal), []
        if commands:
            self.channel.send(Apply(commands))

    def agree(self, ok: bool) -> bool:
        """Whether every rank's part of the read just sent succeeded (`ok` is rank 0's)."""
        return self.channel.agree(ok)

    def stop(self, reason: str) -> None:
        """Tell every follower to return, after the journal not sent yet (once; a world already lost is left as
        it is)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.flush()
            self.channel.send(Stop(reason))
        except RankLost:
            pass
