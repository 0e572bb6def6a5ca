"""Stream memory over a Layout with no row states (a pure SSM): a stream costs a slot alone, never a page."""

from __future__ import annotations

import pytest
import torch

from tensorfold.kv import PagedStore, WindowStore
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState
from tensorfold.memory import StreamMemory, has_rows
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.tiers import DeviceTier, HostTier

SSM = Layout([LayerLayout("ssm", fixed=[FixedState("conv", (6, 3), "bfloat16"), FixedState("ssm", (2, 4), "float32")])
              for _ in range(2)])
ATTENTION = Layout([LayerLayout("attention", rows=[RowState("k", (2,), "float32")])])


def rowless(pages: int = 8) -> StreamMemory:
    """What boot and the gates build: a PagedStore and a PagePool, here over a Layout without row states."""
    return StreamMemory(PagedStore(SSM, 2, pages, 4), SlotPool(2), PagePool(pages, 4))


def test_a_layout_without_row_states_leases_no_pages():
    assert not has_rows(SSM) and has_rows(ATTENTION)
    memory = rowless()
    assert memory.pool is None and memory.available == 0 and memory.pages_needed(1000, forks=(500,)) == 0
    assert memory.fits(10**6) and memory.never_fits(10**6, (10**6,)) is None
    claim = memory.take("a", 10**6)
    assert claim.lease is None
    memory.extend(claim, 10**6)
    assert memory.kv.host_table(claim.slot) == ()
    assert memory.fits(10**6) and not memory.fits(10**6, forks=(1,))        # one slot left: slots alone decide
    memory.take("b", 10**6)
    assert not memory.fits(1)
    assert memory.snapshot() == {"slots": 2, "slots_free": 0, "kv_bytes": memory.kv.nbytes}


def test_a_pool_of_no_pages_is_what_a_rowless_plan_builds():
    pool = PagePool(0, page_rows=256)
    assert pool.free == pool.available == 0 and pool.fits(0) and not pool.fits(1)
    pool.check_integrity()
    memory = StreamMemory(PagedStore(SSM, 3, 0, 256), SlotPool(3), pool)
    assert memory.pool is None and memory.kv.nbytes == 3 * SSM.fixed_bytes
    with pytest.raises(ValueError, match="no fewer than 0 pages, got -1 pages"):
        PagePool(-1, page_rows=4)


@pytest.mark.parametrize("store", ["paged", "window"])
def test_kept_states_hold_no_pages_and_copy_every_fixed_state(store):
    memory = rowless() if store == "paged" else StreamMemory(WindowStore(SSM, 2, 64), SlotPool(2), None)
    device = DeviceTier(memory, budget=1 << 20)
    host = HostTier(memory, budget=1 << 20)
    source = memory.take("source", 64)
    memory.extend(source, 40)
    for i in range(2):
        memory.kv.write_fixed(i, "conv", source.slot, torch.full((6, 3), 1.5 + i, dtype=torch.bfloat16))
        memory.kv.write_fixed(i, "ssm", source.slot, torch.full((2, 4), 1.0 + 2**-20 + i))
    state = device.snapshot(source, tuple(range(40)), (32, 40))
    assert state.pages == () and state.tail == () and device.keep(state)
    assert device.nbytes == SSM.fixed_bytes == state.copy_bytes
    assert host.keep_from(source, tuple(range(40)), (32, 40))
    assert host.nbytes == SSM.stream_bytes(40) == SSM.fixed_bytes
    memory.release(source)
    for tier in (device, host):
        claim = memory.take("resumer", 64)
        assert claim.lease is None
        found = tier.find(tuple(range(41)), (32, 40))
        tier.restore(found, claim)
        for i in range(2):
            assert torch.equal(memory.kv.fixed(i, "ssm", claim.slot), torch.full((2, 4), 1.0 + 2**-20 + i))
            assert memory.kv.fixed(i, "conv", claim.slot).dtype == torch.bfloat16
        tier.check_integrity()
        memory.release(claim)
    assert device.evicted == 0 and memory.slots.free == 2


def test_boot_builds_a_rowless_plan_into_memory_without_pages():
    """The plan `serve` makes for such a Layout (0 pages), built as `serve` builds it: slots alone."""
    from tensorfold.boot import build_memory
    from tensorfold.memory_plan import plan_memory
    from tensorfold.settings import Settings

    plan, refusals = plan_memory(SSM, context=4096, page_rows=256, budget_bytes=10 * SSM.fixed_bytes, parallel=None)
    assert refusals == [] and plan.parallel == 10 and plan.pages == 0
    memory = build_memory(plan, SSM, Settings(family="toy", context=4096), torch.device("cpu"))
    assert isinstance(memory.kv, PagedStore) and memory.pool is None and memory.slots.count == 10
    assert memory.kv.nbytes == plan.kv_bytes == 10 * SSM.fixed_bytes
