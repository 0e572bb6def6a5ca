"""The tiers together, fastest first: where a state is kept, which tier a request resumes from, and the counts.

    keep     on the device; when the device tier is off or refuses it (larger than the tier), in the host tier
    lookup   the longest state any tier may resume from (device first on a tie); the tier that serves it counts a
             hit, every other tier a miss, once per admitted request
    evict    the device tier lets a state go into the host tier (tiers/device.py); the host tier drops
"""

from __future__ import annotations

import attrs

from tensorfold.engine.memory import Claim
from tensorfold.tiers.device import DeviceTier, KeptState
from tensorfold.tiers.host import HostState, HostTier
from tensorfold.tiers.policy import mark_passed
from tensorfold.tiers.stats import TierStats


@attrs.frozen
class Hit:
    """The state a request resumes from, and the tier holding it."""

    tier: DeviceTier | HostTier
    state: KeptState | HostState


@attrs.frozen
class Keep:
    """Where a keep point's state went: `tier` (None: refused by every tier), `fresh` False when already kept."""

    tier: str | None
    fresh: bool = True


class KeptTiers:
    """The device tier and the host tier below it; either may be off."""

    def __init__(self, device: DeviceTier | None, host: HostTier | None) -> None:
        if device is None and host is None:
            raise ValueError("kept tiers need a device tier, a host tier or both")
        self.device = device
        self.host = host
        if device is not None:
            device.lower = host
        self.tiers: tuple[DeviceTier | HostTier, ...] = tuple(t for t in (device, host) if t is not None)

    def lookup(self, prompt: tuple[int, ...], cuts: tuple[int, ...]) -> Hit | None:
        """The longest state a pass over `prompt` cut at `cuts` may resume from, in any tier; counts nothing."""
        best: Hit | None = None
        for tier in self.tiers:
            state = tier.find(prompt, cuts)
            if state is not None and (best is None or state.at > best.state.at):
                best = Hit(tier, state)
        return best

    def admitted(self, hit: Hit | None, claim: Claim) -> None:
        """A request was admitted with this hit: restore it into the claim and count hits and misses."""
        for tier in self.tiers:
            if hit is None or tier is not hit.tier:
                tier.misses += 1
        if hit is not None:
            hit.tier.restore(hit.state, claim)

    def ready(self) -> None:
        """Wait for the restores' copies once, before the next step."""
        if self.host is not None:
            self.host.ready()

    def evict_one(self, spare: KeptState | HostState | None) -> bool:
        """Free pool pages: the device tier lets one state go (into the host tier); never `spare`."""
        return self.device is not None and self.device.evict_one(spare)

    def keep_from(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...], why: frozenset[str]) -> Keep:
        """Keep the slot's state at `len(tokens)` with its reasons, unless a tier holds that exact state already."""
        for tier in self.tiers:
            found = tier.find_exact(tokens, cuts)
            if found is not None:
                if not why <= found.why:
                    found.why = found.why | why
                    self._moved_past(found)
                return Keep(tier.name, fresh=False)
        if self.device is not None:
            state = self.device.snapshot(claim, tokens, cuts, why)
            self._moved_past(state)
            if self.device.keep(state):
                return Keep(self.device.name)
        if self.host is not None:
            held = self.host.keep_from(claim, tokens, cuts, why)
            if held is not None:
                self._moved_past(held)
                return Keep(self.host.name)
        return Keep(None)

    def _moved_past(self, newer: KeptState | HostState) -> None:
        for tier in self.tiers:
            mark_passed(newer, tier.states)

    def check_integrity(self) -> None:
        """Every tier's own check."""
        for tier in self.tiers:
            tier.check_integrity()

    def stats(self) -> list[TierStats]:
        """Every tier's TierStats, fastest first."""
        return [tier.stats() for tier in self.tiers]

    def describe(self) -> dict[str, object]:
        """Numbers for /memory: each tier's own, and every tier's TierStats by name."""
        out: dict[str, object] = {}
        for tier in self.tiers:
            out |= tier.describe()
        out["tiers"] = {stats.tier: stats.as_dict() for stats in self.stats()}
        return out
