"""A host hit moves up to the device tier when the device tier has room for it without letting any state go: after
it the state is on the device (its full pages the resumer's, held by reference; its tail and fixed copies made on
the way), gone from the host, and the next resume comes from the device, byte-equal, however the first resumer ran
on. With no room nothing is evicted for it and it stays on the host."""

from __future__ import annotations

import pytest
from test_host_restore import RecordingLane
from tier_cases import PAGE_ROWS, every_state, fill, paged, same_bytes, windowed

from tensorfold.tiers import DeviceTier, HostTier, KeptTiers
from tensorfold.tiers.policy import HISTORY, SYSTEM

BIG = 1 << 30


def on_host(tiers: KeptTiers, memory, at: int, seed: int, tokens: tuple[int, ...] | None = None):
    """A slot's state at `at`, kept on the device then let go to the host; its bytes."""
    source = memory.take(f"source{seed}", 40)
    fill(memory, source, at, seed=seed)
    kept = every_state(memory, source.slot, at)
    tokens = tuple(range(at)) if tokens is None else tokens
    assert tiers.keep_from(source, tokens, (at,), frozenset({HISTORY})).tier == "device"
    assert tiers.device.evict_one() and len(tiers.host) >= 1
    memory.release(source)
    return kept


def resume(tiers: KeptTiers, memory, prompt: tuple[int, ...], cuts: tuple[int, ...], name: str):
    hit = tiers.lookup(prompt, cuts)
    claim = memory.take(name, 40, hit.state.pages if hit is not None else ())
    at = tiers.admitted(hit, claim, name)
    tiers.ready()
    return hit, claim, at


@pytest.mark.parametrize("at", [8, 13, 20], ids=lambda a: f"at{a}")
@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_a_host_hit_moves_to_the_device_and_the_next_resume_comes_from_there(make, at):
    memory = make()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG))
    device, host = tiers.device, tiers.host
    kept = on_host(tiers, memory, at, seed=at)
    assert (len(device), len(host)) == (0, 1)
    prompt, cuts = tuple(range(at)) + (7, 7), (at, at + 2)
    hit, first, resumed = resume(tiers, memory, prompt, cuts, "first")
    assert hit.tier is host and resumed == at and tiers.resumed_from == "host"
    assert same_bytes(every_state(memory, first.slot, at), kept)
    assert (len(device), len(host), device.promoted, host.evicted) == (1, 0, 1, 1)
    (promoted,) = device.states
    full = at // PAGE_ROWS if memory.pool is not None else 0
    assert promoted.pages == tuple(first.lease.pages[:full]) if memory.pool is not None else promoted.pages == ()
    assert promoted.tail_start == full * PAGE_ROWS and promoted.why == {HISTORY}
    if memory.pool is not None:
        assert memory.pool.kept_holds() == {p: 1 for p in promoted.pages}
    tiers.check_integrity()
    fill(memory, first, 40, seed=99, start=at)          # the first resumer runs on: its rows >= at, its fixed states
    hit, second, resumed = resume(tiers, memory, prompt, cuts, "second")
    assert hit.tier is device and hit.state is promoted and resumed == at and tiers.resumed_from == "device"
    assert same_bytes(every_state(memory, second.slot, at), kept)
    assert (device.hits, host.hits, device.misses, host.misses) == (1, 1, 1, 1)
    memory.release(first)
    memory.release(second)
    tiers.check_integrity()
    memory.check_integrity()
    assert device.evict_one() and len(host) == 1         # let go again, it goes back down to the host
    hit, third, resumed = resume(tiers, memory, prompt, cuts, "third")
    assert hit.tier is host and same_bytes(every_state(memory, third.slot, at), kept)
    memory.release(third)


def test_with_no_room_on_the_device_nothing_is_evicted_and_it_stays_on_the_host():
    memory = paged()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG))
    device, host = tiers.device, tiers.host
    kept = on_host(tiers, memory, 20, seed=1)
    holder = memory.take("holder", 40)
    fill(memory, holder, 16, seed=2)
    tiers.keep_from(holder, tuple(range(100, 116)), (16,), frozenset({SYSTEM}))
    (resident,) = device.states
    device.budget = device.nbytes + device.promotion_bytes(20) - 1     # one byte short of room for it
    assert not device.has_room(20)
    hit, claim, at = resume(tiers, memory, tuple(range(22)), (20, 22), "resumer")
    assert hit.tier is host and at == 20 and same_bytes(every_state(memory, claim.slot, 20), kept)
    assert device.states == [resident] and device.evicted == 1 and device.promoted == 0   # the one eviction: on_host's
    assert len(host) == 1 and host.evicted == 0
    device.budget += 1                                                  # exactly room for it: it moves up
    memory.release(claim)
    hit, claim, at = resume(tiers, memory, tuple(range(22)), (20, 22), "again")
    assert hit.tier is host and device.promoted == 1 and len(device) == 2 and len(host) == 0
    assert device.nbytes == device.budget
    tiers.check_integrity()
    for held in (claim, holder):
        memory.release(held)


def test_without_a_device_tier_a_host_hit_stays_on_the_host():
    memory = paged()
    host = HostTier(memory, BIG)
    tiers = KeptTiers(None, host)
    source = memory.take("source", 40)
    fill(memory, source, 12, seed=3)
    tiers.keep_from(source, tuple(range(12)), (12,), frozenset({HISTORY}))
    hit, claim, at = resume(tiers, memory, tuple(range(14)), (12, 14), "resumer")
    assert hit.tier is host and at == 12 and len(host) == 1 and host.evicted == 0
    for held in (source, claim):
        memory.release(held)



class CountingLane(RecordingLane):
    """The recording lane, counting the elements each restore copies from the host."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: list[int] = []

    def to_device(self, host, own=False):
        self.copied.append(host.numel())
        return super().to_device(host, own)


@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_a_promotion_copies_nothing_more_from_the_host(make):
    """Its tail and fixed copies are cloned on the device from what the restore put into the claim."""
    memory = make()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG))
    kept = on_host(tiers, memory, 13, seed=5)
    plain = tiers.host.lane = CountingLane()
    claim = memory.take("plain", 40)
    tiers.host.restore(tiers.host.states[0], claim)               # not promoted: no device tier asked
    memory.release(claim)
    promoting = tiers.host.lane = CountingLane()
    hit, first, resumed = resume(tiers, memory, tuple(range(13)) + (7,), (13, 14), "first")
    assert hit.tier is tiers.host and tiers.device.promoted == 1 and resumed == 13
    assert promoting.copied == plain.copied and promoting.entered == 1
    (promoted,) = tiers.device.states
    assert same_bytes([t for _, _, t in promoted.fixed], kept[3:])
    memory.release(first)
