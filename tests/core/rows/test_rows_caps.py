"""The rows store's caps with real files: --learn-gib holds across identities (least recently used states first,
each with the blocks only it listed), a state larger than the cap, a spent day's budget and a free-space floor
above the free space each skip the write, counted; the payoff rule and the read bandwidth measurement."""

from __future__ import annotations

import math
import shutil

import pytest
from rows_cases import DAY, FACTS, Clock, files, image, open_store, tokens, write

from tensorfold.rows import probe
from tensorfold.rows.payoff import observed_rate, overlapped_rate, should_read

BIG = 1 << 40


def disk_bytes(root) -> int:
    return sum(p.stat().st_size for p in files(root, ".st") + files(root, ".blk"))


def size_of(scratch, prompt, at) -> int:
    """Bytes a lone state takes on disk."""
    with open_store(scratch, cap_bytes=BIG) as store:
        return write(store, prompt, at).nbytes


def test_the_cap_holds_least_recently_used_first(tmp_path):
    size = size_of(tmp_path / "scratch", tokens(1, 40), 20)
    with open_store(tmp_path / "store", cap_bytes=size * 5 // 2) as store:
        first, second = write(store, tokens(1, 40), 20), write(store, tokens(2, 40), 20)
        store.read(first)
        third = write(store, tokens(3, 40), 20)
        assert [e.key for e in store.entries()] == [first.key, third.key] and second.key != first.key
        assert store.stats().evicted == 1 and store.stats().bytes == disk_bytes(tmp_path / "store") <= size * 5 // 2
        assert store.lookup(tokens(2, 30), (8, 16, 20, 30)) is None
        assert store.read(first) == image(tokens(1, 40), 20)


def test_the_cap_goes_by_last_use_not_by_write_order(tmp_path):
    """States written at shutdown come most recently used first, each stamped older than the one before: the cap
    keeps those used last, a state older than every kept one goes as soon as it is written (with its blocks), a
    read-back check is no use, and a state written now is newer than all of them."""
    size = size_of(tmp_path / "scratch", tokens(1, 40), 20)
    clock = Clock()
    root = tmp_path / "store"
    with open_store(root, cap_bytes=size * 5 // 2, clock=clock) as store:
        then = clock.start - 100
        first = write(store, tokens(1, 40), 20, used=then)
        second = write(store, tokens(2, 40), 20, used=then - 1)
        assert write(store, tokens(3, 40), 20, used=then - 2) is None
        assert [e.key for e in store.entries()] == [first.key, second.key]
        assert store.stats().evicted == 1 and store.stats().written == 3
        assert store.stats().bytes == disk_bytes(root) <= size * 5 // 2 and len(files(root, ".blk")) == 4
        assert store.read(second, use=False) == image(tokens(2, 40), 20)    # a check, not a use
        assert store.stats().reads == 0 and store.entries()[-1].hits == 0
        newest = write(store, tokens(4, 40), 20)
        assert {e.key for e in store.entries()} == {first.key, newest.key} and newest.used > first.used
    with open_store(root, cap_bytes=size * 5 // 2) as store:
        assert {e.key for e in store.entries()} == {first.key, newest.key}


def test_an_evicted_state_takes_only_the_blocks_no_other_state_lists(tmp_path):
    a, c = tokens(1, 40), tokens(1, 16) + tokens(5, 24)

    def run(root, cap):
        with open_store(root, cap_bytes=cap) as store:
            first, shared = write(store, a, 20), write(store, c, 28)
            write(store, tokens(3, 40), 20)
            return store, first, shared

    store, first, _ = run(tmp_path / "scratch", BIG)
    unshared = (store.directory / "states" / f"{first.key}.st").stat().st_size
    store, first, shared = run(tmp_path / "store", disk_bytes(tmp_path / "scratch") - unshared)
    root = tmp_path / "store"
    assert [e.key for e in store.entries()] != [] and first.key not in {e.key for e in store.entries()}
    assert len(files(root, ".st")) == 2 and len(files(root, ".blk")) == 5   # first's blocks are shared's too
    with open_store(root, cap_bytes=BIG) as reopened:
        assert reopened.read(reopened.lookup(c[:30], (8, 16, 24, 28, 30))) == image(c, 28)


def test_other_identities_count_toward_the_cap_and_go_by_last_use(tmp_path):
    size = size_of(tmp_path / "scratch", tokens(1, 40), 20)
    root = tmp_path / "store"
    with open_store(root, {**FACTS, "dtype": "old"}, cap_bytes=BIG) as old:
        stale, kept = write(old, tokens(1, 40), 20), write(old, tokens(2, 40), 20)
    with open_store(root, cap_bytes=size * 5 // 2, clock=Clock(start=Clock().start + DAY)) as new:
        write(new, tokens(3, 40), 20)
        assert new.stats().evicted == 1 and disk_bytes(root) <= size * 5 // 2
    with open_store(root, {**FACTS, "dtype": "old"}, cap_bytes=BIG) as old:
        assert [e.key for e in old.entries()] == [kept.key] and stale.key != kept.key


def test_a_state_larger_than_the_cap_is_skipped(tmp_path):
    size = size_of(tmp_path / "scratch", tokens(1, 40), 20)
    with open_store(tmp_path / "store", cap_bytes=size - 1) as store:
        assert write(store, tokens(1, 40), 20) is None
        assert write(store, tokens(1, 40), 12) is not None
        assert store.stats().skipped_cap == 1 and store.stats().evicted == 0


def test_a_spent_daily_budget_skips_writes_until_the_next_day(tmp_path):
    size = size_of(tmp_path / "scratch", tokens(1, 40), 20)
    clock = Clock()
    root = tmp_path / "store"
    with open_store(root, daily_bytes=size * 3 // 2, clock=clock) as store:
        assert write(store, tokens(1, 40), 20) is not None
        assert write(store, tokens(2, 40), 20) is None
        assert store.stats().skipped_daily == 1 and len(store.entries()) == 1
    with open_store(root, {**FACTS, "dtype": "other"}, daily_bytes=size * 3 // 2, clock=clock) as other:
        assert write(other, tokens(2, 40), 20) is None      # every identity spends the same day's budget
    clock.start += DAY
    with open_store(root, daily_bytes=size * 3 // 2, clock=clock) as store:
        assert write(store, tokens(2, 40), 20) is not None
        assert store.stats().skipped_daily == 0


def test_a_floor_above_the_free_space_skips_writes(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with open_store(tmp_path, min_free_bytes=free + BIG) as store:
        assert write(store, tokens(1, 40), 20) is None
        assert store.stats().skipped_floor == 1 and files(tmp_path, ".blk") == []


def test_read_bandwidth_is_measured_on_the_store_and_leaves_nothing(tmp_path):
    with open_store(tmp_path) as store:
        rate = store.read_bandwidth(1 << 20)
        assert rate > 0 and math.isfinite(rate)
        assert files(tmp_path, ".part") == []


def test_the_read_estimate_is_the_slower_of_the_read_and_its_hash(tmp_path, monkeypatch):
    """A state's reader runs ahead of its hashing thread: the estimate is whichever of the two is slower."""
    for read, hashed in ((8e8, 3e8), (2e8, 9e8)):
        monkeypatch.setattr(probe, "sequential_read_rate", lambda directory, nbytes, rate=read: rate)
        monkeypatch.setattr(probe, "hash_rate", lambda nbytes, rate=hashed: rate)
        assert probe.read_rate(tmp_path, 1 << 20, 0, writes=True) == (min(read, hashed), None)


def test_rates_of_steps_side_by_side_and_a_rate_learned_from_resumes():
    assert overlapped_rate(2e9, 2e9) == 2e9
    assert overlapped_rate(1e9, 1e12) == 1e9 and overlapped_rate(3e9, 1.5e9) == 1.5e9
    assert observed_rate(0.0, 10**9, 2.0) == pytest.approx(5e8)                 # no estimate: the measurement
    assert observed_rate(1.5e9, 10**9, 2.0) == pytest.approx(1e9)               # half the estimate, half seen
    assert observed_rate(1.5e9, 10**9, 2.0, weight=1.0) == pytest.approx(5e8)


@pytest.mark.parametrize("state_bytes, rows, read_rate, prefill_rate, margin, pays", [
    (1 << 30, 10_000, 2e9, 5_000, 1.0, True),        # 0.54 s to read, 2 s to prefill
    (1 << 30, 10_000, 2e9, 5_000, 4.0, False),       # the margin asks for 4x: 2.1 s > 2 s
    (1 << 30, 10_000, 2e8, 5_000, 1.0, False),       # a slow disk: 5.4 s to read
    (1 << 30, 10_000, 2e9, 50_000, 1.0, False),      # a fast model: 0.2 s to prefill
    (1000, 1, 1000.0, 1.0, 1.0, False),              # equal times: prefilling is not worse
    (1 << 30, 0, 2e9, 5_000, 1.0, False),            # no rows to save
    (1 << 30, 10_000, 0.0, 5_000, 1.0, False),       # no measured read rate
    (1 << 30, 10_000, 2e9, 0.0, 1.0, True),          # no measured prefill rate: prefilling counts as slow
    (1 << 30, 10_000, 2e9, math.nan, 1.0, False),
])
def test_the_payoff_rule(state_bytes, rows, read_rate, prefill_rate, margin, pays):
    assert should_read(state_bytes, rows, read_rate, prefill_rate, margin) is pays


def test_a_lowered_cap_is_met_at_startup(tmp_path):
    size = size_of(tmp_path / "scratch", tokens(1, 40), 20)
    root = tmp_path / "store"
    with open_store(root, cap_bytes=BIG) as store:
        last = [write(store, tokens(seed, 40), 20) for seed in (1, 2, 3)][-1]
    with open_store(root, cap_bytes=size * 3 // 2) as store:
        assert [e.key for e in store.entries()] == [last.key] and store.stats().evicted == 2
        assert disk_bytes(root) <= size * 3 // 2
