"""The host arena: tensors carved from a few slabs and carved again once every tensor and view of them is gone, on
any thread; a run given back while its fence has not passed waits for it; growth within the limit, then tensors of
their own, counted; `reserve` and `ahead` grow before they are needed."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from tensorfold.tiers.arena import ALIGN, HostArena

KIB = 1024


class Fence:
    """An event stand-in: passed once `done` is set; counts the host waits made on it."""

    def __init__(self) -> None:
        self.done = False
        self.waits = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_tensors_are_carved_from_one_slab_and_carved_again_once_gone():
    arena = HostArena(pin=False, limit=1 << 20, slab_bytes=64 * KIB)
    a = arena.empty((100, 3), torch.float32)
    b = arena.empty((7,), torch.bfloat16)
    assert arena.describe()["slabs"] == 1 and arena.grown == 1
    assert a.shape == (100, 3) and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert address(b) - address(a) == -(-a.numel() * 4 // ALIGN) * ALIGN    # first fit, aligned runs
    a.fill_(1.0)
    b.fill_(2.0)
    assert bool((a == 1).all()) and bool((b == 2).all())                # runs do not overlap
    first = address(a)
    del a
    c = arena.empty((50, 3), torch.float32)                            # fits where `a` was
    assert address(c) == first and arena.grown == 1
    assert arena.describe()["taken"] == 2 * ALIGN + -(-7 * 2 // ALIGN) * ALIGN


def test_a_view_keeps_its_run_taken_and_every_run_comes_back():
    arena = HostArena(pin=False, limit=1 << 20, slab_bytes=64 * KIB)
    a = arena.empty((1024,), torch.float32)
    view = a[10:20].view(torch.int32)
    first = address(a)
    del a
    assert address(arena.empty((1024,), torch.float32)) != first       # the view still holds it
    del view
    gc.collect()
    again = arena.empty((1024,), torch.float32)
    assert address(again) == first
    del again
    gc.collect()
    assert arena.describe()["taken"] == 0 and arena.free == arena.capacity


def test_a_run_given_back_on_another_thread_comes_back():
    arena = HostArena(pin=False, limit=1 << 20, slab_bytes=64 * KIB)
    held = [arena.empty((4096,), torch.uint8)]
    first = address(held[0])
    thread = threading.Thread(target=held.clear)
    thread.start()
    thread.join()
    assert address(arena.empty((4096,), torch.uint8)) == first


def test_a_fenced_run_is_carved_again_only_once_its_fence_has_passed():
    arena = HostArena(pin=False, limit=64 * KIB, slab_bytes=64 * KIB)
    a = arena.empty((32 * KIB,), torch.uint8)
    fence = Fence()
    arena.fence([a], fence)
    first = address(a)
    del a
    b = arena.empty((32 * KIB,), torch.uint8)                         # the other half: no waiting
    assert address(b) != first and fence.waits == 0
    fence.done = True
    c = arena.empty((32 * KIB,), torch.uint8)
    assert address(c) == first and fence.waits == 0


def test_a_full_arena_waits_for_a_cooling_run_before_it_allocates_outside():
    arena = HostArena(pin=False, limit=64 * KIB, slab_bytes=64 * KIB)
    a = arena.empty((64 * KIB,), torch.uint8)
    fence = Fence()
    arena.fence([a], fence)
    first = address(a)
    del a
    b = arena.empty((64 * KIB,), torch.uint8)                         # only that run fits: wait for its copies
    assert address(b) == first and fence.waits == 1 and arena.outside == 0
    c = arena.empty((ALIGN,), torch.uint8)                            # nothing left and no growth: its own memory
    assert arena.outside == 1 and c.numel() == ALIGN


def test_growth_stays_within_the_limit_and_zero_sized_tensors_take_nothing():
    arena = HostArena(pin=False, limit=96 * KIB, slab_bytes=64 * KIB)
    first = arena.empty((48 * KIB,), torch.uint8)
    kept = arena.empty((32 * KIB,), torch.uint8)                      # a second slab, of what the limit leaves
    assert arena.capacity == arena.limit and arena.outside == 0 and kept.numel() == 32 * KIB
    beyond = arena.empty((32 * KIB,), torch.uint8)                    # past the limit: memory of its own
    assert arena.outside == 1 and arena.capacity == arena.limit and beyond.numel() == 32 * KIB
    del first, kept, beyond
    assert arena.empty((0, 3), torch.float32).shape == (0, 3) and arena.describe()["slabs"] == 2


def test_reserve_and_ahead_grow_before_anything_is_carved():
    arena = HostArena(pin=False, limit=1 << 20, slab_bytes=64 * KIB)
    arena.reserve(256 * KIB)
    assert arena.capacity >= 256 * KIB and arena.grown == 0
    arena.empty((50 * KIB,), torch.uint8)                             # within one of its slabs
    arena.ahead(512 * KIB)
    for thread in threading.enumerate():
        if thread.name == "tensorfold-host-arena":
            thread.join()
    assert arena.free >= 512 * KIB and arena.grown == 0 and arena.capacity <= arena.limit


def test_a_bad_arena_is_refused():
    with pytest.raises(ValueError, match="limit"):
        HostArena(pin=False, limit=-1)
