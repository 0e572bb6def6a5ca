"""Kept states of the glm family (KDA conv and recurrent fixed states, MLA latent rows, DSA pooled keys every 4
rows and the pool tail) through the real engine and every tier, on NaN-poisoned pages:

- device tier: a three-turn chat whose turns resume from kept states gives each turn the reply of a fresh engine
  with no prompt cache, bitwise (greedy and seeded); a kept state's fixed states and rows are byte-equal to those
  a cold pass holds at the same row
- host tier: two chats on a device tier too small for both; the evicted state resumes from the host with the
  fresh replies, and a host state put back into a slot reads out byte-equal to it
- disk tier: a chat resumes from states on disk across an engine restart with the fresh replies; the state on
  disk is the image a fresh prefill makes, and put back it reads out byte-equal

Every kept state here is also byte-equal to the image of a fresh prefill of its tokens cut at its cuts, in a
fresh store: what a tier keeps depends on its tokens and cuts alone, never on what a slot held before.
And concurrent == solo: eight requests in one engine (all at once, staggered over 3 slots, in windows) each get
the reply they get alone.
Turn lengths (41, 22, 30 user rows, replies of 8) put the keep points inside pools of 4 and inside KDA chunks.
"""

from __future__ import annotations

import queue
import time
from functools import partial

import pytest
import torch

from tensorfold.engine.api import ErrorEvent, KeepMarks, Request, Sampling, TokenEvent
from tensorfold.engine.cuts import plan_cuts
from tensorfold.engine.memory import StreamMemory
from tensorfold.engine.runner import Engine
from tensorfold.image import read_out, row_offset
from tensorfold.kv import PagedStore, WindowStore
from tensorfold.plugins import load_families
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.rows.store import RowsStore
from tensorfold.testing import kit
from tensorfold.tiers import DeviceTier, HostTier
from tensorfold.tiers.disk import DiskTier
from tensorfold_glm import plugin

CONTEXT, CHUNK, MIN_CHUNK, PAGE_ROWS, REPLY = 192, 32, 8, 16, 8
USERS = (41, 22, 30)
GREEDY = Sampling(temperature=0.0, max_tokens=REPLY)
SEEDED = Sampling(temperature=0.8, top_p=0.9, seed=5, max_tokens=REPLY)
SHARED = {"num_hidden_layers": 5,
          "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                          "indexed_attention"],
          "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
          "indexer_types": ["full", "full", "shared", "full", "full"]}


def tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 41 + salt * 11) % 500 + 3 for i in range(n))


@pytest.fixture(scope="module", params=["tiny", "shared"])
def subject(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"glm-resume-{request.param}")
    plugin.write_tiny(directory, seed=3, **(SHARED if request.param == "shared" else {}))
    return kit.load(load_families(["glm"])["glm"], directory)


def memory(subject, pages: bool = True) -> StreamMemory:
    layout = subject.declarations.layout
    if not pages:
        return StreamMemory(WindowStore(layout, 2, CONTEXT, poison=True), SlotPool(2), None)
    total = 2 * -(-CONTEXT // PAGE_ROWS)
    return StreamMemory(PagedStore(layout, 2, total, PAGE_ROWS, poison=True), SlotPool(2), PagePool(total, PAGE_ROWS))


def engine(subject, mem, tier=None, host=None, disk=None) -> Engine:
    return Engine(subject.model, mem, prefill_chunk=CHUNK, context=CONTEXT, max_waiting=4, min_chunk=MIN_CHUNK,
                  tier=tier, host=host, disk=disk)


def ask(eng: Engine, prompt, sampling, starts, marks: KeepMarks | None = None):
    got: list[int] = []
    done: queue.Queue = queue.Queue()
    eng.submit(Request("r", prompt, sampling, lambda e: got.append(e.token_id) if isinstance(e, TokenEvent)
                       else done.put(e), starts=starts, marks=marks or KeepMarks()))
    event = done.get(timeout=120)
    assert not isinstance(event, ErrorEvent), event
    return got, event


def fresh(subject, prompt, sampling, starts) -> list[int]:
    eng = engine(subject, memory(subject))
    eng.start()
    try:
        reply, done = ask(eng, prompt, sampling, starts)
        assert done.cached_tokens == 0
        return reply
    finally:
        eng.close()


class Chat:
    """Turns as raw tokens: each prompt is the last prompt + its reply + a new user message; starts at every
    message, the rewind mark at the new user message."""

    def __init__(self, salt: int) -> None:
        self.salt = salt
        self.prompt: tuple[int, ...] = ()
        self.starts: tuple[int, ...] = ()
        self.turns: list[tuple[tuple[int, ...], tuple[int, ...], list[int], object]] = []

    def turn(self, eng: Engine, sampling: Sampling, user: int):
        if self.turns:
            self.starts += (len(self.prompt), len(self.prompt) + len(self.turns[-1][2]))
            self.prompt += tuple(self.turns[-1][2])
        marks = KeepMarks(rewind=len(self.prompt) or None)
        self.prompt += tokens(user, self.salt + len(self.turns))
        reply, done = ask(eng, self.prompt, sampling, self.starts, marks)
        self.turns.append((self.prompt, self.starts, reply, done))
        return done

    def check_fresh(self, subject, sampling) -> None:
        for k, (prompt, starts, reply, _) in enumerate(self.turns):
            assert len(reply) == REPLY and reply == fresh(subject, prompt, sampling, starts), f"turn {k} differs"


def cold(subject, prompt, cuts, at: int):
    """A fresh poisoned store after a prefill of prompt[:at] cut at `cuts` (the cold pass's own)."""
    kv = subject.store(1, CONTEXT)
    kit.prefill(subject, kv, 0, prompt, 0, at, [c for c in cuts if c <= at])
    return kv


def cold_states(subject, prompt, cuts, at: int):
    """Every fixed state and every row state's entries [0, at) of a cold pass at `at`."""
    kv = cold(subject, prompt, cuts, at)
    layers = kv.layout.layers
    fixed = {(i, s.name): kv.fixed(i, s.name, 0).clone() for i, layer in enumerate(layers) for s in layer.fixed}
    rows = {(i, s.name): kv.rows(i, s.name, 0, at).clone() for i, layer in enumerate(layers) for s in layer.rows}
    return fixed, rows


def cold_image(subject, prompt, cuts, at: int) -> bytes:
    return read_out(cold(subject, prompt, cuts, at), 0, at, subject.declarations.image).to_bytes()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check_device_state(subject, mem, state) -> None:
    """A device state's fixed copies and its pages + tail are the cold pass's bytes at its row."""
    fixed, rows = cold_states(subject, state.tokens, state.cuts, state.at)
    assert {(i, n) for i, n, _ in state.fixed} == set(fixed)
    for i, name, tensor in state.fixed:
        assert same(tensor, fixed[i, name]), f"at {state.at}: fixed state {i} {name}"
    layers = mem.kv.layout.layers
    for i, name, tail in state.tail:
        every = next(s.every for s in layers[i].rows if s.name == name)
        pages = mem.kv.row_pages(i, name)[list(state.pages)]
        kept = torch.cat([pages.reshape(-1, *pages.shape[2:]), tail])
        assert same(kept, rows[i, name]), f"at {state.at}: rows {i} {name}"
        assert tail.shape[0] == state.at // every - state.tail_start // every


def check_host_state(subject, mem, host, state) -> None:
    """A host state's copies are the cold pass's bytes; put back into a free slot they read out as its image."""
    fixed, rows = cold_states(subject, state.tokens, state.cuts, state.at)
    for i, name, tensor in state.fixed:
        assert same(tensor, fixed[i, name]), f"at {state.at}: fixed state {i} {name}"
    for i, name, tensor in state.rows:
        assert same(tensor, rows[i, name]), f"at {state.at}: rows {i} {name}"
    claim = mem.take("check", CONTEXT)
    try:
        host.restore(state, claim)
        image = read_out(mem.kv, claim.slot, state.at, subject.declarations.image).to_bytes()
    finally:
        mem.release(claim)
    assert image == cold_image(subject, state.tokens, state.cuts, state.at)


# -- concurrent == solo ------------------------------------------------------------------------------------------

REQUESTS = [(tokens(length, i), sampling) for i, (length, sampling) in enumerate([
    (40, Sampling(temperature=0.0, max_tokens=12)),
    (7, Sampling(temperature=1.0, seed=11, max_tokens=20)),
    (90, Sampling(temperature=0.8, top_p=0.9, seed=3, max_tokens=9)),
    (33, Sampling(temperature=0.0, max_tokens=30)),
    (16, Sampling(temperature=1.2, top_k=20, seed=5, max_tokens=15)),
    (64, Sampling(temperature=0.0, max_tokens=5)),
    (5, Sampling(temperature=0.7, min_p=0.05, seed=9, max_tokens=25)),
    (120, Sampling(temperature=0.0, max_tokens=16)),
])]


def serve_all(subject, parallel: int, pages: bool, stagger_s: float, requests) -> list[list[int]]:
    """Each request's reply from one engine with `parallel` slots; memory comes back whole."""
    layout = subject.declarations.layout
    if pages:
        total = parallel * -(-CONTEXT // PAGE_ROWS)
        mem = StreamMemory(PagedStore(layout, parallel, total, PAGE_ROWS, poison=True), SlotPool(parallel),
                           PagePool(total, PAGE_ROWS))
    else:
        mem = StreamMemory(WindowStore(layout, parallel, CONTEXT, poison=True), SlotPool(parallel), None)
    eng = Engine(subject.model, mem, prefill_chunk=CHUNK, context=CONTEXT, max_waiting=16)
    replies: list[list[int]] = [[] for _ in requests]
    done: queue.Queue = queue.Queue()
    eng.start()
    try:
        for i, (prompt, sampling) in enumerate(requests):
            eng.submit(Request(f"r{i}", prompt, sampling,
                               lambda e, i=i: replies[i].append(e.token_id) if isinstance(e, TokenEvent)
                               else done.put(e)))
            time.sleep(stagger_s)
        for _ in requests:
            event = done.get(timeout=120)
            assert not isinstance(event, ErrorEvent), event
    finally:
        eng.close()
    mem.check_integrity()
    assert mem.slots.free == parallel and (mem.pool is None or mem.pool.free == mem.pool.total)
    return replies


@pytest.fixture(scope="module")
def alone(subject):
    return [serve_all(subject, 1, True, 0.0, [request])[0] for request in REQUESTS]


@pytest.mark.parametrize("parallel, pages, stagger_s", [(8, True, 0.0), (3, True, 0.002), (8, False, 0.001)],
                         ids=["all-at-once", "staggered-3-slots", "windows"])
def test_concurrent_equals_solo(subject, alone, parallel, pages, stagger_s):
    together = serve_all(subject, parallel, pages, stagger_s, REQUESTS)
    for i, (reply, solo) in enumerate(zip(together, alone, strict=True)):
        assert len(reply) == REQUESTS[i][1].max_tokens and reply == solo, f"request {i} differs when served with others"


# -- the device tier --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_three_turns_resume_from_the_device_and_equal_fresh_runs(subject, sampling):
    mem = memory(subject)
    tier = DeviceTier(mem, budget=1 << 30)
    eng = engine(subject, mem, tier)
    chat = Chat(0)
    eng.start()
    try:
        for user in USERS:
            chat.turn(eng, sampling, user)
    finally:
        eng.close()
    chat.check_fresh(subject, sampling)
    assert [done.cached_tokens for *_, done in chat.turns] == [0, len(chat.turns[0][0]), len(chat.turns[1][0])]
    mem.check_integrity()
    tier.check_integrity()
    assert mem.pool.free + mem.pool.kept == mem.pool.total
    ats = sorted(s.at for s in tier.states)
    assert any(at % 4 for at in ats) and any(s.fixed for s in tier.states), ats   # inside a pool, KDA states kept
    for state in tier.states:
        check_device_state(subject, mem, state)
    tier.clear()
    mem.check_integrity()
    assert mem.pool.free == mem.pool.total


# -- the host tier ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_a_chat_pushed_to_the_host_resumes_as_fresh_runs(subject, pages):
    mem = memory(subject, pages=pages)
    layout = subject.declarations.layout
    device = DeviceTier(mem, budget=layout.stream_bytes(60))  # one first turn's state fits, two do not
    host = HostTier(mem, budget=1 << 30)
    eng = engine(subject, mem, device, host)
    one, two = Chat(0), Chat(50)
    eng.start()
    try:
        assert one.turn(eng, SEEDED, 45).cached_tokens == 0
        assert two.turn(eng, SEEDED, 45).cached_tokens == 0   # kept on the device: one's state goes to the host
        assert device.evicted >= 1 and one.prompt[:45] in [s.tokens[:45] for s in host.states]
        assert one.turn(eng, SEEDED, 30).cached_tokens == 45
        assert host.hits == 1
        assert two.turn(eng, SEEDED, 30).cached_tokens == 45
    finally:
        eng.close()
    for chat in (one, two):
        chat.check_fresh(subject, SEEDED)
    mem.check_integrity()
    device.check_integrity()
    host.check_integrity()
    assert host.states, "the host tier kept nothing"
    for state in host.states:
        check_host_state(subject, mem, host, state)


# -- the disk tier ----------------------------------------------------------------------------------------------


def open_disk(subject, mem, root, **kwargs) -> DiskTier:
    declarations = subject.declarations
    store = RowsStore(root, {"model": "glm-tiny"}, row_offset=partial(row_offset, declarations.layout,
                                                                      declarations.image),
                      block_rows=16, min_free_bytes=0)
    return DiskTier(mem, store, declarations.image, **{"read_bytes_per_s": 1e12, "prefill_rows_per_s": 1.0,
                                                       **kwargs})


def disk_chat(eng: Engine, disk: DiskTier, chat: Chat, users) -> Chat:
    """Turns of a chat, waiting for the I/O thread after each so the next turn finds what it wrote."""
    for user in users:
        chat.turn(eng, SEEDED, user)
        assert disk.writer.settle(30)
    return chat


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_a_chat_resumes_from_disk_across_a_restart_as_fresh_runs(subject, tmp_path, pages):
    mem = memory(subject, pages=pages)
    disk = open_disk(subject, mem, tmp_path)
    eng = engine(subject, mem, disk=disk)  # no RAM tier: every kept state is written
    eng.start()
    try:
        chat = disk_chat(eng, disk, Chat(0), USERS[:2])
    finally:
        eng.close()
    assert disk.stats().kept >= 2 and disk.hits == 1
    mem = memory(subject, pages=pages)
    disk = open_disk(subject, mem, tmp_path)  # a restart: a new store on the same directory
    device = DeviceTier(mem, budget=1 << 30)
    eng = engine(subject, mem, device, disk=disk)
    eng.start()
    try:
        disk_chat(eng, disk, chat, USERS[2:])
    finally:
        eng.close()
    assert [done.cached_tokens for *_, done in chat.turns] == [0, len(chat.turns[0][0]), len(chat.turns[1][0])]
    assert disk.hits == 1 and device.misses == 1  # the third turn came from disk, after the restart
    chat.check_fresh(subject, SEEDED)
    assert disk.failed_reads == 0


def test_the_state_on_disk_is_a_fresh_prefills_image_and_comes_back_byte_equal(subject, tmp_path):
    mem = memory(subject)
    disk = open_disk(subject, mem, tmp_path)
    eng = engine(subject, mem, disk=disk)
    other = tokens(37, 9)
    eng.start()
    try:
        ask(eng, other, SEEDED, ())               # another prompt first: the slot holds its states, not poison
        chat = disk_chat(eng, disk, Chat(0), USERS[:1])
    finally:
        eng.close()
    disk.close()
    (prompt, starts, _, _), = chat.turns
    disk = open_disk(subject, mem, tmp_path)
    entries = {entry.at: entry for entry in disk.store.entries()}
    assert len(prompt) in entries and len(other) in entries, sorted(entries)
    for at, entry in entries.items():
        written = disk.store.read(entry).to_bytes()
        source = other if at == len(other) else prompt
        assert written == cold_image(subject, source, entry.cuts, at), f"the state at {at} on disk"
    written = disk.store.read(entries[len(prompt)]).to_bytes()
    nxt = prompt + tokens(9, 77)
    state = disk.find(nxt, plan_cuts(len(nxt), (*starts, len(prompt)), CHUNK, MIN_CHUNK))
    claim = mem.take("resumer", CONTEXT)
    assert disk.restore(state, claim, "resumer") == len(prompt)
    assert read_out(mem.kv, claim.slot, len(prompt), subject.declarations.image).to_bytes() == written
    mem.release(claim)
    disk.close()
