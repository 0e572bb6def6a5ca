"""A family's tensor-only decode inside a real CPU Engine: the decode runner (eager, as on the GPU without graphs),
with and without steps launched ahead, gives every token and finish reason the family's forward alone gives. Shared
by the families that offer `decode` (their tests pass their kit subject, token maker and store shape), with the
helpers their decode tests build batches and compare states with."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tensorfold.engine.api import Sampling
from tensorfold.engine.graphs import DecodeRunner, batch_sizes
from tensorfold.engine.runner import Engine
from tensorfold.kv import PagedStore
from tensorfold.memory import StreamMemory
from tensorfold.plan import DecodeBatch, StepPlan
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
