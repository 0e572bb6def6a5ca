"""Ranks 1..N-1: build the store rank 0 describes, then replay each step it sends until it stops."""

from __future__ import annotations

import logging

import torch

from tensorfold.family import FamilyModel
from tensorfold.follow.channel import Channel
from tensorfold.follow.messages import Start, Step, Stop
from tensorfold.kv import KvStore, PagedStore, WindowStore
from tensorfold.layout import Layout

log = logging.getLogger(__name__)


def store_for(start: Start, layout: Layout, device: torch.device) -> KvStore:
    """This rank's store: rank 0's slots and pages over this rank's Layout."""
    if start.paged:
        return PagedStore(layout, start.slots, start.pages, start.page_rows, device, start.poison)
    return WindowStore(layout, start.slots, start.capacity, device, start.poison)


def follow(channel: Channel, model: FamilyModel, layout: Layout, device: torch.device) -> str:
    """Replay rank 0's steps until it stops; return its reason. A lost rank 0 raises RankLost; a forward that
    raises here ends this follower (rank 0 then finds it gone)."""
    start = channel.receive()
    if not isinstance(start, Start):
        raise TypeError(f"rank {channel.rank}: the first message must be Start, got {type(start).__name__}")
    kv = store_for(start, layout, device)
    steps = 0
    with torch.inference_mode():
        while True:
            message = channel.receive()
            if isinstance(message, Stop):
                log.info("rank %d: rank 0 stopped after %d steps: %s", channel.rank, steps, message.reason)
                return message.reason
            if not isinstance(message, Step):
                raise TypeError(f"rank {channel.rank}: expected Step or Stop, got {type(message).__name__}")
            for command in message.commands:
                command.apply(kv)
            model.forward(message.plan, kv)
            steps += 1
