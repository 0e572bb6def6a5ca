"""Which kept state a request resumes from: of every state it may resume from on any tier, the one with the least
predicted time to first token, restore bytes over the tier's bandwidth (times the margin on the disk) + prefill of
the rest (tiers/rates.py), nothing when prefilling from row 0 is predicted no slower; ties to the longer state, then
the faster tier; a longer disk state passed over is counted as declined; the bandwidths follow measured restores."""

from __future__ import annotations

import math

import pytest
from test_disk_tier import disk_tier, settle
from tier_cases import fill, paged

from tensorfold.tiers import DeviceTier, HostTier, KeptTiers
from tensorfold.tiers.chain import Hit
from tensorfold.tiers.policy import HISTORY
from tensorfold.tiers.rates import Rate, prefill_seconds, restore_seconds

BIG = 1 << 30
PROMPT = tuple(range(40))
CUTS = (8, 16, 20, 24, 32, 40)


def keep(tiers: KeptTiers, memory, at: int, seed: int) -> None:
    """The prompt's state at `at`, kept by the chain (the device tier when on, else the host, else the disk)."""
    source = memory.take(f"s{at}.{seed}", 40)
    fill(memory, source, at, seed=seed)
    tiers.keep_from(source, PROMPT[:at], tuple(c for c in CUTS if c <= at), frozenset({HISTORY}))
    memory.release(source)


def three_tiers(tmp_path):
    """Device, host and disk tiers over one paged memory, each holding states of the prompt."""
    memory = paged(slots=4, pages=48)
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG), disk_tier(memory, tmp_path))
    return memory, tiers


def by_tier(tiers: KeptTiers) -> dict[str, list[Hit]]:
    found: dict[str, list[Hit]] = {}
    for hit in tiers.candidates(PROMPT, CUTS):
        found.setdefault(hit.tier.name, []).append(hit)
    return found


def test_the_predicted_time_is_restore_plus_prefill_of_the_rest(tmp_path):
    memory, tiers = three_tiers(tmp_path)
    keep(tiers, memory, 16, seed=1)
    (hit,) = tiers.candidates(PROMPT, CUTS)
    tiers.device.rate.value, tiers.disk.prefill_rows_per_s = 1000.0, 50.0
    want = hit.tier.restore_bytes(hit.state) / 1000.0 + (40 - 16) / 50.0
    assert hit.tier.restore_bytes(hit.state) == hit.state.copy_bytes     # the full pages are shared: copies only
    assert tiers.predict(hit.tier, hit.state, 40) == pytest.approx(want)
    chosen = tiers.choose([hit], 40)
    assert chosen.state is hit.state and chosen.seconds == pytest.approx(want)
    tiers.close()


def test_a_slightly_shorter_state_on_the_device_beats_a_longer_one_on_disk(tmp_path):
    memory, tiers = three_tiers(tmp_path)
    keep(tiers, memory, 24, seed=1)
    tiers.device.budget = tiers.device.nbytes
    keep(tiers, memory, 20, seed=2)                  # pushes the state at 24 down: host tier
    tiers.host.budget = tiers.host.nbytes - 1
    tiers.host.evict_one()                           # and on to the disk
    settle(tiers.disk)
    found = by_tier(tiers)
    assert [h.state.at for h in found["device"]] == [20] and [h.state.at for h in found["disk"]] == [24]
    (disk,) = found["disk"]
    # reading the disk state takes as long as prefilling 40 rows; it saves 4
    tiers.disk.prefill_rows_per_s = 1000.0
    tiers.disk.read_bytes_per_s = disk.state.entry.nbytes / 0.040
    hit = tiers.lookup(PROMPT, CUTS)
    assert hit.tier is tiers.device and hit.state.at == 20
    assert tiers.disk._declining is not None and tiers.disk._declining[1] == 4
    claim = memory.take("resumer", 40, hit.state.pages)
    assert tiers.admitted(hit, claim, "resumer") == 20 and tiers.disk.declined == 1
    memory.release(claim)
    # a disk that reads it faster than 4 rows prefill: the longer state wins
    tiers.disk.read_bytes_per_s = disk.state.entry.nbytes / 0.001
    assert tiers.lookup(PROMPT, CUTS).tier is tiers.disk
    tiers.close()


def test_a_much_longer_state_on_the_host_beats_a_shorter_one_on_the_device(tmp_path):
    memory, tiers = three_tiers(tmp_path)
    keep(tiers, memory, 32, seed=1)
    tiers.device.budget = tiers.device.nbytes
    keep(tiers, memory, 8, seed=2)                   # the state at 32 goes to the host
    found = by_tier(tiers)
    assert [h.state.at for h in found["device"]] == [8] and [h.state.at for h in found["host"]] == [32]
    (host,) = found["host"]
    tiers.disk.prefill_rows_per_s = 1000.0           # 24 more rows: 24 ms of prefill
    tiers.host.rate.value = host.state.nbytes / 0.005    # copied in 5 ms
    hit = tiers.lookup(PROMPT, CUTS)
    assert hit.tier is tiers.host and hit.state.at == 32
    assert hit.seconds == pytest.approx(0.005 + 8 / 1000.0)
    tiers.host.rate.value = host.state.nbytes / 0.030    # copied in 30 ms: the device's shorter state is sooner
    assert tiers.lookup(PROMPT, CUTS).tier is tiers.device
    tiers.close()


def test_ties_go_to_the_longer_state_then_the_faster_tier_and_nothing_when_prefill_is_sooner(tmp_path):
    memory, tiers = three_tiers(tmp_path)
    source = memory.take("source", 40)
    fill(memory, source, 16, seed=1)
    tiers.keep_from(source, PROMPT[:16], (8, 16), frozenset({HISTORY}))
    tiers.device.evict_one()                         # on the host now
    assert tiers.device.keep(tiers.device.snapshot(source, PROMPT[:16], (8, 16)))   # and the same on the device
    memory.release(source)
    found = by_tier(tiers)
    assert [h.state.at for h in found["device"]] == [16] and [h.state.at for h in found["host"]] == [16]
    tiers.device.rate.value = tiers.host.rate.value = math.inf     # both restore in no time: a tie
    assert tiers.choose(reversed(tiers.candidates(PROMPT, CUTS)), 40).tier is tiers.device
    tiers.device.rate.value = tiers.host.rate.value = 1e-3         # restores slower than prefilling everything
    assert tiers.lookup(PROMPT, CUTS) is None
    tiers.disk.prefill_rows_per_s = 0.0                            # an unmeasured prefill rate: any state pays
    assert tiers.lookup(PROMPT, CUTS).tier is tiers.device
    tiers.disk.prefill_rows_per_s = math.nan                       # not a number: the longest in RAM, no disk
    assert tiers.lookup(PROMPT, CUTS).tier is tiers.device
    tiers.close()


def test_without_a_disk_tier_the_chain_predicts_with_its_own_prefill_rate():
    memory = paged()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG), prefill_rows_per_s=100.0)
    keep(tiers, memory, 16, seed=1)
    assert tiers.prefill_rows_per_s == 100.0
    (hit,) = tiers.candidates(PROMPT, CUTS)
    assert tiers.predict(hit.tier, hit.state, 40) == pytest.approx(
        restore_seconds(hit.state.copy_bytes, tiers.device.bytes_per_s) + prefill_seconds(24, 100.0))


def test_a_rate_moves_half_way_to_each_measurement_and_ignores_empty_ones():
    rate = Rate(100.0)
    assert rate.observe(300, 1.0) == 200.0 and rate.measured == 1
    assert rate.observe(0, 1.0) == 200.0 and rate.observe(10, 0.0) == 200.0 and rate.measured == 1
    assert restore_seconds(0, 0.0) == 0.0 and restore_seconds(10, 0.0) == math.inf
    assert prefill_seconds(0, 0.0) == 0.0 and prefill_seconds(10, 0.0) == math.inf


def test_a_measured_host_restore_moves_the_host_bandwidth():
    memory = paged()
    host = HostTier(memory, BIG)
    tiers = KeptTiers(None, host)
    keep(tiers, memory, 16, seed=1)
    before = host.bytes_per_s
    claim = memory.take("resumer", 40)
    tiers.admitted(tiers.lookup(PROMPT, CUTS), claim, "resumer")
    assert host.rate.measured == 1 and host.bytes_per_s != before and host.restored_bytes == host.state_bytes(16)
    memory.release(claim)
