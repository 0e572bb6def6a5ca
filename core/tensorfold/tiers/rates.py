"""What the choice of a resume point predicts with: each tier's restore bandwidth and the model's prefill rate, a
default until measured, then a running average of what restores measured (docs/memory.md "Which state a request
resumes from").

    predicted time to first token of resuming from state S on tier T
        = restore_bytes(S, T) / bandwidth(T)  [· margin on the disk]  +  (len(prompt) − S.at) / prefill rate
    resuming from nothing = len(prompt) / prefill rate

restore_bytes: on the device the tail and fixed copies (the full pages are shared), on the host every byte of the
state, on disk its files. Each measured restore moves its tier's bandwidth half way to what it saw (an EWMA of
weight 1/2, rows/payoff.py observed_rate), so one odd restore cannot swing it all the way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from tensorfold.rows.payoff import observed_rate

if TYPE_CHECKING:
    from tensorfold.tiers.lanes import Timer

# Defaults until a restore of the tier is measured (bytes/s), by the store's device type. A device restore is a copy
# within device memory; a host restore a copy from (pinned, on CUDA) host memory.
DEVICE_BYTES_PER_S = {"cuda": 1e12, "cpu": 4e9}
HOST_BYTES_PER_S = {"cuda": 2.5e10, "cpu": 4e9}
PREFILL_ROWS_PER_S = 1e4      # the prefill rate with no disk tier (whose startup probe measures it)


@attrs.define
class Rate:
    """A rate (bytes/s or rows/s): `value` starts at a default; `observe` folds a measurement in."""

    value: float
    measured: int = 0

    def observe(self, amount: float, seconds: float) -> float:
        """Fold `amount` moved in `seconds` into the estimate (ignored when nothing moved); the new value."""
        if amount > 0 and seconds > 0:
            self.value = observed_rate(self.value, int(amount), seconds)
            self.measured += 1
        return self.value


class TimedRestores:
    """A RAM tier's restores, whose copies run on its lane: each one's time, once its copies are done, is folded
    into the tier's bandwidth and counters without the host ever waiting for it."""

    def _timing(self, rate: Rate) -> None:
        self.rate = rate
        self._timed: list[tuple[Timer, int]] = []     # restores whose copies may still run, and their bytes
        self.restored_bytes = 0
        self.restore_seconds = 0.0

    def _timed_restore(self, timer: Timer, nbytes: int) -> None:
        self._timed.append((timer, nbytes))
        self._harvest()

    def _harvest(self) -> None:
        """Fold the restores whose copies have finished into the bandwidth estimate (never waits)."""
        running = []
        for timer, nbytes in self._timed:
            seconds = timer.seconds()
            if seconds is None:
                running.append((timer, nbytes))
                continue
            self.restored_bytes += nbytes
            self.restore_seconds += seconds
            self.rate.observe(nbytes, seconds)
        self._timed = running

    @property
    def bytes_per_s(self) -> float:
        """The restore bandwidth the choice of a resume point predicts with."""
        self._harvest()
        return self.rate.value


def restore_seconds(nbytes: float, bytes_per_s: float) -> float:
    """Seconds to move `nbytes` at `bytes_per_s` (an unknown or zero rate: forever)."""
    if nbytes <= 0:
        return 0.0
    return nbytes / bytes_per_s if bytes_per_s > 0 else float("inf")


def prefill_seconds(rows: int, rows_per_s: float) -> float:
    """Seconds to prefill `rows` at `rows_per_s` (an unmeasured rate, <= 0: forever, so any kept state pays)."""
    if rows <= 0:
        return 0.0
    return rows / rows_per_s if rows_per_s > 0 else float("inf")
