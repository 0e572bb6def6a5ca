"""The device tier: kept prompt states in the stream memory itself.

A state kept at `at` is what a stream held right after the prefill step that ended at `at` (a cut of its cold
pass), before any later step wrote more:

    pages   the full pages of rows [0, at // page_rows · page_rows), held by reference (PagePool.keep): the
            source stream only writes rows ≥ at, so these never change while it runs on
    tail    a copy of the rows of the partial last page, [full · page_rows, at): the source stream goes on
            writing that page, and so would a resumer; a resumer gets them copied into a fresh page of its own
    fixed   a copy of every fixed state of the slot

With one window per stream (TF_KV_PAGES=0) there are no pages: the tail is every row [0, at).

A request resumes from the longest kept state whose tokens are a prefix of its prompt, that leaves at least one
prompt row to prefill, and whose cuts are exactly the cuts its own cold pass makes up to `at` (engine/cuts.py):
then every row it reads was computed by the same arithmetic a fresh run does, and resumed == fresh bitwise.

Bytes of the tier = distinct kept pages · page bytes + the copies; past `--prompt-cache-gib` the least recently
used states go. A restore happens within admission, so no state is ever in use when eviction runs: a resumed
stream holds the pages it shares through its own lease.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import attrs
import torch

from tensorfold.engine.cuts import plan_cuts
from tensorfold.engine.memory import Claim, StreamMemory
from tensorfold.kv import PagedStore
from tensorfold.pool.pages import PoolCorrupt


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@attrs.define(eq=False)
class KeptState:
    """A stream's state at `at`: the prompt prefix, the cold cuts up to `at`, shared full pages and copies."""

    tokens: tuple[int, ...]
    at: int
    cuts: tuple[int, ...]
    pages: tuple[int, ...]
    tail_start: int
    tail: tuple[tuple[int, str, torch.Tensor], ...] = attrs.field(repr=False)
    fixed: tuple[tuple[int, str, torch.Tensor], ...] = attrs.field(repr=False)
    hits: int = 0

    @property
    def copy_bytes(self) -> int:
        """Bytes of the tail and fixed copies (the pages are counted by the tier, once each)."""
        return sum(_nbytes(t) for _, _, t in self.tail) + sum(_nbytes(t) for _, _, t in self.fixed)


class DeviceTier:
    """Kept states over one StreamMemory, within `budget` bytes, least recently used evicted first."""

    def __init__(self, memory: StreamMemory, budget: int) -> None:
        if budget <= 0:
            raise ValueError(f"a prompt cache needs a budget above 0 bytes, got {budget}")
        self.memory = memory
        self.budget = budget
        self.page_rows = memory.pool.page_rows if memory.pool is not None else None
        self.page_bytes = memory.kv.page_bytes if isinstance(memory.kv, PagedStore) else 0
        self._states: OrderedDict[int, KeptState] = OrderedDict()
        self._ids = itertools.count()
        self.kept_total = 0
        self.evicted = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._states)

    @property
    def states(self) -> list[KeptState]:
        """Kept states, least recently used first."""
        return list(self._states.values())

    @property
    def nbytes(self) -> int:
        """Distinct kept pages · page bytes + every state's copies."""
        states = list(self._states.values())  # one C-level copy: /memory reads this from another thread
        pages = {p for state in states for p in state.pages}
        return len(pages) * self.page_bytes + sum(s.copy_bytes for s in states)

    # -- keeping ------------------------------------------------------------------------------------------------

    def has(self, tokens: tuple[int, ...], cuts: tuple[int, ...]) -> bool:
        """Whether this exact state is kept already (then it is marked used)."""
        for key, state in self._states.items():
            if state.at == len(tokens) and state.cuts == cuts and state.tokens == tokens:
                self._states.move_to_end(key)
                return True
        return False

    def snapshot(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...]) -> KeptState:
        """The state a slot holds at `len(tokens)`, which must be the end of its last step (a cut in `cuts`)."""
        at = len(tokens)
        kv = self.memory.kv
        if self.page_rows is not None and claim.lease is not None:
            full = at // self.page_rows
            pages = tuple(claim.lease.pages[:full])
            tail_start = full * self.page_rows
        else:
            pages, tail_start = (), 0
        tail = []
        for i, layer in enumerate(kv.layout.layers):
            for spec in layer.rows:
                entries = kv.rows(i, spec.name, claim.slot, at)[tail_start // spec.every:]
                tail.append((i, spec.name, entries.clone()))
        fixed = tuple((i, spec.name, kv.fixed(i, spec.name, claim.slot).clone())
                      for i, layer in enumerate(kv.layout.layers) for spec in layer.fixed)
        return KeptState(tokens=tokens, at=at, cuts=cuts, pages=pages, tail_start=tail_start, tail=tuple(tail),
                         fixed=fixed)

    def keep(self, state: KeptState) -> bool:
        """Hold a state; evicts the least recently used past the budget. False when it alone does not fit."""
        if self.page_rows is not None and len(state.pages) * self.page_bytes + state.copy_bytes > self.budget:
            return False
        if self.page_rows is None and state.copy_bytes > self.budget:
            return False
        if self.memory.pool is not None and state.pages:
            self.memory.pool.keep(state.pages)
        self._states[next(self._ids)] = state
        self.kept_total += 1
        while self.nbytes > self.budget:
            self.evict_one()
        return True

    def keep_from(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...]) -> bool:
        """Snapshot and keep the slot's state at `len(tokens)` unless that exact state is kept already."""
        if self.has(tokens, cuts):
            return False
        return self.keep(self.snapshot(claim, tokens, cuts))

    def evict_one(self, spare: KeptState | None = None) -> bool:
        """Drop the least recently used state (never `spare`); False when there is none to drop."""
        for key, state in self._states.items():
            if state is not spare:
                self._drop(key)
                return True
        return False

    def _drop(self, key: int) -> None:
        state = self._states.pop(key)
        if self.memory.pool is not None and state.pages:
            self.memory.pool.unkeep(state.pages)
        self.evicted += 1

    def clear(self) -> None:
        """Drop every state."""
        for key in list(self._states):
            self._drop(key)

    # -- resuming -----------------------------------------------------------------------------------------------

    def lookup(self, prompt: tuple[int, ...], starts: tuple[int, ...], grid: int, min_chunk: int) -> KeptState | None:
        """The longest kept state this prompt may resume from: its tokens a prefix of the prompt, at least one
        prompt row left, and its cuts the prompt's own cold cuts up to its `at`."""
        cuts = plan_cuts(len(prompt), starts, grid, min_chunk)
        best: tuple[int, KeptState] | None = None
        for key, state in self._states.items():
            if state.at >= len(prompt) or (best is not None and state.at <= best[1].at):
                continue
            if state.at not in cuts or tuple(c for c in cuts if c <= state.at) != state.cuts:
                continue
            if tuple(prompt[: state.at]) != state.tokens:
                continue
            best = (key, state)
        if best is None:
            return None
        self._states.move_to_end(best[0])
        return best[1]

    def restore(self, state: KeptState, claim: Claim) -> None:
        """Put a kept state into a fresh claim taken with `shared=state.pages`: fixed states copied into the slot,
        the tail copied into a fresh page of its own; the stream then runs on from `state.at`."""
        kv = self.memory.kv
        if claim.lease is not None and tuple(claim.lease.pages[: len(state.pages)]) != state.pages:
            raise ValueError("the claim does not start with the kept state's pages")
        for i, name, tensor in state.fixed:
            kv.fixed(i, name, claim.slot).copy_(tensor)
        self.memory.extend(claim, state.at)
        for i, name, tensor in state.tail:
            if tensor.shape[0]:
                kv.write_rows(i, name, claim.slot, state.tail_start, tensor)
        state.hits += 1
        self.hits += 1

    # -- accounting ---------------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The pool's kept holds are exactly the states' pages, and the tier is within its budget."""
        counted: dict[int, int] = {}
        for state in self._states.values():
            for page in state.pages:
                counted[page] = counted.get(page, 0) + 1
        pool = self.memory.pool
        held = pool.kept_holds() if pool is not None else {}
        if counted != held:
            raise PoolCorrupt(f"kept states hold {sum(counted.values())} page references, the pool counts "
                              f"{sum(held.values())}")
        if self.nbytes > self.budget:
            raise PoolCorrupt(f"the prompt cache holds {self.nbytes} bytes, over its budget of {self.budget}")

    def describe(self) -> dict[str, int]:
        """Numbers for /memory."""
        return {"prompt_cache_states": len(self), "prompt_cache_bytes": self.nbytes,
                "prompt_cache_budget": self.budget, "prompt_cache_hits": self.hits,
                "prompt_cache_evicted": self.evicted}
