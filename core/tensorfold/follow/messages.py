"""The records rank 0 sends its followers, in order, over one broadcast each (channel.py).

    Start   once, first: the shape of the store every rank builds (kind, slots, pages, page rows, window)
    Step    before rank 0 runs a forward: the store and tier commands since the last step (kv/journal.py: clear,
            bind, fill, copy; tiers/mirror.py: keep, move, restore, drop), then the StepPlan itself; a follower
            applies the commands in order and runs the same plan
    Apply   commands that cannot wait for the next step (tiers/disk_mirror.py: a disk read rank 0 starts at
            admission; the disk writes a shutdown queues), applied in order with no forward
    Stop    rank 0 is stopping (its reason said once in each follower's log); followers return

A follower decides nothing: slots, pages, positions and tokens (the sampled ones included, inside the plan) are all
rank 0's. Kept states travel in the same journal: rank 0's device and host tiers record each keep, move, restore,
promotion and drop (tiers/mirror.py) among the store commands, and a follower mirrors them on its own part of
each state, so no value written outside a forward exists only on rank 0.
"""

from __future__ import annotations

import attrs

from tensorfold.kv.journal import Command
from tensorfold.plan import StepPlan


@attrs.frozen
class Start:
    """The store every rank builds: the same slots and pages as rank 0's, over its own part of each state."""

    paged: bool
    slots: int
    pages: int
    page_rows: int
    capacity: int        # a window store's rows per slot (TF_KV_PAGES off)
    poison: bool


@attrs.frozen
class Step:
    """One step: what rank 0 did to its store since the last one, then the plan every rank runs."""

    commands: tuple[Command, ...] = attrs.field(converter=tuple)
    plan: StepPlan


@attrs.frozen
class Apply:
    """What rank 0 did to its store and tiers since the last message, to be done now (no plan, no forward)."""

    commands: tuple[Command, ...] = attrs.field(converter=tuple)


@attrs.frozen
class Stop:
    """Rank 0 stops; its reason, for the followers' logs."""

    reason: str


Message = Start | Step | Apply | Stop
