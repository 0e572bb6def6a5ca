"""A process's resident memory, read from /proc, and its growth over time as one least-squares slope."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

MIB = 1 << 20


def status_kib(pid: int, field: str) -> int | None:
    """A `kB` field of /proc/PID/status (VmRSS, VmHWM, RssAnon...); None when the process or the field is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def rss_mib(pid: int) -> float | None:
    """The process's resident set (VmRSS) in MiB."""
    kib = status_kib(pid, "VmRSS")
    return None if kib is None else round(kib / 1024, 1)


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of y over x; None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return covariance / spread


def growth(samples: Sequence[tuple[float, float]], warmup: float) -> dict[str, float | int | None]:
    """MiB per minute over the (minute, MiB) samples taken at or after `warmup` minutes, and how many there were."""
    kept = [(t, mib) for t, mib in samples if t >= warmup]
    rate = slope(kept)
    return {"rss_slope_mib_per_min": None if rate is None else round(rate, 3), "slope_samples": len(kept)}
