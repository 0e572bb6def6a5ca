"""A disk read that fails its check falls back to the next shorter state of the same pass, on disk or on the
host, before prefilling from row 0; the restored bytes are that state's, and the counters say what happened."""

from __future__ import annotations

import logging
from pathlib import Path

from test_disk_tier import disk_tier, resume, settle
from tier_cases import every_state, fill, paged, windowed

from tensorfold.tiers import HostTier, KeptTiers
from tensorfold.tiers.policy import HISTORY

PROMPT = tuple(range(24))
CUTS = (12, 20, 24)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def keep(tiers: KeptTiers, memory, name: str, at: int, seed: int):
    """A source slot holding `at` rows of the prompt, kept at `at`; its claim and every state's bytes."""
    source = memory.take(name, 40)
    fill(memory, source, at, seed=seed)
    states = every_state(memory, source.slot, at)
    tiers.keep_from(source, PROMPT[:at], tuple(c for c in CUTS if c <= at), frozenset({HISTORY}))
    return source, states


def state_file(tiers: KeptTiers, at: int) -> Path:
    disk = tiers.disk
    (entry,) = [e for e in disk.store.entries() if e.at == at]
    return disk.store.root / disk.store.identity / "states" / f"{entry.key}.st"


def test_a_damaged_longer_state_falls_back_to_a_shorter_one_on_disk(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tensorfold.tiers")
    memory = windowed()
    tiers = KeptTiers(None, None, disk_tier(memory, tmp_path))
    short, short_states = keep(tiers, memory, "short", 12, seed=1)
    long, _ = keep(tiers, memory, "long", 20, seed=2)
    settle(tiers.disk)
    flip_a_byte(state_file(tiers, 20))
    hit, claim, at = resume(tiers, memory, PROMPT, CUTS)
    assert hit.state.at == 20 and at == 12 and tiers.resumed_from == "disk"
    assert all(bool((a == b).all()) for a, b in zip(every_state(memory, claim.slot, 12), short_states, strict=True))
    disk = tiers.disk
    assert disk.failed_reads == 1 and disk.hits == 1 and disk.cached_tokens == 12
    assert disk.store.stats().damaged == 1 and disk.describe()["disk_read_seconds"] > 0
    assert disk.read_bytes_per_s < 1e12        # the startup figure (FAST_DISK) gave way to the measured read
    assert "the payoff rule now reads at" in caplog.text
    assert "falling back to the state at 12 on the disk tier" in caplog.text
    for held in (short, long, claim):
        memory.release(held)
    tiers.close()


def test_a_damaged_state_falls_back_to_the_host_and_with_nothing_shorter_prefills(tmp_path):
    memory = paged()
    host = HostTier(memory, budget=1)
    host.budget = host.state_bytes(20)                     # room for one state: the next pushes it to the disk
    tiers = KeptTiers(None, host, disk_tier(memory, tmp_path))
    long, _ = keep(tiers, memory, "long", 20, seed=2)
    short, short_states = keep(tiers, memory, "short", 12, seed=1)   # pushes the state at 20 to the disk
    settle(tiers.disk)
    assert [s.at for s in host.states] == [12] and [e.at for e in tiers.disk.store.entries()] == [20]
    flip_a_byte(state_file(tiers, 20))
    hit, claim, at = resume(tiers, memory, PROMPT, CUTS)
    assert hit.tier is tiers.disk and at == 12 and tiers.resumed_from == "host"
    assert all(bool((a == b).all()) for a, b in zip(every_state(memory, claim.slot, 12), short_states, strict=True))
    assert host.hits == 1 and host.misses == 0 and tiers.disk.failed_reads == 1
    for held in (short, long, claim):
        memory.release(held)
    only_disk = KeptTiers(None, None, tiers.disk)          # nothing shorter left anywhere: prefill from row 0
    again, _ = keep(only_disk, memory, "again", 20, seed=3)
    settle(only_disk.disk)
    flip_a_byte(state_file(only_disk, 20))
    hit, fresh, at = resume(only_disk, memory, PROMPT, CUTS, name="fresh")
    assert hit is not None and at == 0 and only_disk.resumed_from is None and only_disk.disk.failed_reads == 2
    for held in (again, fresh):
        memory.release(held)
    tiers.close()
