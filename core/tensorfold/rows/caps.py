"""The rows store's caps on what it writes: `--learn-gib` over every identity's states (least recently used go first),
`--learn-daily-gib` per UTC day, and `--learn-min-free-gib` of the disk left free."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tensorfold.rows.shelf import Shelf


class Capped(Protocol):
    """What the caps read of a store (RowsStore)."""

    directory: Path
    cap_bytes: int
    daily_bytes: int | None
    min_free_bytes: int


def cap_reason(store: Capped, budget: Any, state_bytes: int, new_bytes: int) -> tuple[str, str] | None:
    """(the counter, why) when a cap skips a write of `new_bytes` new bytes of a state of `state_bytes` (the day's
    spending read from `budget`); else None."""
    if state_bytes > store.cap_bytes:
        return "skipped_cap", (f"a state of {state_bytes} bytes is larger than --learn-gib ({store.cap_bytes} bytes): "
                               "it stays in RAM only")
    if store.daily_bytes is not None and budget.spent() + new_bytes > store.daily_bytes:
        return "skipped_daily", (f"--learn-daily-gib ({store.daily_bytes} bytes) is spent for "
                                 f"{budget.today()} UTC: states stay in RAM only until tomorrow")
    free = shutil.disk_usage(store.directory).free
    if free - new_bytes < store.min_free_bytes:
        return "skipped_floor", (f"{free} bytes free on {store.directory}; writing {new_bytes} would leave less than "
                                 f"--learn-min-free-gib ({store.min_free_bytes}): states stay in RAM only")
    return None


def evict_lru(shelves: Sequence[Shelf], reading: Counter[str], cap_bytes: int, keep: Collection[str]) -> int:
    """Remove least recently used states of every shelf (never a state being read), each with the blocks it leaves
    unlisted (except `keep`: blocks a write in progress relies on), until their bytes fit `cap_bytes`; then
    unlisted blocks. The states removed."""
    total = sum(s.bytes for s in shelves)
    if total <= cap_bytes:
        return 0
    order = sorted((e.used, i, n, k) for i, s in enumerate(shelves) for n, (k, e) in enumerate(s.states.items())
                   if k not in reading)
    evicted = 0
    for _, i, _, key in order:
        if total <= cap_bytes:
            break
        total -= shelves[i].drop(key, keep=keep)
        evicted += 1
    if total > cap_bytes:
        for shelf in shelves:
            shelf.orphans(keep=keep)
    return evicted
