"""The device tier's bookkeeping: kept pages counted in the pool, snapshots restored byte-equal, LRU within the
budget, and lookup only where a fresh pass would cut."""

from __future__ import annotations

import pytest
from tier_cases import PAGE_ROWS, every_state, fill, paged, same_bytes, windowed

from tensorfold.pool.pages import PagePool, PoolCorrupt
from tensorfold.tiers import DeviceTier

# -- the pool's kept pages ---------------------------------------------------------------------------------------


def test_kept_pages_outlive_their_lease_and_are_counted_once():
    pool = PagePool(10, page_rows=4)
    a = pool.lease("a", rows=20)
    pool.grow(a, 13)
    pool.keep(a.pages[:3])
    pool.keep(a.pages[:2])  # a second state sharing the first two pages
    pool.check_integrity()
    assert pool.snapshot()["leased"] == 4 and pool.kept == 0 and pool.free == 6
    kept = a.pages[:3]
    pool.release(a)
    pool.check_integrity()
    assert pool.free == 7 and pool.kept == 3 and pool.available == 7
    b = pool.lease("b", rows=16, shared=kept[:2])  # a resumer shares two kept pages, reserves two more
    assert b.untaken == 2 and pool.available == 5
    pool.check_integrity()
    pool.unkeep(kept)
    pool.unkeep(kept[:2])
    pool.check_integrity()
    assert pool.free == 8 and pool.leased == 2  # b still holds what it shared
    pool.release(b)
    pool.check_integrity()
    assert pool.free == pool.available == 10 and pool.kept == 0


def test_keeping_a_free_page_and_unkeeping_twice_are_errors():
    pool = PagePool(4, page_rows=4)
    with pytest.raises(ValueError, match="these are free"):
        pool.keep([0])
    lease = pool.lease("a", rows=4)
    pool.grow(lease, 4)
    pool.keep(lease.pages)
    pool.unkeep(lease.pages)
    with pytest.raises(ValueError, match="not kept"):
        pool.unkeep(lease.pages)


def test_integrity_catches_holds_that_do_not_match():
    pool = PagePool(4, page_rows=4)
    lease = pool.lease("a", rows=8)
    pool.grow(lease, 8)
    pool.keep(lease.pages[:1])
    pool._holds[lease.pages[0]] += 1
    with pytest.raises(PoolCorrupt, match="holds of 1 pages do not match"):
        pool.check_integrity()


# -- snapshots and restores --------------------------------------------------------------------------------------


@pytest.mark.parametrize("at", [8, 13, 16, 20], ids=lambda a: f"at{a}")
@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_a_restored_state_is_byte_equal_and_shares_full_pages(make, at):
    memory = make()
    tier = DeviceTier(memory, budget=1 << 30)
    source = memory.take("source", 40)
    fill(memory, source, at, seed=at)
    kept_bytes = every_state(memory, source.slot, at)
    state = tier.snapshot(source, tuple(range(at)), (at,))
    assert tier.keep(state)
    fill(memory, source, 40, seed=99, start=at)  # the source runs on: rows >= at and its fixed states change
    shared = state.pages
    assert len(shared) == (at // PAGE_ROWS if memory.pool else 0)
    claim = memory.take("resumer", 40, shared)
    tier.restore(state, claim)
    assert same_bytes(every_state(memory, claim.slot, at), kept_bytes)
    assert [t for _, _, t in state.fixed] and same_bytes([t for _, _, t in state.fixed], kept_bytes[-1:])
    if memory.pool is not None:
        assert claim.lease.pages[: len(shared)] == list(shared)
        assert set(claim.lease.pages[len(shared):]).isdisjoint(source.lease.pages)  # the tail page is its own
        memory.check_integrity()
        tier.check_integrity()
    memory.release(source)
    memory.release(claim)
    tier.check_integrity()
    if memory.pool is not None:
        assert memory.pool.free + memory.pool.kept == memory.pool.total and memory.pool.kept == len(shared)
    tier.clear()
    if memory.pool is not None:
        memory.check_integrity()
        assert memory.pool.free == memory.pool.total


def test_lookup_takes_the_longest_prefix_at_a_fresh_cut_and_leaves_a_row():
    memory = paged()
    tier = DeviceTier(memory, budget=1 << 30)
    prompt = tuple(range(100, 140))
    source = memory.take("s", 40)
    for prev, at in ((0, 10), (10, 24), (24, 40)):
        fill(memory, source, at, seed=at, start=prev)
        tier.keep(tier.snapshot(source, prompt[:at], (10, 24, 40)[: (10, 24, 40).index(at) + 1]))
    grid, min_chunk = 32, 4
    assert tier.lookup(prompt, (10, 24), grid, min_chunk).at == 24  # 40 leaves no row to prefill
    assert tier.lookup(prompt + (1, 2), (10, 24, 40), grid, min_chunk).at == 40
    assert tier.lookup(prompt + (1, 2), (10, 24), grid, min_chunk).at == 24  # 40 is no cut of this pass
    assert tier.lookup(prompt + (1, 2), (), grid, min_chunk) is None  # the grid alone cuts at 32
    assert tier.lookup((7,) + prompt[1:], (10, 24), grid, min_chunk) is None  # not a prefix
    assert tier.lookup(prompt, (10, 12, 24), grid, 1).at == 10  # a start at 12 makes 24's cuts differ
    memory.release(source)
    tier.check_integrity()


def test_the_budget_evicts_least_recently_used_and_frees_their_pages():
    memory = paged()
    tier = DeviceTier(memory, budget=1 << 30)
    source = memory.take("s", 40)
    fill(memory, source, 40, seed=1)
    one = tier.snapshot(source, tuple(range(16)), (16,))
    page_bytes = memory.kv.page_bytes
    tier.budget = 2 * (2 * page_bytes + one.copy_bytes)
    states = [tier.snapshot(source, tuple(range(at)), (at,)) for at in (16, 17, 18)]
    assert all(tier.keep(s) for s in states)  # three states share two pages: within the budget
    assert len(tier) == 3
    memory.release(source)
    tier.lookup(tuple(range(20)), (16,), 32, 1)  # 16 is used now; 17 is least recently used
    other = memory.take("o", 40)
    fill(memory, other, 40, seed=2)
    assert tier.keep(tier.snapshot(other, tuple(range(500, 532)), (32,)))  # 4 new pages: past the budget
    assert [s.at for s in tier.states] == [32]
    tier.check_integrity()
    memory.release(other)
    tier.clear()
    memory.check_integrity()
    assert memory.pool.free == memory.pool.total
    assert DeviceTier(memory, budget=1).keep(one) is False


def test_admission_evicts_kept_states_only_when_that_lets_the_lease_fit():
    from tensorfold.engine.api import Request, Sampling
    from tensorfold.engine.scheduler import Scheduler

    memory = paged(slots=3, pages=12)
    tier = DeviceTier(memory, budget=1 << 30)
    source = memory.take("s", 40)
    fill(memory, source, 40, seed=4)
    assert tier.keep(tier.snapshot(source, tuple(range(16)), (16,)))
    memory.release(source)
    hog = memory.take("hog", 72)  # 9 pages reserved: 1 left available, 2 held by the kept state
    scheduler = Scheduler(memory, context=96, prefill_chunk=32, min_chunk=4, tier=tier)
    scheduler.waiting.append(Request("big", tuple(range(500, 540)), Sampling(max_tokens=24), lambda e: None))
    assert scheduler.admit() == [] and len(tier) == 1  # it waits for the hog; the kept state stays
    scheduler.waiting[0] = Request("small", tuple(range(500, 510)), Sampling(max_tokens=14), lambda e: None)
    (stream,) = scheduler.admit()  # 3 pages: fits once the kept state gives its 2 pages back
    assert len(tier) == 0 and tier.evicted == 1 and stream.cached == 0
    memory.check_integrity()
    tier.check_integrity()
    scheduler.finish(stream)
    memory.release(hog)
    assert memory.pool.free == memory.pool.total


@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_a_fixed_copy_of_another_dtype_is_named_not_cast(make):
    """A kept fixed state goes back through KvStore.write_fixed: a copy of the wrong dtype names the layer, the
    state and both dtypes at restore and in the tier's integrity check, instead of being cast silently."""
    memory = make()
    tier = DeviceTier(memory, budget=1 << 30)
    source = memory.take("source", 40)
    fill(memory, source, 16, seed=1)
    state = tier.snapshot(source, tuple(range(16)), (16,))
    assert tier.keep(state)
    (i, name, copy), = state.fixed
    state.fixed = ((i, name, copy.double()),)
    with pytest.raises(PoolCorrupt, match=r"^a state kept at 16 copies fixed 0 's' as \(2, 2\) torch.float64, the "
                                          r"Layout declares \(2, 2\) torch.float32$"):
        tier.check_integrity()
    claim = memory.take("resumer", 40, state.pages)
    with pytest.raises(TypeError, match=r"^layer 0 s: the Layout declares torch.float32, the family wrote "
                                        r"torch.float64$"):
        tier.restore(state, claim)
    memory.release(claim)
    memory.release(source)
