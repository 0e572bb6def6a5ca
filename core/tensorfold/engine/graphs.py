"""Decode steps through a family's tensor-only `decode`, on static buffers padded to a fixed set of batch sizes,
replayed from CUDA graphs on the GPU.

    a step where every stream feeds one token it samples, none at position 0, and at most max(sizes) streams:
        tokens, positions, slots, page tables -> the static buffers of the next size up (one host->device copy
        each); rows past the streams are padding (slot -1: no state read or written)
        GPU: replay the graph captured for that size; elsewhere: call `decode` on the buffers
    any other step (prefill chunks, mixed steps, a one-token prompt): the family's `forward`
    a step launched ahead (engine/ahead.py, `forward_ahead`): the same, its tokens gathered on the device from the
        previous step's sampled ids

A graph replays the kernels recorded at capture with the buffers' current contents, so a step's launches cost one
replay instead of hundreds of kernel launches. The wrapper is itself a FamilyModel, so the engine never knows.
"""

from __future__ import annotations

import logging
import time

import torch

from tensorfold.family import FamilyModel
from tensorfold.kv import KvStore
from tensorfold.plan import DecodeBatch, StepPlan

log = logging.getLogger(__name__)


def batch_sizes(streams: int, largest: int = 256) -> tuple[int, ...]:
    """Captured sizes up to the streams that can run at once (at most `largest`): 1, 2, 4, 8, then every 8 to 64,
    every 16 to 128, every 32 beyond, the last one exactly `streams` (or `largest`)."""
    top = max(1, min(streams, largest))
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, largest + 1, 32)]
    return tuple(sorted({s for s in sizes if s < top} | {top}))


def has_decode(model: object) -> bool:
    """Whether a family model offers the tensor-only decode step."""
    return callable(getattr(model, "decode", None))


class DecodeRunner:
    """A FamilyModel whose one-token-per-stream steps run `model.decode` on padded static buffers."""

    def __init__(self, model: FamilyModel, kv: KvStore, sizes: tuple[int, ...], context: int,
                 graphs: bool) -> None:
        if not has_decode(model):
            raise TypeError(f"{type(model).__name__} has no decode(batch, kv) method")
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"batch sizes must rise from 1 up, got {sizes}")
        self.model = model
        self.kv = kv
        self.vocab_size = model.vocab_size
        self.sizes = sizes
        self.graphs = graphs and kv.device.type == "cuda"
        width = kv.table_width(context)
        top = sizes[-1]
        pinned = kv.device.type == "cuda"
        self._host_rows = torch.zeros((3, top), dtype=torch.int64, pin_memory=pinned)    # tokens, positions, slots
        self._host_tables = torch.zeros((top, width), dtype=torch.int32, pin_memory=pinned)
        self._rows = torch.zeros((3, top), dtype=torch.int64, device=kv.device)
        self._tables = torch.zeros((top, width), dtype=torch.int32, device=kv.device)
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._slot_tables = torch.zeros((kv.slots, width), dtype=torch.int32)  # each slot's last table, on the host
        self._slot_seen: list[tuple[int, ...] | None] = [None] * kv.slots     # the table each row was copied from
        self._copied = torch.cuda.Event() if pinned else None     # the staging buffers are free again
        self.replays = 0
        self.ahead = 0  # steps launched on a previous step's ids still on the device

    def batch(self, size: int) -> DecodeBatch:
        """The static buffers' first `size` rows as a DecodeBatch."""
        return DecodeBatch(tokens=self._rows[0, :size], positions=self._rows[1, :size], slots=self._rows[2, :size],
                           tables=self._tables[:size])

    def capture(self) -> None:
        """Record one graph per size (largest first, sharing one memory pool), on all-padding buffers: capture
        reads and writes no stream's state."""
        if not self.graphs:
            return
        began = time.perf_counter()
        self._pad(0)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for size in self.sizes:
                self.model.decode(self.batch(size), self.kv)                      # compile and warm the kernels
        torch.cuda.current_stream().wait_stream(side)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model.decode(self.batch(size), self.kv)
            self._captured[size] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured decode graphs for %d batch sizes up to %d in %.1f s", len(self.sizes), self.sizes[-1],
                 time.perf_counter() - began)

    def covers(self, plan: StepPlan, kv: KvStore) -> bool:
        """Whether this step is one the decode path takes."""
        return (kv is self.kv and 0 < len(plan.streams) <= self.sizes[-1]
                and all(len(s.tokens) == 1 and s.sample and not s.every_row and s.start > 0
                        for s in plan.streams))

    def forward(self, plan: StepPlan, kv: KvStore) -> torch.Tensor:
        """The step's float32 logits [plan.logit_rows, V], by the decode path when it covers the step."""
        out = self._decode(plan, None) if self.covers(plan, kv) else None
        return out if out is not None else self.model.forward(plan, kv)

    def forward_ahead(self, plan: StepPlan, kv: KvStore, source: torch.Tensor) -> torch.Tensor | None:
        """`forward` for a decode step whose tokens are still on the device: each share's token is the index of
        its row in `source` (a step's sampled ids, int64, not yet read back; -1, a refused row, feeds token 0).
        None when the decode path does not take the step: the caller reads the ids back and plans it as usual."""
        if not self.covers(plan, kv):
            return None
        out = self._decode(plan, source)
        self.ahead += out is not None
        return out

    def _decode(self, plan: StepPlan, source: torch.Tensor | None) -> torch.Tensor | None:
        """Fill the static buffers in bulk (rows by one copy, tables from the per-slot cache), replay or call
        `decode`; None when a table does not fit the buffers."""
        n = len(plan.streams)
        size = next(s for s in self.sizes if s >= n)
        slots = [step.slot for step in plan.streams]
        if not self._cache_tables(slots):
            return None
        if self._copied is not None:
            self._copied.synchronize()
        self.kv.arrived()  # a replay reads the captured tensors, not through the store's accessors
        self._pad(n)
        self._host_rows[:, :n] = torch.tensor([[step.tokens[0] for step in plan.streams],
                                               [step.start for step in plan.streams], slots], dtype=torch.int64)
        torch.index_select(self._slot_tables, 0, self._host_rows[2, :n], out=self._host_tables[:n])
        self._rows[:, :size].copy_(self._host_rows[:, :size], non_blocking=True)
        self._tables[:size].copy_(self._host_tables[:size], non_blocking=True)
        if source is not None:  # the tokens row holds rows of `source`: the ids themselves never visit the host
            picked = source.index_select(0, self._rows[0, :n]).clamp_(min=0)
            self._rows[0, :n].copy_(picked)
        if self._copied is not None:
            self._copied.record()
        if size in self._captured:
            graph, out = self._captured[size]
            graph.replay()
            self.replays += 1
        else:
            out = self.model.decode(self.batch(size), self.kv)
        return out[:n].clone()

    def _cache_tables(self, slots: list[int]) -> bool:
        """Bring the slots' rows of the host table cache up to date (a slot's table is copied only when it
        changed); False when one is wider than the buffers."""
        width = self._slot_tables.shape[1]
        for slot in slots:
            table = self.kv.host_table(slot)
            seen = self._slot_seen[slot]
            if table is seen or table == seen:
                continue
            if len(table) > width:
                return False
            self._slot_tables[slot, : len(table)] = torch.tensor(table, dtype=torch.int32)
            self._slot_tables[slot, len(table):] = 0
            self._slot_seen[slot] = table
        return True

    def _pad(self, first: int) -> None:
        """Rows from `first` on become padding: token 0 at position 0, slot -1, table of page 0."""
        self._host_rows[:, first:] = 0
        self._host_rows[2, first:] = -1
        self._host_tables[first:] = 0
        if first == 0:
            self._rows.copy_(self._host_rows)
            self._tables.copy_(self._host_tables)

    def __getattr__(self, name: str):
        """Everything else (forward_all, config, ...) is the family model's."""
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)
