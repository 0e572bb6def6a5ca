"""What a tier of kept states reports, one record per tier: /memory, /metrics and the logs read it."""

from __future__ import annotations

import attrs


@attrs.frozen
class TierStats:
    """Counters since startup and use now, for one tier (`device`, `host`, ...)."""

    tier: str
    states: int             # states held now
    bytes: int              # bytes held now
    budget: int             # bytes the tier may hold
    kept: int               # states taken in (kept here, or moved here from a faster tier)
    hits: int               # resumes served from this tier
    misses: int             # lookups this tier could not serve
    evicted: int            # states that left this tier (moved down or dropped)
    refused: int            # states larger than the tier, never taken in
    cached_tokens: int      # prompt rows resumed from this tier, all requests together

    def as_dict(self) -> dict[str, int | str]:
        """The record as plain JSON values."""
        return attrs.asdict(self)
