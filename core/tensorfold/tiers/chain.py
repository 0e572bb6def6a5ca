"""The tiers together, fastest first: where a state is kept, which tier a request resumes from, and the counts.

    keep     on the device; when the device tier is off or refuses it (larger than the tier), in the host tier;
             when both are off or refuse it, staged for the disk tier
    lookup   the longest state any tier may resume from (device first on a tie; the disk only when longer and
             worth reading, tiers/disk.py); the tier that serves it counts a hit, every other tier a miss, once
             per admitted request; a disk read that fails its check falls back to the next shorter state on the
             host or on disk
    evict    the device tier lets a state go into the host tier (tiers/device.py), or into the disk tier when there
             is no host tier or the host refuses it; the host tier lets its states go into the disk tier, or drops
    close    at shutdown the states still kept in RAM are staged for the disk and its queue is flushed

Every state is kept under its request's partition, and a lookup, a fallback and the check for a state kept already
see only the request's own partition's states (tiers/policy.py).
"""

from __future__ import annotations

import logging

import attrs

from tensorfold.memory import Claim
from tensorfold.tiers.device import DeviceTier
from tensorfold.tiers.disk import DiskTier
from tensorfold.tiers.host import HostTier
from tensorfold.tiers.policy import mark_passed
from tensorfold.tiers.states import DiskState, HostState, KeptState
from tensorfold.tiers.stats import TierStats

log = logging.getLogger(__name__)


@attrs.frozen
class Hit:
    """The state a request resumes from, and the tier holding it."""

    tier: DeviceTier | HostTier | DiskTier
    state: KeptState | HostState | DiskState


@attrs.frozen
class Keep:
    """Where a keep point's state went: `tier` (None: refused by every tier), `fresh` False when already kept."""

    tier: str | None
    fresh: bool = True


class _HostThenDisk:
    """Where a device state let go goes: the host tier, and the disk tier when the host refuses it."""

    def __init__(self, host: HostTier, disk: DiskTier) -> None:
        self.host = host
        self.disk = disk

    def take(self, state: KeptState, spare: object | None = None) -> bool:
        return self.host.take(state, spare=spare) or self.disk.take(state)


class KeptTiers:
    """The device tier, the host tier below it and the disk tier below both; any may be off, not all."""

    def __init__(self, device: DeviceTier | None, host: HostTier | None, disk: DiskTier | None = None) -> None:
        if device is None and host is None and disk is None:
            raise ValueError("kept tiers need a device tier, a host tier, a disk tier or some of them")
        self.device = device
        self.host = host
        self.disk = disk
        if host is not None:
            host.lower = disk
        if device is not None:
            device.lower = host if disk is None else disk if host is None else _HostThenDisk(host, disk)
        self.ram: tuple[DeviceTier | HostTier, ...] = tuple(t for t in (device, host) if t is not None)
        self.tiers: tuple[DeviceTier | HostTier | DiskTier, ...] = tuple(
            t for t in (device, host, disk) if t is not None)
        self.resumed_from: str | None = None          # the tier the last admitted request resumed from

    def lookup(self, prompt: tuple[int, ...], cuts: tuple[int, ...], partition: str = "") -> Hit | None:
        """The longest state kept in `partition` a pass over `prompt` cut at `cuts` may resume from, in any tier;
        counts nothing."""
        best: Hit | None = None
        for tier in self.ram:
            state = tier.find(prompt, cuts, partition)
            if state is not None and (best is None or state.at > best.state.at):
                best = Hit(tier, state)
        if self.disk is not None:
            found = self.disk.find(prompt, cuts, beyond=best.state.at if best is not None else 0, partition=partition)
            if found is not None:
                best = Hit(self.disk, found)
        return best

    def admitted(self, hit: Hit | None, claim: Claim, owner: str = "") -> int:
        """A request was admitted with this hit: restore it into the claim and count hits and misses; the rows it
        resumes at (after a disk read that failed its check, a shorter state's; 0: the request prefills)."""
        self.resumed_from = hit.tier.name if hit is not None else None
        for tier in self.tiers:
            if hit is None or tier is not hit.tier:
                tier.misses += 1
        if self.disk is not None:
            self.disk.looked_up(owner)
        if hit is None:
            return 0
        if hit.tier is self.disk:
            return self._from_disk(hit, claim, owner)
        hit.tier.restore(hit.state, claim)
        return hit.state.at

    def _from_disk(self, hit: Hit, claim: Claim, owner: str) -> int:
        """Read a disk hit into the claim; when a read fails its check (the store forgets that state), fall back
        to the longest shorter state the host tier or the disk holds for the same pass, until one reads or none
        is left. The claim is untouched until a read succeeds, so a fallback restores into it as if first."""
        assert self.disk is not None
        while True:
            image = self.disk.read(hit.state, owner)
            if image is not None:
                self.resumed_from = self.disk.name
                return self.disk.put(hit.state, image, claim, owner)
            fallback = self._shorter(hit.state, owner)
            if fallback is None:
                self.resumed_from = None
                return 0
            log.info("%s: falling back to the state at %s on the %s tier", owner, f"{fallback.state.at:,}",
                     fallback.tier.name)
            if fallback.tier is not self.disk:
                fallback.tier.misses -= 1              # counted a miss at admission; it serves the request after all
                fallback.tier.restore(fallback.state, claim)
                self.resumed_from = fallback.tier.name
                return fallback.state.at
            hit = fallback

    def _shorter(self, state: DiskState, owner: str) -> Hit | None:
        """The longest state of its partition shorter than `state` a pass with its cuts may resume from, in a tier
        whose states share no pages (a fresh claim was taken without them)."""
        best: Hit | None = None
        for tier in self.ram:
            found = tier.find(state.tokens, state.cuts, state.partition)
            if found is not None and not found.pages and (best is None or found.at > best.state.at):
                best = Hit(tier, found)
        assert self.disk is not None
        found_disk = self.disk.find(state.tokens, state.cuts, beyond=best.state.at if best is not None else 0,
                                    partition=state.partition)
        self.disk.looked_up(owner)
        return Hit(self.disk, found_disk) if found_disk is not None else best

    def ready(self) -> None:
        """Wait for the restores' copies once, before the next step."""
        if self.host is not None:
            self.host.ready()

    def evict_one(self, spare: KeptState | HostState | None) -> bool:
        """Free pool pages: the device tier lets one state go (into the host tier); never `spare`."""
        return self.device is not None and self.device.evict_one(spare)

    def keep_from(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...], why: frozenset[str],
                  partition: str = "") -> Keep:
        """Keep the slot's state at `len(tokens)` with its reasons in `partition`, unless a tier holds that exact
        state there already."""
        for tier in self.ram:
            found = tier.find_exact(tokens, cuts, partition)
            if found is not None:
                if not why <= found.why:
                    found.why = found.why | why
                    self._moved_past(found)
                return Keep(tier.name, fresh=False)
        if self.device is not None:
            state = self.device.snapshot(claim, tokens, cuts, why, partition)
            self._moved_past(state)
            if self.device.keep(state):
                return Keep(self.device.name)
        if self.host is not None:
            held = self.host.keep_from(claim, tokens, cuts, why, partition=partition)
            if held is not None:
                self._moved_past(held)
                return Keep(self.host.name)
        if self.disk is not None and self.disk.keep_from(claim, tokens, cuts, why, partition):
            return Keep(self.disk.name)
        return Keep(None)

    def _moved_past(self, newer: KeptState | HostState) -> None:
        for tier in self.ram:
            mark_passed(newer, tier.states)

    def spill(self) -> int:
        """At shutdown, in the engine thread: stage every state still kept in RAM for the disk, most recently used
        first, device before host; how many were staged."""
        if self.disk is None:
            return 0
        return self.disk.spill(state for tier in self.ram for state in reversed(tier.states))

    def close(self) -> None:
        """At shutdown, after the engine thread stopped: flush the disk tier's queue within its bound."""
        if self.disk is not None:
            self.disk.close()

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
