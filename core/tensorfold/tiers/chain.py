"""The tiers together, fastest first: where a state is kept, which tier a request resumes from, and the counts.

    keep     on the device; when the device tier is off or refuses it (larger than the tier), in the host tier;
             when both are off or refuse it, staged for the disk tier
    lookup   of every state any tier may resume from, the one with the least predicted time to first token:
             restore bytes over the tier's bandwidth (times the margin on the disk) + prefill of the rest
             (tiers/rates.py; nothing when prefilling from row 0 is predicted no slower); ties go to the longer
             state, then the faster tier; the tier that serves it counts a hit, every other tier a miss, once
             per admitted request; a disk read that fails its check falls back the same way to a shorter state
             on the host or on disk
    promote  a host hit, restored into its claim, moves up to the device tier (its full pages held there by
             reference, tail and fixed copies made on the way) when the device tier has room for it without
             letting any state go; else it stays on the host
    evict    the device tier lets a state go into the host tier (tiers/device.py), or into the disk tier when there
             is no host tier or the host refuses it; the host tier lets its states go into the disk tier, or drops
    close    at shutdown the states still kept in RAM are staged for the disk and its queue is flushed

Every state is kept under its request's partition, and a lookup, a fallback and the check for a state kept already
see only the request's own partition's states (tiers/policy.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import attrs

from tensorfold.memory import Claim
from tensorfold.tiers.device import DeviceTier
from tensorfold.tiers.disk import DiskTier
from tensorfold.tiers.host import HostTier
from tensorfold.tiers.policy import mark_passed
from tensorfold.tiers.rates import PREFILL_ROWS_PER_S, prefill_seconds, restore_seconds
from tensorfold.tiers.states import DiskState, HostState, KeptState
from tensorfold.tiers.stats import TierStats

log = logging.getLogger(__name__)


@attrs.frozen
class Hit:
    """The state a request resumes from, the tier holding it, and its predicted seconds to the first token."""

    tier: DeviceTier | HostTier | DiskTier
    state: KeptState | HostState | DiskState
    seconds: float = 0.0


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

    def __init__(self, device: DeviceTier | None, host: HostTier | None, disk: DiskTier | None = None,
                 prefill_rows_per_s: float = PREFILL_ROWS_PER_S) -> None:
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
        self._prefill_rows_per_s = prefill_rows_per_s

    @property
    def prefill_rows_per_s(self) -> float:
        """The prefill rate the choice of a resume point predicts with: the disk tier's startup measure when there
        is one, else the chain's own (tiers/rates.py)."""
        return self.disk.prefill_rows_per_s if self.disk is not None else self._prefill_rows_per_s

    def predict(self, tier: DeviceTier | HostTier | DiskTier, state: KeptState | HostState | DiskState,
                prompt_rows: int) -> float:
        """Predicted seconds to the first token of a pass over `prompt_rows` rows resumed from `state` on `tier`:
        its restore (bytes over the tier's bandwidth, times the margin on the disk) + prefilling the rest."""
        return self._restore_s(tier, state) + prefill_seconds(prompt_rows - state.at, self.prefill_rows_per_s)

    def _restore_s(self, tier: DeviceTier | HostTier | DiskTier, state: KeptState | HostState | DiskState) -> float:
        seconds = restore_seconds(tier.restore_bytes(state), tier.bytes_per_s)
        return seconds * self.disk.margin if tier is self.disk and self.disk is not None else seconds

    def choose(self, candidates: Iterable[Hit], prompt_rows: int) -> Hit | None:
        """The candidate with the least predicted time to first token, None when prefilling from row 0 is
        predicted no slower (docs/memory.md). A candidate's score is its restore time minus the prefill time of
        the rows it skips (the prompt's own prefill time cancels out, so an unmeasured or unbounded rate still
        orders them); ties go to the longer state, then the faster tier. A prefill rate that is not a number
        reads nothing from disk and takes the longest state in RAM."""
        rate = self.prefill_rows_per_s
        best: tuple[tuple[float, int, int], Hit] | None = None
        for hit in candidates:
            if math.isnan(rate):
                if hit.tier is self.disk:
                    continue
                score = -math.inf
            else:
                score = self._restore_s(hit.tier, hit.state) - prefill_seconds(hit.state.at, rate)
            key = (score, -hit.state.at, self.tiers.index(hit.tier))
            if math.isnan(score) or not score < 0:
                continue
            if best is None or key < best[0]:
                best = (key, hit)
        if best is None:
            return None
        hit = best[1]
        return attrs.evolve(hit, seconds=self.predict(hit.tier, hit.state, prompt_rows))

    def candidates(self, prompt: tuple[int, ...], cuts: tuple[int, ...], partition: str = "") -> list[Hit]:
        """Every kept state of `partition` in any tier a pass over `prompt` cut at `cuts` may resume from, each
        tier's longest first, fastest tier first."""
        return [Hit(tier, state) for tier in self.tiers for state in tier.candidates(prompt, cuts, partition)]

    def lookup(self, prompt: tuple[int, ...], cuts: tuple[int, ...], partition: str = "") -> Hit | None:
        """The state kept in `partition`, in any tier, a pass over `prompt` cut at `cuts` resumes from: of every
        one it may resume from, the one with the least predicted time to first token (`choose`), marked used; a
        longer state on disk passed over is counted as declined once the request is admitted. Counts nothing
        else."""
        found = self.candidates(prompt, cuts, partition)
        hit = self.choose(found, len(prompt))
        self._declined(found, hit)
        if hit is not None:
            hit.tier.touch(hit.state)
        return hit

    def _declined(self, found: list[Hit], hit: Hit | None) -> None:
        """Tell the disk tier when its longest candidate was longer than the chosen state and not chosen."""
        if self.disk is None:
            return
        on_disk = [h for h in found if h.tier is self.disk]
        at = hit.state.at if hit is not None else 0
        if on_disk and on_disk[0].state.at > at and (hit is None or hit.tier is not self.disk):
            self.disk.decline(on_disk[0].state, on_disk[0].state.at - at)

    def admitted(self, hit: Hit | None, claim: Claim, owner: str = "") -> int:
        """A request was admitted with this hit: restore it into the claim and count hits and misses; the rows it
        resumes at (after a disk read that failed its check, a shorter state's; 0: the request prefills). A host
        hit moves up to the device tier when that has room for it without letting any state go."""
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
        self._restore(hit, claim)
        return hit.state.at

    def _restore(self, hit: Hit, claim: Claim) -> None:
        """Restore a device or host hit into the claim; a host hit is promoted (module docstring)."""
        if hit.tier is not self.host or self.device is None or not self.device.has_room(hit.state.at):
            hit.tier.restore(hit.state, claim)
            return
        state = hit.state
        made = self.host.restore(state, claim, promote=self.device.page_rows or 0)
        kept = self.device.adopt(claim, state.tokens, state.cuts, made.tail_start, made.tail, made.fixed, state.why,
                                 state.passed, state.partition)
        if kept is not None:
            self.host.forget(state)
            log.debug("promoted the state at %s from the host tier to the device tier", f"{state.at:,}")

    def _from_disk(self, hit: Hit, claim: Claim, owner: str) -> int:
        """Read a disk hit into the claim; when a read fails its check (the store forgets that state), fall back
        to the shorter state the host tier or the disk holds for the same pass with the least predicted time to
        first token, until one reads or none is left. A failed read leaves the claim fresh, so a fallback
        restores into it as if first."""
        assert self.disk is not None
        while True:
            at = self.disk.load(hit.state, claim, owner)
            if at is not None:
                self.resumed_from = self.disk.name
                return at
            fallback = self._shorter(hit.state, owner)
            if fallback is None:
                self.resumed_from = None
                return 0
            log.info("%s: falling back to the state at %s on the %s tier", owner, f"{fallback.state.at:,}",
                     fallback.tier.name)
            if fallback.tier is not self.disk:
                fallback.tier.misses -= 1              # counted a miss at admission; it serves the request after all
                fallback.tier.touch(fallback.state)
                fallback.tier.restore(fallback.state, claim)
                self.resumed_from = fallback.tier.name
                return fallback.state.at
            hit = fallback

    def _shorter(self, state: DiskState, owner: str) -> Hit | None:
        """Of the states of its partition shorter than `state` a pass with its cuts may resume from, in a tier
        whose states share no pages (a fresh claim was taken without them), the one `choose` takes."""
        found = [hit for hit in self.candidates(state.tokens, state.cuts, state.partition) if not hit.state.pages]
        chosen = self.choose(found, len(state.tokens))
        self._declined(found, chosen)
        assert self.disk is not None
        self.disk.looked_up(owner)
        return chosen

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
