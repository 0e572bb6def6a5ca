"""Ranks 1..N-1: build the store rank 0 describes, then replay each step it sends until it stops: its store commands
on the store, its tier commands on this rank's parts of the kept states (tiers/mirror.py), its disk commands on
this rank's rows store (tiers/disk_mirror.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tensorfold.family import FamilyModel
from tensorfold.follow.channel import Channel
from tensorfold.follow.messages import Apply, Start, Step, Stop
from tensorfold.kv import KvStore, PagedStore, WindowStore
from tensorfold.layout import Layout
from tensorfold.tiers.disk_mirror import DISK_COMMANDS, DiskPart
from tensorfold.tiers.mirror import TIER_COMMANDS, Mirror

log = logging.getLogger(__name__)


def store_for(start: Start, layout: Layout, device: torch.device) -> KvStore:
    """This rank's store: rank 0's slots and pages over this rank's Layout."""
    if start.paged:
        return PagedStore(layout, start.slots, start.pages, start.page_rows, device, start.poison)
    return WindowStore(layout, start.slots, start.capacity, device, start.poison)


def follow(channel: Channel, model: FamilyModel, layout: Layout, device: torch.device,
           at_stop: Callable[[Mirror], None] | None = None) -> str:
    """Replay rank 0's steps until it stops; return its reason (`at_stop`, for tests, sees this rank's kept parts
    then). A lost rank 0 raises RankLost; a forward that raises here ends this follower (rank 0 then finds it
    gone)."""
    start = channel.receive()
    if not isinstance(start, Start):
        raise TypeError(f"rank {channel.rank}: the first message must be Start, got {type(start).__name__}")
    kv = store_for(start, layout, device)
    mirror = Mirror(kv)
    disk = DiskPart(kv, mirror, channel.rank, channel.agree)
    steps = 0
    try:
        with torch.inference_mode():
            while True:
                message = channel.receive()
                if isinstance(message, Stop):
                    log.info("rank %d: rank 0 stopped after %d steps: %s", channel.rank, steps, message.reason)
                    if at_stop is not None:
                        at_stop(mirror)
                    return message.reason
                if not isinstance(message, Step | Apply):
                    raise TypeError(f"rank {channel.rank}: expected Step, Apply or Stop, got "
                                    f"{type(message).__name__}")
                for command in message.commands:
                    if isinstance(command, TIER_COMMANDS):
                        mirror.apply(command)
                    elif isinstance(command, DISK_COMMANDS):
                        disk.apply(command)
                    else:
                        command.apply(kv)
                if isinstance(message, Step):
                    model.forward(message.plan, kv)
                    steps += 1
    finally:
        disk.close()
