"""Keeping a state on the host and staging one for the disk copy it out of the device on the tier's Lane: one copying
block per state, each layer's end marked, the store's reader waiting for a layer's mark before it next touches that
layer (never the host), a restore queued behind them waiting on the copy stream and leaving the waits for the step;
the memory comes from the tier's arena, carved again as states go (no growth once it holds the working set), and a
state's memory given back while its copies may still run is carved again only once they have; the disk's I/O thread
waits for a staged state's copies to land before it reads them."""

from __future__ import annotations

import pytest
from test_disk_tier import disk_tier, settle
from test_host_restore import RecordingLane
from tier_cases import LAYOUT, PAGE_ROWS, every_state, fill, paged, same_bytes, windowed

from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.tiers import HostTier, KeptTiers
from tensorfold.tiers.policy import HISTORY

BIG = 1 << 30


class Mark:
    """An event stand-in: a device wait is logged; `query` says whether the copies before it are done; a host wait
    (`synchronize`) is counted and marks them done."""

    def __init__(self, layer: int, log: list) -> None:
        self.layer = layer
        self.log = log
        self.done = False
        self.host_waits = 0

    def wait(self) -> None:
        self.log.append(self.layer)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.host_waits += 1
        self.done = True


class MarkingLane(RecordingLane):
    """The recording lane whose marks also answer `query` and `synchronize`, as a CUDA event does."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[Mark] = []

    def mark(self):
        assert self.inside, "a layer's end is marked on the copy stream"
        self.marks += 1
        self.made.append(Mark((self.marks - 1) % len(LAYOUT.layers), self.waits))
        return self.made[-1]


def kept_state(memory, at: int, seed: int):
    source = memory.take(f"source{seed}", 40)
    fill(memory, source, at, seed=seed)
    return source, every_state(memory, source.slot, at)


def host_bytes(state) -> list:
    return [t for _, _, t in state.rows] + [t for _, _, t in state.fixed]


def addresses(state) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in host_bytes(state) if t.numel()}


@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_a_keep_copies_out_in_one_block_and_the_next_access_waits_per_layer_never_the_host(make):
    memory = make()
    host = HostTier(memory, BIG, piece_bytes=1)      # many pieces: still one copying block, one mark per layer
    lane = host.lane = MarkingLane()
    source, kept = kept_state(memory, 21, seed=1)
    state = host.keep_from(source, tuple(range(21)), (21,), frozenset({HISTORY}))
    kv = memory.kv
    assert lane.entered == 1 and lane.marks == len(LAYOUT.layers) and lane.waits == []
    assert kv.arriving_layers == (0, 1) and state.landed is lane.made[-1]
    assert same_bytes(host_bytes(state)[:3], kept[:3]) and same_bytes(host_bytes(state)[3:], kept[3:])
    kv.fixed(0, "s", source.slot)                    # the next step's first access to layer 0 waits for its copies
    assert lane.waits == [0] and kv.arriving_layers == (1,)
    memory.release(source)
    kv.arrived()
    assert lane.waits == [0, 1] and all(mark.host_waits == 0 for mark in lane.made)


def test_a_restore_behind_a_keep_waits_on_the_copy_stream_and_leaves_the_waits_for_the_step():
    memory = StreamMemory(PagedStore(LAYOUT, 3, 24, PAGE_ROWS), SlotPool(3), PagePool(24, PAGE_ROWS))  # no poison:
    # nothing but the restore touches the resumer's pages before its step
    host = HostTier(memory, BIG)
    lane = host.lane = MarkingLane()
    source, kept = kept_state(memory, 13, seed=2)
    state = host.keep_from(source, tuple(range(13)), (13,), frozenset({HISTORY}))
    claim = memory.take("resumer", 40)               # another slot (clearing the source's own would wait) ...
    memory.release(source)                           # ... and the source's pages, while copies out still run
    host.restore(state, claim)
    kv = memory.kv
    assert set(lane.waits) == {0, 1}                 # the copy stream waited for the keep's copies ...
    assert len(lane.made) == 4
    assert kv.arriving_layers == (0, 1) and all(len(kv._arrivals[i]) == 2 for i in (0, 1))   # ... left for the step
    waited = len(lane.waits)
    kv.arrived()
    assert sorted(lane.waits[waited:]) == [0, 0, 1, 1]
    assert same_bytes(every_state(memory, claim.slot, 13), kept)
    memory.release(claim)


def test_states_kept_and_let_go_are_carved_from_the_same_memory():
    memory = paged()
    host = HostTier(memory, BIG)
    host.budget = 2 * host.state_bytes(24)           # two states at a time: each keep lets the oldest go
    tiers = KeptTiers(None, host)
    for turn in range(8):
        source, _ = kept_state(memory, 24, seed=10 + turn)
        tiers.keep_from(source, tuple(range(100 * turn, 100 * turn + 24)), (24,), frozenset({HISTORY}))
        memory.release(source)
        if turn == 1:
            capacity = host.arena.capacity
    numbers = host.describe()
    assert len(host.states) == 2 and host.evicted == 6
    assert host.arena.capacity == capacity and numbers["host_arena_grown"] == 1 and numbers["host_arena_outside"] == 0
    assert numbers["host_arena_taken"] >= 2 * host.state_bytes(24)


def test_a_state_let_go_while_its_restore_may_still_run_is_carved_again_only_once_it_has():
    memory = paged()
    host = HostTier(memory, BIG)
    source, _ = kept_state(memory, 16, seed=3)
    state = host.keep_from(source, tuple(range(16)), (16,), frozenset({HISTORY}))
    memory.release(source)
    lane = host.lane = MarkingLane()
    claim = memory.take("resumer", 40)
    host.restore(state, claim)                       # its copies in are marked, not done
    restoring = list(lane.made)
    memory.release(claim)
    memory.kv.arrived()
    held = addresses(state)
    assert host.forget(state)
    del state
    source, _ = kept_state(memory, 16, seed=4)
    second = host.keep_from(source, tuple(range(50, 66)), (16,), frozenset({HISTORY}))
    assert not addresses(second) & held              # the restore's copies may still read that memory
    for mark in restoring:                           # they have
        mark.done = True
    third = host.keep_from(source, tuple(range(70, 86)), (16,), frozenset({HISTORY}))
    assert addresses(third) & held
    memory.release(source)


def test_the_io_thread_waits_for_a_staged_state_to_land_before_it_writes_it(tmp_path):
    memory = paged()
    tiers = KeptTiers(None, None, disk_tier(memory, tmp_path))
    lane = tiers.disk.lane = MarkingLane()
    source, _ = kept_state(memory, 16, seed=5)
    tiers.keep_from(source, tuple(range(16)), (8, 16), frozenset({HISTORY}))
    assert lane.entered == 1 and memory.kv.arriving_layers == (0, 1)
    memory.release(source)
    settle(tiers.disk)
    assert lane.made[-1].host_waits == 1 and tiers.disk.store.stats().written == 1
    tiers.close()
