"""The disk tier's resume puts each block's rows into the claim as the store verifies them, while the later blocks
are still read; a read that fails after some blocks went in leaves the claim fresh again (its pages given back,
its fixed states zeroed), so the fallback restores into it byte-equal and the counters say what happened."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_disk_tier import BLOCK_ROWS, disk_tier, settle
from tier_cases import LAYOUT, every_state, fill, paged, same_bytes, windowed

from tensorfold.tiers import HostTier, KeptTiers
from tensorfold.tiers.policy import HISTORY

PROMPT = tuple(range(40))
CUTS = (12, 32, 40)


def keep(tiers: KeptTiers, memory, at: int, seed: int):
    source = memory.take(f"s{at}", 40)
    fill(memory, source, at, seed=seed)
    states = every_state(memory, source.slot, at)
    tiers.keep_from(source, PROMPT[:at], tuple(c for c in CUTS if c <= at), frozenset({HISTORY}))
    memory.release(source)
    return states


def flip_last_block(tiers: KeptTiers, at: int) -> Path:
    store = tiers.disk.store
    (entry,) = [e for e in store.entries() if e.at == at]
    path = store.root / store.identity / "blocks" / f"{entry.blocks[-1]}.blk"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_blocks_go_in_as_they_are_read_and_the_state_comes_back_byte_equal(tmp_path, make, monkeypatch):
    memory = make()
    tiers = KeptTiers(None, None, disk_tier(memory, tmp_path))
    kept = keep(tiers, memory, 32, seed=1)
    settle(tiers.disk)
    store, seen = tiers.disk.store, []
    read = store.read

    def spying(entry, use=True, put=None, into=None):
        def put_and_note(first, rows, data):
            put(first, rows, data)
            seen.append(first)
        return read(entry, use, put_and_note, into)

    monkeypatch.setattr(store, "read", spying)
    hit = tiers.lookup(PROMPT, CUTS)
    claim = memory.take("resumer", 40)
    assert tiers.admitted(hit, claim, "resumer") == 32
    assert sorted(seen) == list(range(0, 32, BLOCK_ROWS))          # every block went in on its own
    assert same_bytes(every_state(memory, claim.slot, 32), kept)
    disk = tiers.disk
    assert disk.hits == 1 and disk.restored_bytes == hit.state.entry.nbytes and disk.describe()["disk_restored_bytes"]
    memory.release(claim)
    memory.check_integrity()
    tiers.close()


def test_a_read_that_fails_after_some_blocks_went_in_leaves_the_claim_fresh_and_falls_back(tmp_path):
    memory = paged()
    host = HostTier(memory, budget=1)
    host.budget = host.state_bytes(32)                   # room for one state: the next pushes the longer one down
    tiers = KeptTiers(None, host, disk_tier(memory, tmp_path))
    keep(tiers, memory, 32, seed=1)
    short = keep(tiers, memory, 12, seed=2)              # the state at 32 goes to the disk
    settle(tiers.disk)
    assert [s.at for s in host.states] == [12] and [e.at for e in tiers.disk.store.entries()] == [32]
    flip_last_block(tiers, 32)
    hit = tiers.lookup(PROMPT, CUTS)
    assert hit.tier is tiers.disk and hit.state.at == 32
    claim = memory.take("resumer", 40)
    resets = []
    reset = memory.reset
    memory.reset = lambda c: (resets.append(list(c.lease.pages)), reset(c))
    assert tiers.admitted(hit, claim, "resumer") == 12 and tiers.resumed_from == "host"
    assert len(resets) == 1 and len(resets[0]) == 4      # the failed read had taken the 32 rows' pages, given back
    assert len(claim.lease.pages) == 2                   # the fallback's 12 rows
    assert same_bytes(every_state(memory, claim.slot, 12), short)
    assert tiers.disk.failed_reads == 1 and tiers.disk.hits == 0 and host.hits == 1 and host.misses == 0
    memory.release(claim)
    memory.check_integrity()
    tiers.close()


def test_reset_gives_back_a_claims_pages_and_clears_its_slot():
    memory = paged()
    claim = memory.take("c", 40)
    fill(memory, claim, 20, seed=3)
    free = memory.pool.free
    memory.reset(claim)
    assert claim.lease.pages == [] and memory.pool.free == free + 3 and memory.kv.host_table(claim.slot) == ()
    assert all(bool((memory.kv.fixed(i, s.name, claim.slot) == 0).all())
               for i, layer in enumerate(LAYOUT.layers) for s in layer.fixed)
    memory.extend(claim, 40)                             # still reserved: it grows back to its whole reach
    assert len(claim.lease.pages) == 5
    memory.release(claim)
    memory.check_integrity()
