"""Engine-level exactness gates any family runs in its own tests, through a real engine on NaN-poisoned memory.

Each gate serves requests the way the server does and checks what a family must never change: a reply served
with others equals the reply served alone; a turn resumed from a kept state (device, host or disk tier) equals
the reply of a fresh engine with no prompt cache, token for token; a kept state is the image a fresh prefill of
its tokens makes; and memory comes back whole. A family passes its subject (`kit.load`), its `Rig` and its own
requests or prompt maker; the gates raise AssertionError naming what differs.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import attrs
import torch

from tensorfold.cuts import is_cut, plan_cuts
from tensorfold.engine.api import DoneEvent, ErrorEvent, KeepMarks, PromptEvent, Request, Sampling, TokenEvent
from tensorfold.engine.runner import Engine
from tensorfold.image import read_out, row_offset
from tensorfold.kv import KvStore, PagedStore, WindowStore
from tensorfold.memory import StreamMemory
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.rows.store import RowsStore
from tensorfold.testing.kit import Oracle, Recording, Subject, check_reference, prefill
from tensorfold.tiers import DeviceTier, HostTier
from tensorfold.tiers.disk import DiskTier

Tokens = Callable[[int, int], tuple[int, ...]]  # (length, salt) -> a prompt piece
Turn = tuple[tuple[int, ...], tuple[int, ...], list[int], DoneEvent]  # prompt, starts, reply, done


@attrs.frozen
class Rig:
    """The engine shape a family's gates run under: context rows, the prefill grid, page size, queue length; and
    what a fresh reply is held to: the family's `oracle` (else a one-shot pass) within `tolerance` (kit)."""

    context: int = 256
    chunk: int = 32
    min_chunk: int = 8
    page_rows: int = 16
    max_waiting: int = 8
    oracle: Oracle | None = attrs.field(default=None, eq=False)
    tolerance: float | None = None

    def memory(self, subject: Subject, parallel: int = 2, pages: bool = True, total: int | None = None,
               poison: bool = True) -> StreamMemory:
        """Memory for `parallel` streams: pages (`total` of them, default enough for every stream) or windows;
        NaN-poisoned unless `poison` is False, so a row read before it is written shows."""
        layout = subject.declarations.layout
        if not pages:
            return StreamMemory(WindowStore(layout, parallel, self.context, poison=poison), SlotPool(parallel), None)
        total = total or parallel * -(-self.context // self.page_rows)
        return StreamMemory(PagedStore(layout, parallel, total, self.page_rows, poison=poison), SlotPool(parallel),
                            PagePool(total, self.page_rows))

    def engine(self, subject: Subject, mem: StreamMemory, tier: DeviceTier | None = None,
               host: HostTier | None = None, disk: DiskTier | None = None) -> Engine:
        """An engine on the rig's grid with the given tiers."""
        return Engine(subject.model, mem, prefill_chunk=self.chunk, context=self.context,
                      max_waiting=self.max_waiting, min_chunk=self.min_chunk, tier=tier, host=host, disk=disk)

    def fresh(self, subject: Subject, prompt: Sequence[int], sampling: Sampling,
              starts: Sequence[int] = ()) -> list[int]:
        """The reply every resumed or concurrent run must equal: the request alone on a fresh engine, no cache;
        itself the reference's (`check_reply`), so a state wrong the same way in every run still shows."""
        recording = Recording(subject.model)
        eng = self.engine(attrs.evolve(subject, model=recording), self.memory(subject))
        with running(eng):
            client = Client("fresh", tuple(prompt), sampling, tuple(starts))
            assert ask(eng, client).cached_tokens == 0
        self.check_reply(subject, prompt, client.tokens, recording.rows)
        return client.tokens

    def check_reply(self, subject: Subject, prompt: Sequence[int], reply: Sequence[int],
                    rows: Sequence[torch.Tensor]) -> None:
        """An engine's logits for a reply (after the prompt, after each reply token but the last) are the oracle's,
        else a one-shot pass's, within the tolerance (kit.check_reference)."""
        if reply:
            check_reference(subject, prompt, reply[:-1], rows[:len(reply)], self.oracle, self.tolerance,
                            f"a fresh engine's reply to a {len(prompt)}-token prompt")

    def cold(self, subject: Subject, prompt: Sequence[int], cuts: Sequence[int], at: int) -> KvStore:
        """A fresh poisoned store after a prefill of prompt[:at] cut at `cuts` (the cold pass's own)."""
        kv = subject.store(1, self.context)
        prefill(subject, kv, 0, prompt, 0, at, [c for c in cuts if c <= at])
        return kv

    def cold_image(self, subject: Subject, prompt: Sequence[int], cuts: Sequence[int], at: int) -> bytes:
        """What a kept state's image must be: a cold prefill's, read out of a fresh store."""
        return read_out(self.cold(subject, prompt, cuts, at), 0, at, subject.declarations.image).to_bytes()


@contextlib.contextmanager
def running(eng: Engine) -> Iterator[Engine]:
    """Start the engine's step loop and close it however the block ends, so a failed gate leaves no thread."""
    eng.start()
    try:
        yield eng
    finally:
        eng.close()


class Client:
    """Collects one request's events; can cancel after a number of tokens."""

    def __init__(self, name: str, prompt: tuple[int, ...], sampling: Sampling, starts: tuple[int, ...] = (),
                 cancel_after: int | None = None, marks: KeepMarks | None = None) -> None:
        self.tokens: list[int] = []
        self.prompt_entries: list = []  # the PromptEvent's, when the sampling asks for prompt logprobs
        self.done: queue.Queue = queue.Queue()
        self.cancel_after = cancel_after
        self.request = Request(name, prompt, sampling, self.on_event, starts=starts, marks=marks or KeepMarks())

    def on_event(self, event: object) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token_id)
            if self.cancel_after is not None and len(self.tokens) >= self.cancel_after:
                self.request.cancel()
        elif isinstance(event, PromptEvent):
            self.prompt_entries = list(event.entries)
        else:
            self.done.put(event)

    def result(self, timeout: float = 120.0) -> DoneEvent:
        """The request's last event, which must not be an error."""
        event = self.done.get(timeout=timeout)
        assert not isinstance(event, ErrorEvent), event
        return event


def ask(eng: Engine, client: Client) -> DoneEvent:
    """Submit one request and wait for its answer."""
    eng.submit(client.request)
    return client.result()


class Chat:
    """A chat as raw tokens: each turn's prompt is the last prompt + its reply + a new user message, with starts at
    every message and (unless `rewind` is False) the rewind mark at the new user message."""

    def __init__(self, tokens: Tokens, salt: int = 0, name: str = "t", rewind: bool = True) -> None:
        self.tokens, self.salt, self.name, self.rewind = tokens, salt, name, rewind
        self.prompt: tuple[int, ...] = ()
        self.starts: tuple[int, ...] = ()
        self.turns: list[Turn] = []

    def turn(self, eng: Engine, sampling: Sampling, user: int, cancel_after: int | None = None) -> DoneEvent:
        """Ask the next turn, `user` new tokens after the last reply; its answer."""
        if self.turns:
            self.starts += (len(self.prompt), len(self.prompt) + len(self.turns[-1][2]))
            self.prompt += tuple(self.turns[-1][2])
        marks = KeepMarks(rewind=(len(self.prompt) or None) if self.rewind else None)
        self.prompt += self.tokens(user, self.salt + len(self.turns))
        client = Client(f"{self.name}{len(self.turns)}", self.prompt, sampling, self.starts,
                        cancel_after=cancel_after, marks=marks)
        done = ask(eng, client)
        self.turns.append((self.prompt, self.starts, client.tokens, done))
        return done

    def check_fresh(self, subject: Subject, rig: Rig, sampling: Sampling) -> None:
        """Every full turn's reply is the fresh engine's."""
        for k, (prompt, starts, reply, _) in enumerate(self.turns):
            assert len(reply) == sampling.max_tokens and reply == rig.fresh(subject, prompt, sampling, starts), (
                f"{self.name}{k} differs from a fresh run")


def check_memory(mem: StreamMemory, tiers: Sequence[DeviceTier | HostTier | DiskTier]) -> None:
    """Memory and every tier are consistent, no stream holds anything, kept pages are the only pages taken."""
    mem.check_integrity()
    for tier in tiers:
        tier.check_integrity()
    assert mem.slots.free == mem.slots.count
    if mem.pool is not None:
        assert mem.pool.free + mem.pool.kept == mem.pool.total and mem.pool.snapshot()["leases"] == 0


# -- concurrent == solo ------------------------------------------------------------------------------------------


MIXED = [
    (40, Sampling(temperature=0.0, max_tokens=12)),
    (7, Sampling(temperature=1.0, seed=11, max_tokens=20)),
    (90, Sampling(temperature=0.8, top_p=0.9, seed=3, max_tokens=9)),
    (33, Sampling(temperature=0.0, max_tokens=30)),
    (16, Sampling(temperature=1.2, top_k=20, seed=5, max_tokens=15)),
    (64, Sampling(temperature=0.0, max_tokens=5)),
    (5, Sampling(temperature=0.7, min_p=0.05, seed=9, max_tokens=25)),
    (120, Sampling(temperature=0.0, max_tokens=16)),
]  # (prompt length, sampling): greedy and seeded, short and long, stopping at different steps


SHAPES = [(8, True, 0.0), (3, True, 0.002), (8, False, 0.001)]  # (parallel, pages, stagger_s) to serve MIXED in
SHAPE_IDS = ["all-at-once", "staggered-3-slots", "windows"]


def mixed_requests(tokens: Tokens) -> list[tuple[tuple[int, ...], Sampling]]:
    """MIXED with prompts from the family's `tokens`: request i's prompt has salt i."""
    return [(tokens(length, i), sampling) for i, (length, sampling) in enumerate(MIXED)]


def serving_engine(subject: Subject, rig: Rig, mem: StreamMemory) -> Engine:
    """An engine with no tiers and room for many waiting requests, on the default request-start merge."""
    return Engine(subject.model, mem, prefill_chunk=rig.chunk, context=rig.context, max_waiting=16)


def serve(eng: Engine, clients: Sequence[Client], stagger_s: float = 0.0) -> None:
    """Submit every client's request, `stagger_s` apart, and wait for every answer."""
    with running(eng):
        for client in clients:
            eng.submit(client.request)
            time.sleep(stagger_s)
        for client in clients:
            client.result()


def serve_all(subject: Subject, rig: Rig, requests: Sequence[tuple[tuple[int, ...], Sampling]], parallel: int,
              pages: bool = True, stagger_s: float = 0.0, poison: bool = True) -> list[list[int]]:
    """Each request's reply from one engine with `parallel` slots; memory comes back whole."""
    mem = rig.memory(subject, parallel, pages=pages, poison=poison)
    clients = [Client(f"r{i}", prompt, sampling) for i, (prompt, sampling) in enumerate(requests)]
    serve(serving_engine(subject, rig, mem), clients, stagger_s)
    mem.check_integrity()
    assert mem.slots.free == parallel and (mem.pool is None or mem.pool.free == mem.pool.total)
    return [client.tokens for client in clients]


def alone(subject: Subject, rig: Rig, requests: Sequence[tuple[tuple[int, ...], Sampling]]) -> list[list[int]]:
    """Each request's reply served on its own, held to the reference (Rig.check_reply)."""
    replies = []
    for prompt, sampling in requests:
        recording = Recording(subject.model)
        reply = serve_all(attrs.evolve(subject, model=recording), rig, [(prompt, sampling)], 1)[0]
        rig.check_reply(subject, prompt, reply, recording.rows)
        replies.append(reply)
    return replies


def check_concurrent_equals_solo(subject: Subject, rig: Rig, requests: Sequence[tuple[tuple[int, ...], Sampling]],
                                 solo: Sequence[list[int]], parallel: int, pages: bool, stagger_s: float) -> None:
    """Requests served together each get their full reply, the one they get alone."""
    together = serve_all(subject, rig, requests, parallel, pages, stagger_s)
    for i, (reply, one) in enumerate(zip(together, solo, strict=True)):
        assert len(reply) == requests[i][1].max_tokens and reply == one, f"request {i} differs when served with others"


# -- the device tier --------------------------------------------------------------------------------------------


def check_device_resume(subject: Subject, rig: Rig, sampling: Sampling, tokens: Tokens, users: Sequence[int],
                        pages: bool = True, rewind: bool = True,
                        inspect: Callable[[StreamMemory, DeviceTier, list[Turn]], None] | None = None) -> None:
    """A chat's turns each resume at the previous prompt's end (a cut of their own pass) from the device tier with
    the fresh replies; `inspect` sees the kept states before the tier is cleared and memory comes back whole."""
    mem = rig.memory(subject, pages=pages)
    tier = DeviceTier(mem, budget=1 << 30)
    eng = rig.engine(subject, mem, tier)
    chat = Chat(tokens, rewind=rewind)
    with running(eng):
        for user in users:
            chat.turn(eng, sampling, user)
    chat.check_fresh(subject, rig, sampling)
    previous = 0
    for k, (prompt, starts, _, done) in enumerate(chat.turns):
        assert done.cached_tokens == previous and done.prompt_tokens == len(prompt), f"turn {k} resumed elsewhere"
        assert previous == 0 or is_cut(previous, len(prompt), starts, rig.chunk, rig.min_chunk)
        previous = len(prompt)
    assert tier.hits == len(users) - 1
    check_memory(mem, (tier,))
    if pages and mem.pool is not None:   # a Layout without row states holds no pages (StreamMemory)
        assert mem.pool.kept > 0
    if inspect is not None:
        inspect(mem, tier, chat.turns)
    tier.clear()
    mem.check_integrity()
    assert mem.slots.free == mem.slots.count and (mem.pool is None or mem.pool.free == mem.pool.total)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality: NaN payloads and signed zeros count."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def cold_states(subject: Subject, rig: Rig, prompt: Sequence[int], cuts: Sequence[int],
                at: int) -> tuple[dict, dict]:
    """Every fixed state and every row state's entries [0, at) of a cold pass at `at`, by (layer, name)."""
    kv = rig.cold(subject, prompt, cuts, at)
    layers = kv.layout.layers
    fixed = {(i, s.name): kv.fixed(i, s.name, 0).clone() for i, layer in enumerate(layers) for s in layer.fixed}
    rows = {(i, s.name): kv.rows(i, s.name, 0, at).clone() for i, layer in enumerate(layers) for s in layer.rows}
    return fixed, rows


def check_kept_state(mem: StreamMemory, state: object, fixed: dict, rows: dict) -> None:
    """A paged device state's fixed copies and its pages + tail are, byte for byte, the given cold pass's."""
    assert {(i, n) for i, n, _ in state.fixed} == set(fixed), f"at {state.at}: not every fixed state kept"
    for i, name, tensor in state.fixed:
        assert same(tensor, fixed[i, name]), f"at {state.at}: fixed state {i} {name}"
    layers = mem.kv.layout.layers
    for i, name, tail in state.tail:
        every = next(s.every for s in layers[i].rows if s.name == name)
        held = mem.kv.row_pages(i, name)[list(state.pages)]
        kept = torch.cat([held.reshape(-1, *held.shape[2:]), tail])
        assert same(kept, rows[i, name]), f"at {state.at}: rows {i} {name}"
        assert tail.shape[0] == state.at // every - state.tail_start // every


def check_device_state(subject: Subject, rig: Rig, mem: StreamMemory, state: object) -> None:
    """A device state holds what a cold prefill of its tokens, cut at its cuts, holds at its row."""
    check_kept_state(mem, state, *cold_states(subject, rig, state.tokens, state.cuts, state.at))


# -- the host tier ----------------------------------------------------------------------------------------------


def chats_through_host(subject: Subject, rig: Rig, sampling: Sampling, tokens: Tokens, pages: bool = True,
                       last: int | None = None) -> tuple[StreamMemory, DeviceTier, HostTier, Chat, Chat]:
    """Two chats on a device tier that keeps one first turn's state: the first chat's state is pushed to the host,
    its next turn resumes from there, then the second's from the device (and the first's once more, `last` new
    tokens); every reply is the fresh one. Returns the memory, tiers and chats for the family's own checks."""
    mem = rig.memory(subject, pages=pages)
    device = DeviceTier(mem, budget=subject.declarations.layout.stream_bytes(60))  # one first turn fits, two do not
    host = HostTier(mem, budget=1 << 30)
    eng = rig.engine(subject, mem, device, host)
    one, two = Chat(tokens, 0, "one"), Chat(tokens, 50, "two")
    with running(eng):
        assert one.turn(eng, sampling, 45).cached_tokens == 0
        assert two.turn(eng, sampling, 45).cached_tokens == 0  # kept on the device: one's state goes to the host
        assert [s.tokens[:45] for s in host.states] == [one.prompt[:45]] and device.evicted == 1
        assert one.turn(eng, sampling, 30).cached_tokens == 45
        assert host.hits == 1
        assert two.turn(eng, sampling, 30).cached_tokens == 45
        if last is not None:
            assert one.turn(eng, sampling, last).cached_tokens == len(one.turns[1][0])
        check_memory(mem, eng.tiers)
    for chat in (one, two):
        chat.check_fresh(subject, rig, sampling)
    return mem, device, host, one, two


def check_host_state(subject: Subject, rig: Rig, mem: StreamMemory, host: HostTier, state: object) -> None:
    """A host state's copies are the cold pass's bytes; put back into a free slot they read out as its image."""
    fixed, rows = cold_states(subject, rig, state.tokens, state.cuts, state.at)
    for i, name, tensor in state.fixed:
        assert same(tensor, fixed[i, name]), f"at {state.at}: fixed state {i} {name}"
    for i, name, tensor in state.rows:
        assert same(tensor, rows[i, name]), f"at {state.at}: rows {i} {name}"
    claim = mem.take("check", rig.context)
    try:
        host.restore(state, claim)
        image = read_out(mem.kv, claim.slot, state.at, subject.declarations.image).to_bytes()
    finally:
        mem.release(claim)
    assert image == rig.cold_image(subject, state.tokens, state.cuts, state.at)


# -- the disk tier ----------------------------------------------------------------------------------------------


def open_disk(subject: Subject, mem: StreamMemory, root: Path, **kwargs: float) -> DiskTier:
    """A disk tier on `root` that reads every state it finds unless `kwargs` change the payoff rule."""
    declarations = subject.declarations
    store = RowsStore(root, {"model": f"{subject.family.name}-tiny"},
                      row_offset=partial(row_offset, declarations.layout, declarations.image),
                      block_rows=16, min_free_bytes=0)
    return DiskTier(mem, store, declarations.image, **{"read_bytes_per_s": 1e12, "prefill_rows_per_s": 1.0,
                                                       **kwargs})


def disk_chat(eng: Engine, disk: DiskTier, chat: Chat, sampling: Sampling, users: Sequence[int]) -> Chat:
    """Turns of a chat, waiting for the I/O thread after each so the next turn finds what it wrote."""
    for user in users:
        chat.turn(eng, sampling, user)
        assert disk.writer.settle(30)
    return chat


def check_disk_resume_across_restart(subject: Subject, rig: Rig, root: Path, sampling: Sampling, tokens: Tokens,
                                     users: Sequence[int], pages: bool = True) -> None:
    """Two turns with every kept state written to disk, a restart on the same directory, a third turn resumed from
    disk: each reply is the fresh one and nothing failed to read."""
    mem = rig.memory(subject, pages=pages)
    disk = open_disk(subject, mem, root)
    with running(rig.engine(subject, mem, disk=disk)) as eng:  # no RAM tier: every kept state is written
        chat = disk_chat(eng, disk, Chat(tokens), sampling, users[:2])
    assert disk.stats().kept >= 2 and disk.hits == 1
    mem = rig.memory(subject, pages=pages)
    disk = open_disk(subject, mem, root)  # a restart: a new store on the same directory
    device = DeviceTier(mem, budget=1 << 30)
    with running(rig.engine(subject, mem, device, disk=disk)) as eng:
        disk_chat(eng, disk, chat, sampling, users[2:])
    assert [done.cached_tokens for *_, done in chat.turns] == [0, len(chat.turns[0][0]), len(chat.turns[1][0])]
    assert disk.hits == 1 and device.misses == 1  # the third turn came from disk, after the restart
    chat.check_fresh(subject, rig, sampling)
    assert disk.failed_reads == 0


def check_disk_image(subject: Subject, rig: Rig, root: Path, sampling: Sampling, tokens: Tokens, user: int,
                     before: tuple[int, ...] = ()) -> None:
    """After `before` (when given, so the slot holds its states, not poison) and a one-turn chat, every state on
    disk is the image of a fresh prefill on the planned cuts, and one put back reads out byte-equal."""
    mem = rig.memory(subject)
    disk = open_disk(subject, mem, root)
    with running(rig.engine(subject, mem, disk=disk)) as eng:
        if before:
            ask(eng, Client("before", before, sampling))
        (prompt, starts, _, _), = disk_chat(eng, disk, Chat(tokens), sampling, [user]).turns
    disk.close()
    disk = open_disk(subject, mem, root)
    entries = {entry.at: entry for entry in disk.store.entries()}
    sources = {len(prompt): (prompt, starts), **({len(before): (before, ())} if before else {})}
    assert set(entries) == set(sources), sorted(entries)
    for at, (source, source_starts) in sources.items():
        written = disk.store.read(entries[at]).to_bytes()
        assert written == rig.cold_image(subject, source, entries[at].cuts, at), f"the state at {at} on disk"
        planned = plan_cuts(len(source), source_starts, rig.chunk, rig.min_chunk)
        assert written == rig.cold_image(subject, source, planned, at), f"the state at {at}: not the planned cuts"
    written = disk.store.read(entries[len(prompt)]).to_bytes()
    nxt = prompt + tokens(9, 77)
    state = disk.find(nxt, plan_cuts(len(nxt), (*starts, len(prompt)), rig.chunk, rig.min_chunk))
    claim = mem.take("resumer", rig.context)
    assert disk.restore(state, claim, "resumer") == len(prompt)
    assert read_out(mem.kv, claim.slot, len(prompt), subject.declarations.image).to_bytes() == written
    mem.release(claim)
    disk.close()
