"""The host tier: states the device tier lets go are copied to host memory byte for byte and come back byte-equal
in pieces; bytes follow `at`; eviction goes moved-past first, then least recently used, never the state being
resumed; a state larger than a tier is refused and counted; check_integrity sees what does not add up."""

from __future__ import annotations

import pytest
import torch
from tier_cases import LAYOUT, PAGE_ROWS, every_state, fill, paged, same_bytes, windowed

from tensorfold.pool.pages import PoolCorrupt
from tensorfold.tiers import DeviceTier, HostTier, KeptTiers, TierStats
from tensorfold.tiers.host import PIECE_BYTES
from tensorfold.tiers.policy import HISTORY, REWIND, SYSTEM

BIG = 1 << 30


def copies(state) -> list[torch.Tensor]:
    """A host state's rows then fixed states, in Layout order (as `every_state` reads a slot)."""
    return [t for _, _, t in state.rows] + [t for _, _, t in state.fixed]


def release_all(memory, *claims) -> None:
    for claim in claims:
        memory.release(claim)


@pytest.mark.parametrize("piece", [PIECE_BYTES, 40], ids=["64MiB", "40B"])
@pytest.mark.parametrize("at", [8, 13, 16, 20], ids=lambda a: f"at{a}")
@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_device_to_host_and_back_is_byte_equal(make, at, piece):
    memory = make()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG, piece_bytes=piece))
    device, host = tiers.device, tiers.host
    source = memory.take("source", 40)
    fill(memory, source, at, seed=at)
    kept = every_state(memory, source.slot, at)
    assert device.keep(device.snapshot(source, tuple(range(at)), (at,), frozenset({HISTORY})))
    fill(memory, source, 40, seed=99, start=at)  # the source runs on: rows >= at and its fixed states change
    assert device.evict_one() and len(device) == 0 and device.evicted == 1
    (held,) = host.states
    assert host.kept_total == 1 and held.why == {HISTORY} and held.pages == ()
    assert same_bytes(copies(held), kept)  # the host copy is the kept state, byte for byte
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in copies(held))  # no CUDA: ordinary memory
    memory.release(source)
    if memory.pool is not None:
        assert memory.pool.kept == 0 and memory.pool.free == memory.pool.total  # the device gave its pages back
    claim = memory.take("resumer", 40)
    host.restore(held, claim)
    host.ready()
    assert same_bytes(every_state(memory, claim.slot, at), kept)
    assert host.hits == 1 and host.cached_tokens == at
    memory.check_integrity()
    tiers.check_integrity()
    release_all(memory, claim)
    memory.check_integrity()


@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_a_slot_kept_straight_on_the_host_comes_back_byte_equal(make):
    memory = make()
    tiers = KeptTiers(None, HostTier(memory, BIG, piece_bytes=64))
    source = memory.take("source", 40)
    fill(memory, source, 21, seed=5)
    kept = every_state(memory, source.slot, 21)
    assert tiers.keep_from(source, tuple(range(21)), (21,), frozenset({HISTORY})).tier == "host"
    assert tiers.keep_from(source, tuple(range(21)), (21,), frozenset({REWIND})).fresh is False  # kept already
    (held,) = tiers.host.states
    assert held.why == {HISTORY, REWIND} and same_bytes(copies(held), kept)
    fill(memory, source, 40, seed=6, start=21)
    hit = tiers.lookup(tuple(range(30)), (21, 30))
    assert hit is not None and hit.tier is tiers.host and hit.state is held
    claim = memory.take("resumer", 40)
    tiers.admitted(hit, claim)
    tiers.ready()
    assert same_bytes(every_state(memory, claim.slot, 21), kept)
    tiers.check_integrity()
    release_all(memory, source, claim)
    memory.check_integrity()


@pytest.mark.parametrize("at", [16, 24, 32])
@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_bytes_are_rows_times_row_bytes_plus_fixed_bytes(make, at):
    memory = make()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG))
    source = memory.take("source", 40)
    fill(memory, source, at, seed=at)
    expected = at * LAYOUT.bytes_per_token + LAYOUT.fixed_bytes  # at is a multiple of the pooled state's every
    assert tiers.keep_from(source, tuple(range(at)), (at,), frozenset({HISTORY})).tier == "device"
    assert tiers.device.nbytes == expected == tiers.device.stats().bytes
    tiers.device.evict_one()
    assert tiers.host.nbytes == expected == tiers.host.state_bytes(at) == tiers.host.stats().bytes
    fill(memory, source, 40, seed=1, start=at)
    assert tiers.keep_from(source, tuple(range(40)), (at, 40), frozenset({HISTORY})).tier == "device"
    tiers.device.evict_one()
    assert tiers.host.nbytes == expected + 40 * LAYOUT.bytes_per_token + LAYOUT.fixed_bytes  # nothing shared
    tiers.check_integrity()
    release_all(memory, source)


def keep(tiers: KeptTiers, claim, memory, tokens: tuple[int, ...], why: str, seed: int):
    """Write a slot up to len(tokens) and keep it there."""
    fill(memory, claim, len(tokens), seed=seed)
    return tiers.keep_from(claim, tokens, (len(tokens),), frozenset({why}))


def test_the_host_evicts_moved_past_states_first_then_least_recently_used_never_the_spare():
    memory = paged()
    host = HostTier(memory, budget=1)
    host.budget = 3 * host.state_bytes(16) + host.state_bytes(24)
    tiers = KeptTiers(None, host)
    a, b, c = (memory.take(name, 40) for name in "abc")
    one, two, three = tuple(range(100, 124)), tuple(range(200, 216)), tuple(range(300, 316))
    keep(tiers, a, memory, one[:16], HISTORY, 1)  # conversation one's history end
    keep(tiers, b, memory, two, HISTORY, 2)
    keep(tiers, a, memory, one, REWIND, 3)  # conversation one goes on: its history end is moved past
    keep(tiers, c, memory, three, SYSTEM, 4)
    assert [s.at for s in host.states] == [16, 16, 24, 16] and [s.passed for s in host.states] == [1, 0, 0, 0]
    keep(tiers, c, memory, tuple(range(400, 416)), HISTORY, 5)  # full: the moved-past state goes, not two
    assert [s.tokens[0] for s in host.states] == [200, 100, 300, 400] and host.evicted == 1
    resumed = tiers.lookup(two + (7,), (16, 17))  # two is being resumed: marked used, and spared
    assert resumed.state.tokens == two
    assert host.evict_one(spare=resumed.state) and [s.tokens[0] for s in host.states] == [300, 400, 200]
    assert host.evict_one(spare=resumed.state) and [s.tokens[0] for s in host.states] == [400, 200]
    assert host.evict_one(spare=resumed.state) and host.evict_one(spare=resumed.state) is False
    assert host.states == [resumed.state] and host.evicted == 4
    host.check_integrity()
    release_all(memory, a, b, c)


def test_the_device_moves_moved_past_states_down_first_and_spares_the_one_being_resumed():
    memory = paged()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG))
    device, host = tiers.device, tiers.host
    a, b = memory.take("a", 40), memory.take("b", 40)
    one, two = tuple(range(100, 124)), tuple(range(200, 216))
    keep(tiers, b, memory, two, HISTORY, 1)  # least recently used
    keep(tiers, a, memory, one[:16], HISTORY, 2)
    fill(memory, a, 24, seed=3, start=16)
    device.budget = device.alone_bytes(device.states[0]) + device.alone_bytes(device.snapshot(a, one, (16, 24)))
    tiers.keep_from(a, one, (16, 24), frozenset({HISTORY}))  # moves past one[:16], which goes down, not two
    assert [s.tokens[:1] + (s.at,) for s in device.states] == [(200, 16), (100, 24)]
    assert [(s.at, s.passed) for s in host.states] == [(16, True)] and device.evicted == 1 and host.kept_total == 1
    assert tiers.evict_one(spare=device.states[0]) and [s.at for s in device.states] == [16]  # two stays
    assert tiers.evict_one(spare=device.states[0]) is False and len(host) == 2
    device.check_integrity()
    host.check_integrity()
    release_all(memory, a, b)
    device.clear()
    memory.check_integrity()
    assert memory.pool.free == memory.pool.total


def test_a_state_larger_than_a_tier_is_refused_there_and_counted():
    memory = paged()
    tiers = KeptTiers(DeviceTier(memory, budget=1), HostTier(memory, BIG))
    source = memory.take("s", 40)
    assert keep(tiers, source, memory, tuple(range(16)), HISTORY, 1).tier == "host"  # too large for the device
    assert tiers.device.refused == 1 and len(tiers.device) == 0 and tiers.host.kept_total == 1
    small = KeptTiers(DeviceTier(memory, budget=1), HostTier(memory, budget=tiers.host.state_bytes(16) - 1))
    assert keep(small, source, memory, tuple(range(16)), HISTORY, 1).tier is None
    assert small.device.refused == small.host.refused == 1 and len(small.host) == 0
    state = tiers.host.states[0]
    assert small.host.take(tiers.device.snapshot(source, state.tokens, state.cuts)) is False
    assert small.host.refused == 2
    assert memory.pool.kept == 0  # a refused state holds no page
    tiers.check_integrity()
    small.check_integrity()
    release_all(memory, source)


def test_integrity_sees_a_wrong_count_a_wrong_shape_and_an_overfull_tier():
    memory = paged()
    host = HostTier(memory, BIG)
    tiers = KeptTiers(None, host)
    source = memory.take("s", 40)
    keep(tiers, source, memory, tuple(range(16)), HISTORY, 1)
    host.check_integrity()
    host._bytes += 1
    with pytest.raises(PoolCorrupt, match="the tier counts"):
        host.check_integrity()
    host._bytes -= 1
    (held,) = host.states
    i, name, tensor = held.rows[0]
    held.rows = ((i, name, tensor[:-1]), *held.rows[1:])
    with pytest.raises(PoolCorrupt, match=f"holds layer {i} '{name}'"):
        host.check_integrity()
    held.rows = ((i, name, tensor), *held.rows[1:])
    host.budget = host.nbytes - 1
    with pytest.raises(PoolCorrupt, match="over its budget"):
        host.check_integrity()
    release_all(memory, source)


def test_stats_and_describe():
    memory = windowed()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG))
    source = memory.take("s", 40)
    keep(tiers, source, memory, tuple(range(16)), HISTORY, 1)
    tiers.device.evict_one()
    claim = memory.take("r", 40)
    tiers.admitted(tiers.lookup(tuple(range(20)), (16, 20)), claim)
    stats = tiers.stats()
    assert [s.tier for s in stats] == ["device", "host"] and all(isinstance(s, TierStats) for s in stats)
    # the host hit moved up to the device tier, which had room: it left the host (evicted there), kept on the device
    assert stats[1] == TierStats(tier="host", states=0, bytes=0, budget=BIG, kept=1,
                                 hits=1, misses=0, evicted=1, refused=0, cached_tokens=16)
    assert (stats[0].kept, stats[0].evicted, stats[0].misses, stats[0].hits, stats[0].states) == (2, 1, 1, 0, 1)
    described = tiers.describe()
    assert described["host_cache_states"] == 0 and described["prompt_cache_states"] == 1
    assert described["prompt_cache_promoted"] == 1 and described["host_restored_bytes"] == tiers.host.state_bytes(16)
    assert described["tiers"]["host"]["hits"] == 1 and described["host_cache_pinned"] is False
    release_all(memory, source, claim)


def test_a_host_tier_needs_a_budget():
    with pytest.raises(ValueError, match="above 0 bytes"):
        HostTier(paged(), 0)
    assert PAGE_ROWS == 8


def test_a_host_copy_of_another_dtype_is_named_not_cast():
    memory = paged()
    host = HostTier(memory, budget=1 << 30)
    source = memory.take("source", 40)
    fill(memory, source, 16, seed=1)
    assert host.keep_from(source, tuple(range(16)), (16,))
    state, = host.states
    (i, name, copy), = state.fixed
    state.fixed = ((i, name, copy.to(torch.bfloat16)),)
    with pytest.raises(PoolCorrupt, match=r"^a host state at 16 holds fixed 0 's' as \(2, 2\) torch.bfloat16, the "
                                          r"Layout declares \(2, 2\) torch.float32$"):
        host.check_integrity()
    claim = memory.take("resumer", 40)
    with pytest.raises(TypeError, match="^layer 0 s: the Layout declares torch.float32, the family wrote "
                                        "torch.bfloat16$"):
        host.restore(state, claim)
    memory.release(claim)
    memory.release(source)
