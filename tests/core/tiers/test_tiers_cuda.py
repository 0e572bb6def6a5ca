"""On a CUDA device, the host tier's copies run on their own stream and the host never waits for them: a step that
touches a layer right after a keep or a restore (through the store's accessors, as a family's forward does) must
still see, and leave, the right bytes. The states here are hundreds of MiB, so the copies are still running when
the next access is queued. Skipped without CUDA; run in device sessions (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from tensorfold.kv import PagedStore
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState
from tensorfold.memory import StreamMemory
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.tiers import HostTier
from tensorfold.tiers.policy import HISTORY

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYERS, PAGE_ROWS, AT = 6, 256, 24_000 + 77       # a partial last page
LAYOUT = Layout([LayerLayout("mixed", rows=[RowState("k", (8, 256), "bfloat16")],
                             fixed=[FixedState("s", (32, 128, 128), "float32")]) for _ in range(LAYERS)])


def memory() -> StreamMemory:
    pages = 2 * -(-AT // PAGE_ROWS) + 8
    return StreamMemory(PagedStore(LAYOUT, 3, pages, PAGE_ROWS, "cuda", poison=True), SlotPool(3),
                        PagePool(pages, PAGE_ROWS))


def written(mem: StreamMemory, seed: int):
    """A claim whose rows [0, AT) and fixed states hold random values, and a copy of them."""
    claim = mem.take("source", AT)
    mem.extend(claim, AT)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv = mem.kv
    for i in range(LAYERS):
        kv.write_rows(i, "k", claim.slot, 0, torch.randn(AT, 8, 256, generator=gen, device="cuda",
                                                        dtype=torch.bfloat16))
        kv.fixed(i, "s", claim.slot).copy_(torch.randn(32, 128, 128, generator=gen, device="cuda"))
    return claim, snapshot(mem, claim.slot)


def snapshot(mem: StreamMemory, slot: int) -> list[torch.Tensor]:
    kv = mem.kv
    out = [kv.rows(i, "k", slot, AT).cpu() for i in range(LAYERS)]
    return out + [kv.fixed(i, "s", slot).cpu() for i in range(LAYERS)]


def overwrite(mem: StreamMemory, slot: int) -> None:
    """What the next step does to a slot right away: every layer's pages and fixed states written."""
    kv = mem.kv
    for i in range(LAYERS):
        kv.row_pages(i, "k").fill_(7.0)
        kv.fixed(i, "s", slot).mul_(-3.0)


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def test_a_keep_is_not_overwritten_by_the_step_after_it():
    mem = memory()
    host = HostTier(mem, 2 << 30)
    claim, before = written(mem, seed=1)
    state = host.keep_from(claim, tuple(range(AT)), (AT,), frozenset({HISTORY}))
    overwrite(mem, claim.slot)           # queued at once: the host did not wait for the keep's copies
    torch.cuda.synchronize()
    kept = [host_rows for _, _, host_rows in state.rows] + [fixed for _, _, fixed in state.fixed]
    assert equal(kept, before)
    assert not equal(snapshot(mem, claim.slot), before)   # the overwrite did land after the copies


def test_a_restore_is_read_whole_by_the_step_after_it():
    mem = memory()
    host = HostTier(mem, 2 << 30)
    source, before = written(mem, seed=2)
    state = host.keep_from(source, tuple(range(AT)), (AT,), frozenset({HISTORY}))
    mem.release(source)
    overwrite(mem, 0)                    # the freed pages hold other bytes before the restore
    claim = mem.take("resumer", AT)
    host.restore(state, claim)
    kv = mem.kv
    sums = [kv.rows(i, "k", claim.slot, AT).float().sum() for i in range(LAYERS)]  # queued at once, on the
    torch.cuda.synchronize()                                                        # compute stream
    assert equal(snapshot(mem, claim.slot), before)
    again = [kv.rows(i, "k", claim.slot, AT).float().sum() for i in range(LAYERS)]   # the same kernel, restored
    assert all(torch.equal(a, b) for a, b in zip(sums, again, strict=True))
    mem.release(claim)
    mem.check_integrity()
    host.check_integrity()
