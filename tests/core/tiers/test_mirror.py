"""A follower's Mirror replays rank 0's tier commands from the store's journal (tiers/mirror.py): a twin store fed
the journal and the same forward writes ends with the same bytes in every slot a state was restored into, through
keeps, moves to the host, promotions, restores and drops, and holds a part for exactly rank 0's kept states. The
single-process path journals nothing (the journal is None there)."""

from __future__ import annotations

import types

import pytest
import torch
from tier_cases import LAYOUT, every_state, paged, same_bytes, windowed

from tensorfold.kv import PagedStore, WindowStore
from tensorfold.kv.journal import Clear
from tensorfold.tiers import DeviceTier, HostTier, KeptTiers
from tensorfold.tiers.mirror import TIER_COMMANDS, Adopt, Drop, HostRestore, Mirror, Restore, Snap, ToHost
from tensorfold.tiers.policy import HISTORY

BIG = 1 << 30


class Twin:
    """A follower's store and Mirror, fed rank 0's journal."""

    def __init__(self, memory) -> None:
        kv = memory.kv
        self.kv = PagedStore(LAYOUT, kv.slots, kv.pages, kv.page_rows, poison=True) if isinstance(kv, PagedStore) \
            else WindowStore(LAYOUT, kv.slots, kv.capacity, poison=True)
        self.mirror = Mirror(self.kv)
        self.source = memory.kv
        self.seen: list[type] = []

    def flush(self) -> None:
        commands, self.source.journal = self.source.journal, []
        for command in commands:
            self.seen.append(type(command))
            if isinstance(command, TIER_COMMANDS):
                self.mirror.apply(command)
            else:
                command.apply(self.kv)


def write(kv, slot: int, rows: int, seed: int, start: int = 0) -> None:
    """Rows [start, rows) and the fixed states, as a forward writes them (tier_cases.fill without the extend)."""
    gen = torch.Generator().manual_seed(seed)
    for i, layer in enumerate(LAYOUT.layers):
        for spec in layer.rows:
            first = start // spec.every
            values = torch.randn(rows // spec.every - first, *spec.shape, generator=gen)
            kv.write_rows(i, spec.name, slot, first * spec.every, values)
        for spec in layer.fixed:
            kv.fixed(i, spec.name, slot).copy_(torch.randn(*spec.shape, generator=gen))


def step(memory, twin: Twin, claim, rows: int, seed: int, start: int = 0) -> None:
    """One step on both ranks: rank 0's store commands sent first, then the same writes on each."""
    memory.extend(claim, rows)
    twin.flush()
    write(memory.kv, claim.slot, rows, seed, start)
    write(twin.kv, claim.slot, rows, seed, start)


def resume(tiers: KeptTiers, memory, twin: Twin, prompt, cuts, name: str):
    hit = tiers.lookup(prompt, cuts)
    claim = memory.take(name, 40, hit.state.pages if hit is not None else ())
    at = tiers.admitted(hit, claim, name)
    tiers.ready()
    twin.flush()
    return hit, claim, at


def both(memory, twin: Twin, slot: int, at: int) -> tuple[list, list]:
    return every_state(memory, slot, at), every_state(types.SimpleNamespace(kv=twin.kv), slot, at)


def keys(tiers: KeptTiers) -> set[int]:
    return {state.key for tier in tiers.tiers for state in tier.states}


@pytest.mark.parametrize("at", [8, 13, 20], ids=lambda a: f"at{a}")
@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_a_twin_fed_the_journal_restores_the_same_bytes_and_holds_the_same_states(make, at):
    memory = make()
    memory.kv.journal = []
    twin = Twin(memory)
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG))
    source = memory.take("source", 40)
    step(memory, twin, source, at, seed=at)
    kept = every_state(memory, source.slot, at)
    prompt, cuts = tuple(range(at)) + (7, 7), (at, at + 2)
    assert tiers.keep_from(source, prompt[:at], (at,), frozenset({HISTORY})).tier == "device"
    assert tiers.device.evict_one()                      # down to the host
    memory.release(source)
    hit, first, resumed = resume(tiers, memory, twin, prompt, cuts, "first")
    assert hit.tier is tiers.host and resumed == at and tiers.device.promoted == 1
    ours, theirs = both(memory, twin, first.slot, at)
    assert same_bytes(ours, kept) and same_bytes(theirs, kept)
    assert set(twin.mirror.parts) == keys(tiers)
    step(memory, twin, first, 40, seed=99, start=at)     # the resumer runs on past the promoted state
    hit, second, _ = resume(tiers, memory, twin, prompt, cuts, "second")
    assert hit.tier is tiers.device
    ours, theirs = both(memory, twin, second.slot, at)
    assert same_bytes(ours, kept) and same_bytes(theirs, kept)
    memory.release(first)
    memory.release(second)
    assert tiers.device.evict_one()
    hit, third, _ = resume(tiers, memory, twin, prompt, cuts, "third")
    ours, theirs = both(memory, twin, third.slot, at)
    assert hit.tier is tiers.host and same_bytes(ours, kept) and same_bytes(theirs, kept)
    assert set(twin.mirror.parts) == keys(tiers) and len(twin.mirror.parts) == 1
    tiers_seen = [kind for kind in twin.seen if kind in TIER_COMMANDS]
    assert tiers_seen[1:] == [Snap, ToHost, Drop, HostRestore, Adopt, Drop, Restore, ToHost, Drop, HostRestore,
                              Adopt, Drop]
    assert twin.seen.index(Snap) > twin.seen.index(Clear)   # a keep comes after the slot's own store commands


def test_the_single_process_path_journals_nothing():
    memory = paged()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG))
    source = memory.take("source", 40)
    memory.extend(source, 16)
    write(memory.kv, source.slot, 16, seed=1)
    assert tiers.keep_from(source, tuple(range(16)), (16,), frozenset({HISTORY})).tier == "device"
    assert tiers.device.evict_one()
    assert memory.kv.journal is None and {s.key for s in tiers.host.states} == {0}
