"""A family's tensor-only decode inside a real CPU Engine: the decode runner (eager, as on the GPU without graphs),
with and without steps launched ahead, gives every token and finish reason the family's forward alone gives. Shared
by the families that offer `decode` (their tests pass their kit subject, token maker and store shape), with the
gates and helpers their decode tests share: a padded batch against a reference, the runner's cover of decode steps,
batches, prefills and state compares."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tensorfold.engine.api import Sampling
from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.engine.runner import Engine
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.plan import DecodeBatch, StepPlan, StreamStep
from tensorfold.pool.pages import PagePool
from tensorfold.pool.slots import SlotPool
from tensorfold.testing.engine_gates import Client, running

REQUESTS = [  # (prompt length, sampling): ending at different steps, so the decode batches shrink
    (20, Sampling(temperature=0.0, max_tokens=24)),
    (7, Sampling(temperature=1.0, seed=11, max_tokens=30)),
    (33, Sampling(temperature=0.8, top_p=0.9, seed=3, max_tokens=18)),
    (70, Sampling(temperature=0.0, max_tokens=40)),   # a context of 96 ends it first
    (5, Sampling(temperature=0.0, max_tokens=1)),
]
PARALLEL, CHUNK = 4, 32


class Counting:
    """A family model whose decode calls are counted."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.decodes = 0

    def forward(self, plan: StepPlan, kv) -> torch.Tensor:
        return self.inner.forward(plan, kv)

    def decode(self, batch: DecodeBatch, kv) -> torch.Tensor:
        self.decodes += 1
        return self.inner.decode(batch, kv)


def serve(subject, tokens: Callable[[int, int], tuple[int, ...]], context: int, page_rows: int, runner: bool,
          overlap: bool = False) -> tuple[list[list[int]], list[str], int]:
    """REQUESTS at once through an Engine on a paged store: each reply's tokens and finish reason, and how many
    decode steps ran."""
    pages = PARALLEL * -(-context // page_rows)
    kv = PagedStore(subject.declarations.layout, PARALLEL, pages, page_rows, subject.device, poison=True)
    memory = StreamMemory(kv, SlotPool(PARALLEL), PagePool(pages, page_rows))
    counted = Counting(subject.model)
    model = DecodeRunner(counted, kv, batch_sizes(PARALLEL), context, graphs=False) if runner else subject.model
    clients = [Client(f"r{salt}", tokens(n, salt), sampling) for salt, (n, sampling) in enumerate(REQUESTS)]
    with running(Engine(model, memory, CHUNK, context, 16, overlap=overlap)) as engine:
        for client in clients:
            engine.submit(client.request)
        done = [client.result() for client in clients]
    return [c.tokens for c in clients], [d.finish_reason for d in done], counted.decodes


def check_engine_with_decode(subject, tokens: Callable[[int, int], tuple[int, ...]], context: int = 96,
                             page_rows: int = 16) -> None:
    """The runner's tokens and finish reasons equal the forward's, with and without steps launched ahead."""
    plain, reasons, _ = serve(subject, tokens, context, page_rows, runner=False)
    assert [len(t) for t in plain] == [24, 30, 18, context - 70, 1]
    for overlap in (False, True):
        got, got_reasons, decodes = serve(subject, tokens, context, page_rows, runner=True, overlap=overlap)
        assert decodes > 0
        assert got == plain and got_reasons == reasons, overlap


def batch_of(store, rows: list[tuple[int, int, int] | None], context: int) -> DecodeBatch:
    """A DecodeBatch of (slot, token, position) rows, None a padded row (token 0, position 0, slot -1, page 0), as
    the runner pads; tables as wide as a `context`-row stream's."""
    tables = torch.zeros((len(rows), store.table_width(context)), dtype=torch.int32)
    for i, row in enumerate(rows):
        if row is not None:
            table = store.host_table(row[0])
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    live = [row or (-1, 0, 0) for row in rows]
    return DecodeBatch(tokens=torch.tensor([t for _, t, _ in live]), positions=torch.tensor([p for _, _, p in live]),
                       slots=torch.tensor([s for s, _, _ in live]), tables=tables)


def fixed_states(store, slot: int) -> list[torch.Tensor]:
    """Copies of every fixed state of a slot, layer by layer."""
    return [store.fixed(i, spec.name, slot).clone() for i, layer in enumerate(store.layout.layers)
            for spec in layer.fixed]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN poison included."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def prefill(subject, store, prompts: dict[int, Sequence[int]]) -> dict[int, int]:
    """Each slot's prompt through `forward` alone; each stream's greedy first token."""
    first = {}
    for slot, prompt in prompts.items():
        logits = subject.model.forward(StepPlan((StreamStep(slot, 0, tuple(prompt)),)), store)
        first[slot] = int(logits[0].argmax())
    return first


def all_pages(store) -> list[torch.Tensor]:
    """Every row state's pages flat [pages · entries, *shape], cloned."""
    return [store.row_pages(i, spec.name).flatten(0, 1).clone() for i, layer in enumerate(store.layout.layers)
            for spec in layer.rows]


def page_rows_written(store, slots: list[int], position: dict[int, int]) -> list[list[int]]:
    """For each row state (in `all_pages` order), the flat page rows a decode step of `slots` writes (a state
    written every `spec.every` positions writes when the row completes one)."""
    found = []
    for i, layer in enumerate(store.layout.layers):
        for spec in layer.rows:
            per_page = store.row_pages(i, spec.name).shape[1]
            rows = []
            for slot in slots:
                if (position[slot] + 1) % spec.every == 0:
                    entry = position[slot] // spec.every
                    rows.append(store.host_table(slot)[entry // per_page] * per_page + entry % per_page)
            found.append(rows)
    return found


def padded_steps(subject, reference_store, decoded, token: dict[int, int], position: dict[int, int], steps: int,
                 context: int, reference: Callable[[StepPlan, object], torch.Tensor], exact_tokens: bool) -> float:
    """Three prefilled streams (slots 3, 0, 1) decoded in a batch of 8 with padding between them, `steps` steps,
    each fed the reference's greedy token (`reference(plan, reference_store)`, one row per stream): asserts the
    greedy tokens equal (exact_tokens), that padded rows write no page row but the live rows' new ones and leave
    the idle slots (2 and the last) byte for byte; advances `token` and `position`; returns max |Δlogit|."""
    idle = (2, decoded.slots - 1)
    for slot in idle:   # something a stray write would change
        for i, layer in enumerate(decoded.layout.layers):
            for spec in layer.fixed:
                decoded.fixed(i, spec.name, slot).copy_(torch.randn(decoded.fixed(i, spec.name, slot).shape))
    kept = {slot: fixed_states(decoded, slot) for slot in idle}
    order = [3, None, 0, 1, None, None, None, None]
    live = [slot for slot in order if slot is not None]
    worst = 0.0
    for _ in range(steps):
        plan = StepPlan(tuple(StreamStep(slot, position[slot], (token[slot],)) for slot in live))
        expected = reference(plan, reference_store)
        pages = all_pages(decoded)
        got = subject.model.decode(
            batch_of(decoded, [None if s is None else (s, token[s], position[s]) for s in order], context), decoded)
        got = got[[i for i, slot in enumerate(order) if slot is not None]]
        assert got.shape == expected.shape
        worst = max(worst, float((expected - got).abs().max()))
        if exact_tokens:
            assert torch.equal(expected.argmax(-1), got.argmax(-1))
        for before, after, written in zip(pages, all_pages(decoded), page_rows_written(decoded, live, position),
                                          strict=True):
            untouched = torch.ones(before.shape[0], dtype=torch.bool)
            untouched[written] = False
            assert same_bytes(before[untouched], after[untouched]), "a padded row wrote a page row"
        for i, slot in enumerate(live):
            token[slot] = int(expected[i].argmax())
            position[slot] += 1
    for slot in idle:
        assert all(same_bytes(a, b) for a, b in zip(kept[slot], fixed_states(decoded, slot), strict=True)), \
            f"a padded row wrote idle slot {slot}'s state"
    return worst


def runner_covers_decode_steps(subject, prompt: Sequence[int], context: int, page_rows: int,
                               reference: Callable[[StepPlan, object], torch.Tensor]
                               ) -> tuple[torch.Tensor, torch.Tensor, StepPlan, StepPlan]:
    """A DecodeRunner of sizes (1, 2) covers a one-token step of a prefilled stream only (not a chunk, a first
    token, three streams, or a store of its own it was not built on); its logits for that step and the reference's
    on a twin store: (got, expected, the prefill chunk, the decode step)."""
    store = subject.store(3, context, page_rows=page_rows)
    runner = DecodeRunner(subject.model, store, sizes=(1, 2), context=context, graphs=False)
    chunk = StepPlan((StreamStep(0, 0, tuple(prompt)),))
    first_token = StepPlan((StreamStep(1, 0, (7,)),))
    too_many = StepPlan(tuple(StreamStep(s, len(prompt), (7,)) for s in range(3)))
    decode = StepPlan((StreamStep(0, len(prompt), (9,)),))
    assert not runner.covers(chunk, store) and not runner.covers(first_token, store)
    assert not runner.covers(too_many, store)
    assert not runner.covers(decode, subject.store(3, context, page_rows=page_rows))
    twin = subject.store(3, context, page_rows=page_rows)
    for kv in (store, twin):
        subject.model.forward(chunk, kv)
    assert runner.covers(decode, store)
    got = runner.forward(decode, store)
    assert got.shape == (1, subject.model.vocab_size)
    return got, reference(decode, twin), chunk, decode
