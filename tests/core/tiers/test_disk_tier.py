"""The disk tier over a real rows store in a temporary directory: states the host tier (or the device tier, with no
host tier) lets go are written by the I/O thread and come back byte-equal, pooled entries and fixed states
included; the store's image of a state is its read_out image; a state is never written twice; the payoff rule's
declines and failed reads are counted and leave the claim as a fresh one; shutdown writes what RAM still keeps
within its bound; TF_IMPRINT_VERIFY reads every write back; the I/O thread's staging bound and flush."""

from __future__ import annotations

import logging
import threading
from functools import partial
from pathlib import Path

import pytest
from tier_cases import LAYOUT, every_state, fill, paged, same_bytes, windowed

from tensorfold.image import ImageFormat, read_out, row_offset
from tensorfold.rows.store import RowsStore
from tensorfold.rows.writer import Writer
from tensorfold.tiers import DeviceTier, DiskState, HostTier, KeptTiers
from tensorfold.tiers.disk import DiskTier
from tensorfold.tiers.policy import HISTORY, REWIND

BIG = 1 << 30
FMT = ImageFormat.of_layout("tiers-test", 1, LAYOUT)
FACTS = {"test": "disk tier"}
BLOCK_ROWS = 8  # a multiple of the pooled state's every (4)
FAST_DISK = dict(read_bytes_per_s=1e12, prefill_rows_per_s=1.0)  # every read pays


def store(root: Path, facts: dict[str, str] = FACTS) -> RowsStore:
    return RowsStore(root, facts, row_offset=partial(row_offset, LAYOUT, FMT), block_rows=BLOCK_ROWS,
                     min_free_bytes=0)


def disk_tier(memory, root: Path, **kwargs) -> DiskTier:
    return DiskTier(memory, store(root), FMT, **{**FAST_DISK, **kwargs})


def settle(disk: DiskTier) -> None:
    assert disk.writer.settle(30), "the I/O thread did not finish its writes"


def resume(tiers: KeptTiers, memory, prompt: tuple[int, ...], cuts: tuple[int, ...], name: str = "resumer"):
    """Look `prompt` up and admit it into a fresh claim; the hit, the claim and the rows resumed."""
    hit = tiers.lookup(prompt, cuts)
    claim = memory.take(name, 40)
    at = tiers.admitted(hit, claim, name)
    tiers.ready()
    return hit, claim, at


@pytest.mark.parametrize("route", ["host", "device"], ids=["host-lets-go", "device-lets-go"])
@pytest.mark.parametrize("at", [8, 13, 20], ids=lambda a: f"at{a}")
@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_a_state_let_go_is_written_and_comes_back_byte_equal(tmp_path, make, at, route):
    memory = make()
    disk = disk_tier(memory, tmp_path)
    if route == "host":
        host = HostTier(memory, budget=1)
        host.budget = host.state_bytes(at)  # room for one state: the next one pushes it to the disk
        tiers = KeptTiers(None, host, disk)
    else:
        tiers = KeptTiers(DeviceTier(memory, budget=BIG), None, disk)
    source = memory.take("source", 40)
    tokens = tuple(range(100, 100 + at))
    fill(memory, source, at, seed=at)
    kept = every_state(memory, source.slot, at)
    image = read_out(memory.kv, source.slot, at, FMT).to_bytes()
    assert tiers.keep_from(source, tokens, (at,), frozenset({HISTORY})).tier == route
    if route == "device":
        tiers.device.budget = tiers.device.nbytes  # room for this one state
    other = memory.take("other", 40)
    fill(memory, other, 8, seed=99)
    assert tiers.keep_from(other, tuple(range(500, 508)), (8,), frozenset({HISTORY})).tier == route  # pushes it down
    fill(memory, source, 40, seed=7, start=at)  # the source runs on past `at`
    settle(disk)
    assert disk.staged >= 1 and disk.store.stats().written >= 1
    (entry,) = [e for e in disk.store.entries() if e.at == at]
    assert disk.store.read(entry).to_bytes() == image  # the file holds the state's image, byte for byte
    assert tiers.ram[0].evicted == 1 and len(tiers.ram[0]) == 1
    hit, claim, resumed = resume(tiers, memory, tokens + (1, 2), (at, at + 2))
    assert isinstance(hit.state, DiskState) and hit.tier is disk and resumed == at
    assert same_bytes(every_state(memory, claim.slot, at), kept)
    assert read_out(memory.kv, claim.slot, at, FMT).to_bytes() == image
    assert disk.hits == 1 and disk.cached_tokens == at and disk.stats().hits == 1
    tiers.check_integrity()
    for held in (source, other, claim):
        memory.release(held)
    memory.check_integrity()
    tiers.close()


@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_with_no_ram_tier_a_slot_is_kept_straight_on_disk_once(tmp_path, make, caplog):
    caplog.set_level(logging.INFO, logger="tensorfold.tiers.disk_write")
    memory = make()
    tiers = KeptTiers(None, None, disk_tier(memory, tmp_path))
    disk = tiers.disk
    source = memory.take("source", 40)
    fill(memory, source, 21, seed=5)
    kept = every_state(memory, source.slot, 21)
    assert tiers.keep_from(source, tuple(range(21)), (16, 21), frozenset({HISTORY})).tier == "disk"
    assert tiers.keep_from(source, tuple(range(21)), (16, 21), frozenset({REWIND})).tier == "disk"
    fill(memory, source, 40, seed=6)  # the staged copies do not move with the slot, whenever the I/O thread runs
    settle(disk)
    assert disk.store.stats().written == 1 and disk.writes.on_disk_already == 1  # the second one was on disk already
    assert "kept at 21 (history end) on disk" in caplog.text
    assert tiers.lookup(tuple(range(21)), (16, 21)) is None  # no prompt row would be left
    assert tiers.lookup(tuple(range(30)), (16, 30)) is None  # cut elsewhere: another pass's arithmetic
    hit, claim, at = resume(tiers, memory, tuple(range(30)), (16, 21, 30))
    assert at == 21 and same_bytes(every_state(memory, claim.slot, 21), kept)
    assert disk.misses == 0 and disk.stats().kept == 1 and disk.stats().states == 1
    memory.release(source)
    memory.release(claim)
    tiers.close()


def test_a_read_the_payoff_rule_declines_is_counted_and_logged_and_nothing_is_restored(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tensorfold.tiers.disk")
    memory = paged()
    disk = disk_tier(memory, tmp_path, read_bytes_per_s=1.0, prefill_rows_per_s=1e9)  # prefilling always wins
    tiers = KeptTiers(None, None, disk)
    source = memory.take("source", 40)
    fill(memory, source, 16, seed=3)
    tiers.keep_from(source, tuple(range(16)), (16,), frozenset({HISTORY}))
    settle(disk)
    hit, claim, at = resume(tiers, memory, tuple(range(20)), (16, 20))
    assert hit is None and at == 0 and disk.declined == 1 and disk.store.stats().declined == 1
    assert disk.misses == 1 and disk.hits == 0
    assert "resumer: declined the state at 16 on disk" in caplog.text
    disk.read_bytes_per_s, disk.prefill_rows_per_s = 1e12, 1.0
    hit, again, at = resume(tiers, memory, tuple(range(20)), (16, 20), name="again")
    assert at == 16 and disk.declined == 1  # counted once per admitted request
    for held in (source, claim, again):
        memory.release(held)
    tiers.close()


def test_a_damaged_state_is_counted_forgotten_and_the_claim_left_fresh(tmp_path, caplog):
    memory = windowed()
    disk = disk_tier(memory, tmp_path)
    tiers = KeptTiers(None, None, disk)
    source = memory.take("source", 40)
    fill(memory, source, 20, seed=4)
    tiers.keep_from(source, tuple(range(20)), (20,), frozenset({HISTORY}))
    settle(disk)
    (state_file,) = (tmp_path / disk.store.identity / "states").glob("*.st")
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state_file.write_bytes(bytes(data))
    hit, claim, at = resume(tiers, memory, tuple(range(24)), (20, 24))
    assert hit is not None and hit.tier is disk and at == 0  # the request prefills from row 0
    assert disk.failed_reads == 1 and disk.store.stats().damaged == 1 and disk.hits == 0
    assert all(bool((memory.kv.fixed(i, s.name, claim.slot) == 0).all())
               for i, layer in enumerate(LAYOUT.layers) for s in layer.fixed)
    assert tiers.lookup(tuple(range(24)), (20, 24)) is None  # forgotten
    assert "the state at 20 on disk failed its check" in caplog.text
    memory.release(source)
    memory.release(claim)
    tiers.close()


def test_shutdown_writes_the_states_ram_still_keeps_and_a_new_store_finds_them(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tensorfold.tiers.disk")
    memory = paged()
    tiers = KeptTiers(DeviceTier(memory, BIG), HostTier(memory, BIG), disk_tier(memory, tmp_path, verify=True))
    a, b = memory.take("a", 40), memory.take("b", 40)
    fill(memory, a, 16, seed=1)
    fill(memory, b, 24, seed=2)
    kept = {16: every_state(memory, a.slot, 16), 24: every_state(memory, b.slot, 24)}
    tiers.keep_from(a, tuple(range(16)), (16,), frozenset({HISTORY}))
    tiers.keep_from(b, tuple(range(50, 74)), (24,), frozenset({HISTORY}))
    tiers.device.evict_one()  # the first state moves to the host tier
    assert len(tiers.device) == len(tiers.host) == 1 and tiers.disk.staged == 0
    assert tiers.spill() == 2
    tiers.close()
    disk = tiers.disk
    assert disk.store.stats().written == 2 and disk.writes.verified == 2 and disk.writes.mismatches == 0
    assert "disk tier closed: 2 states written at shutdown" in caplog.text
    used = {e.at: e.used for e in disk.store.entries()}
    assert used[24] > used[16]   # the device's state, used last, is written first and still the newer for the cap
    memory.release(a)
    memory.release(b)
    reopened = KeptTiers(None, None, disk_tier(memory, tmp_path))
    assert {e.at for e in reopened.disk.store.entries()} == {16, 24}
    for tokens, at in ((tuple(range(16)), 16), (tuple(range(50, 74)), 24)):
        _, claim, resumed = resume(reopened, memory, tokens + (9,), (at, at + 1), name=f"r{at}")
        assert resumed == at and same_bytes(every_state(memory, claim.slot, at), kept[at])
        memory.release(claim)
    reopened.check_integrity()
    reopened.close()


def test_a_shutdown_past_its_bound_drops_what_is_left_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tensorfold.tiers.disk")
    memory = paged()
    disk = disk_tier(memory, tmp_path, flush_s=0.0)
    tiers = KeptTiers(DeviceTier(memory, BIG), None, disk)
    claim = memory.take("a", 40)
    for k in range(4):
        fill(memory, claim, 8 * (k + 1), seed=k, start=8 * k)
        tiers.keep_from(claim, tuple(range(8 * (k + 1))), tuple(8 * (j + 1) for j in range(k + 1)),
                        frozenset({HISTORY}))
    assert tiers.spill() == 4
    tiers.close()
    written = disk.store.stats().written
    assert written + disk.writer.dropped == 4
    assert f"{written} states written at shutdown" in caplog.text
    memory.release(claim)


def test_stats_describe_and_integrity(tmp_path):
    memory = paged()
    disk = disk_tier(memory, tmp_path)
    tiers = KeptTiers(DeviceTier(memory, BIG), None, disk)
    assert [t.name for t in tiers.tiers] == ["device", "disk"]
    stats = disk.stats()
    assert stats.tier == "disk" and stats.states == 0 and stats.budget == 32 << 30
    described = tiers.describe()
    assert described["disk_states"] == 0 and described["disk_read_bytes_per_s"] == 10**12
    assert set(described["tiers"]) == {"device", "disk"}
    tiers.check_integrity()
    tiers.close()
    tiers.check_integrity()  # closed: the I/O thread is meant to be gone


# -- the I/O thread ---------------------------------------------------------------------------------------------


def test_the_writer_drops_past_its_staging_bound_but_takes_one_large_job_alone():
    gate, wrote = threading.Event(), []

    def write(job: bytes) -> None:
        gate.wait(10)
        wrote.append(job)

    writer: Writer[bytes] = Writer(write, len, stage_bytes=10)
    assert writer.put(b"x" * 30)  # larger than the bound, but nothing waits
    assert not writer.put(b"y") and writer.dropped == 1  # 31 bytes would wait
    gate.set()
    assert writer.settle(10) and writer.staged_bytes == 0
    assert writer.put(b"a" * 4) and writer.waiting <= 1
    flushed = writer.flush(10)
    assert flushed.dropped == 0 and wrote == [b"x" * 30, b"a" * 4] and writer.done == 2
    writer.close()
    assert not writer.alive and not writer.put(b"z")


def test_a_failing_write_is_counted_and_the_thread_goes_on():
    def write(job: int) -> None:
        if job == 1:
            raise OSError("disk gone")

    writer: Writer[int] = Writer(write, lambda job: 1, stage_bytes=100)
    for job in range(3):
        writer.put(job)
    assert writer.settle(10) and writer.failed == 1 and writer.done == 3 and writer.alive
    writer.close()


def test_a_flush_past_its_deadline_drops_the_queue():
    gate, in_hand = threading.Event(), threading.Event()

    def write(job: int) -> None:
        in_hand.set()
        gate.wait(10)

    writer: Writer[int] = Writer(write, lambda job: 1, stage_bytes=100)
    for job in range(3):
        writer.put(job)
    assert in_hand.wait(10)  # the thread holds job 0 (not left to 50 ms of scheduling): exactly 2 are queued
    flushed = writer.flush(0.05)
    gate.set()
    assert flushed.written == 0 and flushed.dropped == 2 and writer.dropped == 2  # the job in hand finishes
    assert writer.settle(10) and writer.staged_bytes == 0
    writer.close()
