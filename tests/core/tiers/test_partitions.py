"""Kept states are kept under their request's partition: every tier finds a state only in its own partition, two
partitions keeping the same tokens keep two states (on the device each over its own stream's pages, on disk under
other names), a state moves past only states of its own partition, and a state let go keeps its partition on the
way down to the host and the disk."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from tier_cases import LAYOUT, every_state, fill, paged, same_bytes, windowed

from tensorfold import learned
from tensorfold.image import ImageFormat, read_out, row_offset
from tensorfold.rows.store import RowsStore
from tensorfold.server.isolation import partition_of
from tensorfold.tiers import DeviceTier, HostTier, Keep, KeptTiers
from tensorfold.tiers.disk import DiskTier
from tensorfold.tiers.policy import HISTORY

BIG = 1 << 30
A = partition_of("salt a", None)
B = partition_of("salt b", None)
PROMPT = tuple(range(100, 130))
AT, CUTS = 16, (16, 30)           # a pass over PROMPT cuts at 16 and 30: it may resume from a state at 16
FMT = ImageFormat.of_layout("tiers-test", 1, LAYOUT)


def claim_for(memory, tiers: KeptTiers, hit, name: str):
    """A claim admitted with `hit` (sharing a device state's pages), restored; the rows resumed."""
    claim = memory.take(name, 40, hit.state.pages if hit is not None else ())
    at = tiers.admitted(hit, claim, name)
    tiers.ready()
    return claim, at


def disk_tier(memory, root: Path) -> DiskTier:
    store = RowsStore(root, {"test": "partitions"}, row_offset=partial(row_offset, LAYOUT, FMT), block_rows=8,
                      min_free_bytes=0)
    return DiskTier(memory, store, FMT, read_bytes_per_s=1e12, prefill_rows_per_s=1.0)


@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_the_same_tokens_in_two_partitions_are_two_device_states_each_found_only_in_its_own(make):
    memory = make()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG))
    device = tiers.device
    a, b = memory.take("a", 40), memory.take("b", 40)
    fill(memory, a, AT, seed=1)
    fill(memory, b, AT, seed=2)     # other bytes under the same tokens: a restore shows whose state it was
    kept_a, kept_b = every_state(memory, a.slot, AT), every_state(memory, b.slot, AT)
    assert tiers.keep_from(a, PROMPT[:AT], (AT,), frozenset({HISTORY}), A) == Keep("device")
    assert tiers.lookup(PROMPT, CUTS) is None and tiers.lookup(PROMPT, CUTS, B) is None
    assert tiers.keep_from(a, PROMPT[:AT], (AT,), frozenset({HISTORY}), A) == Keep("device", fresh=False)
    assert tiers.keep_from(b, PROMPT[:AT], (AT,), frozenset({HISTORY}), B) == Keep("device")
    assert tiers.keep_from(b, PROMPT[:AT], (AT,), frozenset({HISTORY})) == Keep("device")  # and the shared one
    state_a, state_b, shared = device.states
    assert (state_a.partition, state_b.partition, shared.partition) == (A, B, "")
    memory.release(a)
    memory.release(b)
    if memory.pool is not None:     # A's pages and B's: the shared state holds B's stream's pages too
        assert len(state_a.pages) == 2 and set(state_a.pages).isdisjoint(state_b.pages) and memory.pool.kept == 4
        assert memory.pool.kept_holds() == {**dict.fromkeys(state_a.pages, 1), **dict.fromkeys(state_b.pages, 2)}
    hit = tiers.lookup(PROMPT, CUTS, B)
    assert hit.state is state_b
    claim, at = claim_for(memory, tiers, hit, "resumer")
    assert at == AT and same_bytes(every_state(memory, claim.slot, AT), kept_b)
    memory.release(claim)
    assert device.hits == 1 and device.cached_tokens == AT
    while device.evict_one():       # every state goes down to the host tier, its partition with it
        pass
    assert [s.partition for s in tiers.host.states] == [A, "", B]  # least recently used first: B was resumed
    hit = tiers.lookup(PROMPT, CUTS, A)
    assert hit.tier is tiers.host and hit.state.partition == A
    claim, at = claim_for(memory, tiers, hit, "resumer")
    assert at == AT and same_bytes(every_state(memory, claim.slot, AT), kept_a)
    memory.release(claim)
    assert tiers.lookup(PROMPT, CUTS, partition_of("salt c", None)) is None
    tiers.check_integrity()
    memory.check_integrity()


def test_a_state_moves_past_only_states_of_its_own_partition():
    memory = paged()
    tiers = KeptTiers(DeviceTier(memory, BIG), None)
    source = memory.take("source", 40)
    fill(memory, source, 24, seed=3)
    tiers.keep_from(source, PROMPT[:16], (16,), frozenset({HISTORY}), A)
    tiers.keep_from(source, PROMPT[:24], (16, 24), frozenset({HISTORY}), B)   # B's conversation went on, not A's
    (older, newer) = tiers.device.states
    assert not older.passed
    tiers.keep_from(source, PROMPT[:24], (16, 24), frozenset({HISTORY}), A)   # A's did
    assert older.passed and not newer.passed
    memory.release(source)


def test_the_disk_tier_writes_and_finds_a_state_only_in_its_partition_across_a_reopen(tmp_path):
    memory = paged()
    disk = disk_tier(memory, tmp_path)
    tiers = KeptTiers(None, None, disk)
    source = memory.take("source", 40)
    fill(memory, source, AT, seed=4)
    kept = every_state(memory, source.slot, AT)
    image = read_out(memory.kv, source.slot, AT, FMT).to_bytes()
    assert tiers.keep_from(source, PROMPT[:AT], (AT,), frozenset({HISTORY}), A) == Keep("disk")
    assert disk.writer.settle(30)
    assert tiers.lookup(PROMPT, CUTS) is None and tiers.lookup(PROMPT, CUTS, B) is None
    assert tiers.keep_from(source, PROMPT[:AT], (AT,), frozenset({HISTORY})) == Keep("disk")
    assert disk.writer.settle(30)
    memory.release(source)
    entries = {entry.key: entry for entry in disk.store.entries()}
    salted = entries.pop(tiers.lookup(PROMPT, CUTS, A).state.entry.key)
    (shared,) = entries.values()
    assert salted.key != shared.key and set(salted.blocks).isdisjoint(shared.blocks) and len(salted.blocks) == 2
    assert disk.store.stats().written == 2
    disk.close()
    disk = disk_tier(memory, tmp_path)                  # a restart: the names alone tell the partitions apart
    tiers = KeptTiers(None, None, disk)
    assert tiers.lookup(PROMPT, CUTS).state.entry.key == shared.key
    assert tiers.lookup(PROMPT, CUTS, B) is None
    hit = tiers.lookup(PROMPT, CUTS, A)
    assert hit.state.entry.key == salted.key and hit.state.partition == A
    assert disk.store.read(hit.state.entry, use=False).to_bytes() == image
    claim, at = claim_for(memory, tiers, hit, "resumer")
    assert at == AT and same_bytes(every_state(memory, claim.slot, AT), kept) and disk.hits == 1
    memory.release(claim)
    disk.close()
    assert learned.verify(tmp_path) == {disk.store.identity: []}


@pytest.mark.parametrize("route", ["device", "host"])
def test_a_state_let_go_to_the_disk_keeps_its_partition(tmp_path, route):
    memory = paged()
    disk = disk_tier(memory, tmp_path)
    device = DeviceTier(memory, BIG) if route == "device" else None
    tiers = KeptTiers(device, HostTier(memory, BIG) if route == "host" else None, disk)
    source = memory.take("source", 40)
    fill(memory, source, AT, seed=5)
    assert tiers.keep_from(source, PROMPT[:AT], (AT,), frozenset({HISTORY}), A).tier == route
    memory.release(source)
    assert tiers.spill() == 1 and disk.writer.settle(30)
    (tiers.device or tiers.host).clear()
    assert tiers.lookup(PROMPT, CUTS) is None
    assert tiers.lookup(PROMPT, CUTS, A).state.partition == A
    disk.close()
