"""Page accounting: reservations, growth, release, and integrity that raises with the numbers."""

from __future__ import annotations

import pytest

from tensorfold.pool.pages import PagePool, PoolCorrupt, PoolExhausted
from tensorfold.pool.slots import SlotPool


def test_a_lease_reserves_then_takes_pages_as_rows_grow():
    pool = PagePool(10, page_rows=16)
    lease = pool.lease("a", rows=40)
    assert lease.reserved == 3 and pool.free == 10 and pool.available == 7
    assert len(pool.grow(lease, 17)) == 2 and pool.free == 8 and pool.available == 7
    assert pool.grow(lease, 20) == [] and len(pool.grow(lease, 40)) == 1
    pool.check_integrity()
    pool.release(lease)
    assert pool.free == pool.available == 10
    pool.check_integrity()


def test_reserved_pages_are_not_handed_to_another_lease():
    pool = PagePool(4, page_rows=8)
    pool.lease("a", rows=24)
    with pytest.raises(PoolExhausted, match="b needs 2 pages, 1 of 4 are available"):
        pool.lease("b", rows=9)
    pool.lease("c", rows=8)
    assert pool.available == 0


def test_growing_past_the_reservation_is_an_error():
    pool = PagePool(4, page_rows=8)
    lease = pool.lease("a", rows=8)
    with pytest.raises(ValueError, match="past its 1 reserved"):
        pool.grow(lease, 9)


def test_release_twice_and_double_lease_are_errors():
    pool = PagePool(4, page_rows=8)
    lease = pool.lease("a", rows=8)
    with pytest.raises(ValueError, match="already holds"):
        pool.lease("a", rows=8)
    pool.release(lease)
    with pytest.raises(ValueError, match="holds no lease"):
        pool.release(lease)


def test_integrity_catches_a_page_owned_twice():
    pool = PagePool(4, page_rows=8)
    lease = pool.lease("a", rows=16)
    pool.grow(lease, 16)
    lease.pages.append(pool._free[-1])
    with pytest.raises(PoolCorrupt, match=r"free 2 \+ leased 3 \+ kept 0 = 5, 1 owned twice"):
        pool.check_integrity()


def test_many_leases_leave_nothing_behind():
    pool = PagePool(64, page_rows=4)
    leases = [pool.lease(f"s{i}", rows=4 * (i % 5 + 1)) for i in range(12)]
    for i, lease in enumerate(leases):
        pool.grow(lease, 1 + 3 * (i % 5))
    for lease in leases[::2] + leases[1::2]:
        pool.release(lease)
    pool.check_integrity()
    assert pool.free == pool.available == 64 and pool.snapshot()["leases"] == 0


def test_slots_are_taken_and_given_back_once():
    slots = SlotPool(2)
    a, b = slots.take(), slots.take()
    assert {a, b} == {0, 1} and slots.free == 0
    with pytest.raises(RuntimeError):
        slots.take()
    slots.give(a)
    with pytest.raises(ValueError, match="not in use"):
        slots.give(a)
