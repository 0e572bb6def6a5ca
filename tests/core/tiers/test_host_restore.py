"""The host restore: whole pages in large pieces through one index_copy_ each into a claim whose pages are scattered,
the partial last page in place, byte for byte; every copy queued inside one `copying()` block of the tier's Lane,
each layer's end marked, and the store making its reader wait for a layer's copies at its first access to that
layer only (never the host: `ready` waits for nothing); the restore's bytes and time folded into the tier's rate."""

from __future__ import annotations

import contextlib

import pytest
from tier_cases import LAYOUT, PAGE_ROWS, every_state, fill, paged, same_bytes, windowed

from tensorfold.pool.pages import PoolCorrupt
from tensorfold.tiers import HostTier, KeptTiers
from tensorfold.tiers.lanes import Lane
from tensorfold.tiers.policy import HISTORY

BIG = 1 << 30


def scattered(memory, take: int = 6):
    """A claim whose pages are not in order: others take pages first and give back every other one."""
    others = [memory.take(f"o{i}", PAGE_ROWS) for i in range(take)]
    for claim in others:
        memory.extend(claim, PAGE_ROWS)
    for claim in others[::2]:
        memory.release(claim)
    return others[1::2]


def host_state(memory, host: HostTier, at: int, seed: int):
    """A slot's state at `at` kept straight on the host; the state and the slot's bytes."""
    source = memory.take("source", 40)
    fill(memory, source, at, seed=seed)
    kept = every_state(memory, source.slot, at)
    state = host.keep_from(source, tuple(range(at)), (at,), frozenset({HISTORY}))
    memory.release(source)
    return state, kept


@pytest.mark.parametrize("piece", [1 << 20, 1], ids=["one-piece", "page-pieces"])
@pytest.mark.parametrize("at", [7, 8, 13, 24, 31], ids=lambda a: f"at{a}")
def test_a_restore_into_scattered_pages_is_byte_equal(at, piece):
    memory = paged(slots=8, pages=32)
    host = HostTier(memory, BIG, piece_bytes=piece)
    state, kept = host_state(memory, host, at, seed=at)
    held = scattered(memory)
    claim = memory.take("resumer", 40)
    pages = claim.lease.pages
    host.restore(state, claim)
    assert len(pages) == -(-at // PAGE_ROWS) and sorted(pages) != pages or len(pages) == 1  # not one ascending run
    assert same_bytes(every_state(memory, claim.slot, at), kept)
    if at % PAGE_ROWS:                       # the last page's rows past `at` are still the pool's poison
        rows = memory.kv.row_pages(1, "v")[pages[-1], at % PAGE_ROWS:]
        assert bool(rows.isnan().all())
    assert host.restored_bytes == state.nbytes and host.rate.measured == 1
    assert host.describe()["host_restored_bytes"] == state.nbytes
    for claim_ in (*held, claim):
        memory.release(claim_)
    memory.check_integrity()


def test_a_restore_into_a_window_is_byte_equal_in_pieces():
    memory = windowed()
    host = HostTier(memory, BIG, piece_bytes=40)
    state, kept = host_state(memory, host, 21, seed=3)
    claim = memory.take("resumer", 40)
    host.restore(state, claim)
    assert same_bytes(every_state(memory, claim.slot, 21), kept)
    memory.release(claim)


class Arrival:
    """An event stand-in: counts the waits made on it."""

    def __init__(self, layer: int, log: list) -> None:
        self.layer = layer
        self.log = log

    def wait(self) -> None:
        self.log.append(self.layer)


class RecordingLane(Lane):
    """The CPU lane with its stream and events stood in: how often `copying` was entered, what was queued in it,
    and an arrival per `mark`."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.entered = 0
        self.inside = False
        self.outside_copies = 0
        self.marks = 0
        self.waits: list[int] = []

    @contextlib.contextmanager
    def copying(self):
        self.entered += 1
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def to_device(self, host, own=False):
        self.outside_copies += not self.inside
        return super().to_device(host, own)

    def mark(self):
        assert self.inside, "a layer's end is marked on the copy stream"
        self.marks += 1
        return Arrival((self.marks - 1) % len(LAYOUT.layers), self.waits)   # marks come in layer order


@pytest.mark.parametrize("make", [paged, windowed], ids=["pages", "windows"])
def test_copies_queue_in_one_block_and_the_reader_waits_per_layer_never_the_host(make):
    memory = make()
    host = HostTier(memory, BIG, piece_bytes=1)      # many pieces: still one copying block, one mark per layer
    state, kept = host_state(memory, host, 21, seed=4)
    lane = host.lane = RecordingLane()
    claim = memory.take("resumer", 40)
    host.restore(state, claim)
    kv = memory.kv
    assert lane.entered == 1 and lane.outside_copies == 0 and lane.marks == len(LAYOUT.layers)
    assert kv.arriving_layers == (0, 1) and lane.waits == []
    host.ready()
    assert lane.waits == [] and kv.arriving_layers == (0, 1)   # the host waits for nothing before the step
    kv.rows(1, "v", claim.slot, 21)                             # the step's first read of layer 1 waits for it
    assert lane.waits == [1] and kv.arriving_layers == (0,)
    kv.rows(1, "v", claim.slot, 21)
    assert lane.waits == [1]                                    # once
    kv.fixed(0, "s", claim.slot)                                # layer 0's first access, through its fixed state
    assert lane.waits == [1, 0] and kv.arriving_layers == ()
    assert same_bytes(every_state(memory, claim.slot, 21), kept)
    memory.release(claim)


def test_work_that_bypasses_the_accessors_waits_for_every_layer():
    """A graph replay, poisoning pages or clearing the slot being restored; clearing another slot does not wait."""
    memory = paged()
    host = HostTier(memory, BIG)
    state, _ = host_state(memory, host, 12, seed=5)
    lane = host.lane = RecordingLane()
    claim = memory.take("resumer", 40)
    host.restore(state, claim)
    memory.kv.arrived()                      # a CUDA graph replay (engine/graphs.py) reads the tensors directly
    assert sorted(lane.waits) == [0, 1] and memory.kv.arriving_layers == ()
    host.restore(state, other := memory.take("other", 40))
    memory.kv.clear(claim.slot)              # clearing another slot does not wait
    assert sorted(lane.waits) == [0, 1] and memory.kv.arriving_layers == (0, 1)
    memory.kv.clear(other.slot)              # clearing the slot being restored waits for every layer
    assert sorted(lane.waits) == [0, 0, 1, 1] and memory.kv.arriving_layers == ()
    host.restore(state, claim_2 := memory.take("third", 40))
    memory.kv.fill(claim_2.lease.pages[:1])  # poisoning pages waits too
    assert sorted(lane.waits) == [0, 0, 0, 1, 1, 1]
    memory.release(claim_2)
    memory.release(claim)
    memory.release(other)


def test_a_restore_into_a_claim_holding_pages_is_refused_and_integrity_still_holds():
    memory = paged()
    host = HostTier(memory, BIG)
    state, _ = host_state(memory, host, 12, seed=6)
    claim = memory.take("resumer", 40)
    memory.extend(claim, 8)
    with pytest.raises(ValueError, match="shares no pages"):
        host.restore(state, claim)
    KeptTiers(None, host).check_integrity()
    memory.release(claim)
    with pytest.raises(PoolCorrupt):
        host._bytes += 1
        host.check_integrity()
