"""The device tier: kept prompt states in the stream memory itself.

A state kept at `at` is what a stream held right after the prefill step that ended at `at` (a cut of its cold
pass), before any later step wrote more:

    pages   the full pages of rows [0, at // page_rows · page_rows), held by reference (PagePool.keep): the
            source stream only writes rows ≥ at, so these never change while it runs on
    tail    a copy of the rows of the partial last page, [full · page_rows, at): the source stream goes on
            writing that page, and so would a resumer; a resumer gets them copied into a fresh page of its own
    fixed   a copy of every fixed state of the slot

With one window per stream (TF_KV_PAGES=0) there are no pages: the tail is every row [0, at).

A request resumes from the longest state kept in its partition (tiers/policy.py) whose tokens are a prefix of its
prompt, that leaves at least one prompt row to prefill, and whose cuts are exactly the cuts its own cold pass makes
up to `at` (cuts.py): then every row it reads was computed by the same arithmetic a fresh run does, and
resumed == fresh bitwise.

Bytes of the tier = distinct kept pages · page bytes + the copies; past `--prompt-cache-gib` states go, moved-past
ones first, then the least recently used (tiers/policy.py), into the tier below (`lower`, the host tier) when there
is one, else dropped. A restore happens within admission, so no state is ever in use when eviction runs: a resumed
stream holds the pages it shares through its own lease. Two partitions keeping the same tokens keep two states,
each over its own stream's pages: isolation costs their memory.
"""

from __future__ import annotations

from tensorfold.cuts import plan_cuts
from tensorfold.kv import PagedStore
from tensorfold.memory import Claim, StreamMemory
from tensorfold.pool.pages import PoolCorrupt
from tensorfold.tiers.base import Lower, Tier
from tensorfold.tiers.lanes import Lane
from tensorfold.tiers.mirror import Adopt, Drop, Restore, Snap, new_key, slot_copies
from tensorfold.tiers.rates import DEVICE_BYTES_PER_S, Rate, TimedRestores
from tensorfold.tiers.states import Copies, KeptState


class DeviceTier(TimedRestores, Tier[KeptState]):
    """Kept states over one StreamMemory, within `budget` bytes; evicted ones move to `lower` when there is one."""

    name = "device"

    def __init__(self, memory: StreamMemory, budget: int, lower: Lower[KeptState] | None = None) -> None:
        if budget <= 0:
            raise ValueError(f"a prompt cache needs a budget above 0 bytes, got {budget}")
        super().__init__(budget)
        self.memory = memory
        self.lower = lower
        self.page_rows = memory.pool.page_rows if memory.pool is not None else None
        self.page_bytes = memory.kv.page_bytes if isinstance(memory.kv, PagedStore) else 0
        self.lane = Lane(memory.kv.device)
        self._timing(Rate(DEVICE_BYTES_PER_S.get(memory.kv.device.type, DEVICE_BYTES_PER_S["cpu"])))
        self.promoted = 0     # states taken in from the host tier after a host hit (chain.py)

    @property
    def nbytes(self) -> int:
        """Distinct kept pages · page bytes + every state's copies."""
        states = list(self._states.values())  # one C-level copy: /memory reads this from another thread
        pages = {p for state in states for p in state.pages}
        return len(pages) * self.page_bytes + sum(s.copy_bytes for s in states)

    # -- keeping ------------------------------------------------------------------------------------------------

    def has(self, tokens: tuple[int, ...], cuts: tuple[int, ...], partition: str = "") -> bool:
        """Whether this exact state is kept already in `partition` (then it is marked used)."""
        return self.find_exact(tokens, cuts, partition) is not None

    def snapshot(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...],
                 why: frozenset[str] = frozenset(), partition: str = "") -> KeptState:
        """The state a slot holds at `len(tokens)`, which must be the end of its last step (a cut in `cuts`), to
        be kept in `partition`."""
        at = len(tokens)
        kv = self.memory.kv
        if self.page_rows is not None and claim.lease is not None:
            full = at // self.page_rows
            pages = tuple(claim.lease.pages[:full])
            tail_start = full * self.page_rows
        else:
            pages, tail_start = (), 0
        tail, fixed = slot_copies(kv, claim.slot, at, tail_start)
        state = KeptState(tokens=tokens, at=at, cuts=cuts, pages=pages, tail_start=tail_start, tail=tail,
                          fixed=fixed, why=frozenset(why), partition=partition)
        if kv.journal is not None:
            state.key = new_key()
            kv.journal.append(Snap(state.key, claim.slot, at, pages, tail_start))
        return state

    def alone_bytes(self, state: KeptState) -> int:
        """Bytes a state holds on its own: its pages and its copies."""
        return len(state.pages) * self.page_bytes + state.copy_bytes

    def keep(self, state: KeptState) -> bool:
        """Hold a state; past the budget others go (moved past first, then least recently used, into the tier
        below when there is one). False, counted as refused, when it alone does not fit."""
        if self.alone_bytes(state) > self.budget:
            self.refused += 1
            if self.memory.kv.journal is not None:
                self.memory.kv.journal.append(Drop(state.key))
            return False
        if self.memory.pool is not None and state.pages:
            self.memory.pool.keep(state.pages)
        self._add(state)
        while self.nbytes > self.budget and self.evict_one(spare=state):
            pass
        return True

    def promotion_bytes(self, at: int) -> int:
        """Bytes a state at `at` promoted over a fresh claim's pages adds: its full pages, its tail and fixed copies
        (none of its pages is held by another state)."""
        layout = self.memory.kv.layout
        total = layout.stream_bytes(at)
        if self.page_rows is None:
            return total
        full = at // self.page_rows * self.page_rows
        in_pages = sum(spec.entries(full) * spec.entry_bytes for layer in layout.layers for spec in layer.rows)
        return total - in_pages + full // self.page_rows * self.page_bytes

    def has_room(self, at: int) -> bool:
        """Whether a state at `at` promoted from the host fits within the budget without letting any state go."""
        return self.nbytes + self.promotion_bytes(at) <= self.budget

    def adopt(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...], tail_start: int, tail: Copies,
              fixed: Copies, why: frozenset[str], passed: bool, partition: str) -> KeptState | None:
        """Keep a state a host restore just put into `claim` (promotion): its full pages by reference, its tail and
        fixed copies as given; never lets another state go (None, nothing kept, when it does not fit)."""
        at = len(tokens)
        pages = tuple(claim.lease.pages[: tail_start // self.page_rows]) if self.page_rows and claim.lease else ()
        state = KeptState(tokens=tokens, at=at, cuts=cuts, pages=pages, tail_start=tail_start, tail=tail,
                          fixed=fixed, why=why, passed=passed, partition=partition)
        if self.nbytes + self.alone_bytes(state) > self.budget:
            return None
        if self.memory.pool is not None and pages:
            self.memory.pool.keep(pages)
        self.promoted += 1
        if self.memory.kv.journal is not None:
            state.key = new_key()
            self.memory.kv.journal.append(Adopt(state.key, at, pages))
        return self._add(state)

    def keep_from(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...],
                  why: frozenset[str] = frozenset(), partition: str = "") -> bool:
        """Snapshot and keep the slot's state at `len(tokens)` in `partition` unless that exact state is kept
        there already."""
        if self.has(tokens, cuts, partition):
            return False
        return self.keep(self.snapshot(claim, tokens, cuts, why, partition))

    def evict_one(self, spare: object | None = None) -> bool:
        """Let one state go (never `spare`, the state being resumed or just kept): moved past first, then least
        recently used; it moves to the tier below when there is one. False when there is none to let go."""
        key = self._next_out(spare)
        if key is None:
            return False
        if self.lower is not None:
            self.lower.take(self._states[key], spare=spare)
        self._drop(key)
        self.evicted += 1
        return True

    def _drop(self, key: int) -> None:
        state = self._states.pop(key)
        if self.memory.pool is not None and state.pages:
            self.memory.pool.unkeep(state.pages)
        if self.memory.kv.journal is not None:
            self.memory.kv.journal.append(Drop(state.key))

    def clear(self) -> None:
        """Drop every state (nothing moves to the tier below)."""
        for key in list(self._states):
            self._drop(key)
            self.evicted += 1

    # -- resuming -----------------------------------------------------------------------------------------------

    def lookup(self, prompt: tuple[int, ...], starts: tuple[int, ...], grid: int, min_chunk: int,
               partition: str = "") -> KeptState | None:
        """The longest state kept in `partition` this prompt may resume from: its tokens a prefix of the prompt, at
        least one prompt row left, and its cuts the prompt's own cold cuts up to its `at`; a miss is counted."""
        found = self.find(prompt, plan_cuts(len(prompt), starts, grid, min_chunk), partition)
        if found is None:
            self.misses += 1
        return found

    def restore(self, state: KeptState, claim: Claim) -> None:
        """Put a kept state into a fresh claim taken with `shared=state.pages`: fixed states copied into the slot,
        the tail copied into a fresh page of its own; the stream then runs on from `state.at`."""
        kv = self.memory.kv
        if claim.lease is not None and tuple(claim.lease.pages[: len(state.pages)]) != state.pages:
            raise ValueError("the claim does not start with the kept state's pages")
        self._harvest()
        timer = self.lane.timer(compute=True)
        for i, name, tensor in state.fixed:
            kv.write_fixed(i, name, claim.slot, tensor)
        self.memory.extend(claim, state.at)
        for i, name, tensor in state.tail:
            if tensor.shape[0]:
                kv.write_rows(i, name, claim.slot, state.tail_start, tensor)
        if kv.journal is not None:
            kv.journal.append(Restore(state.key, claim.slot))
        timer.stop()
        self._timed_restore(timer, state.copy_bytes)
        self._served(state)

    def restore_bytes(self, state: KeptState) -> int:
        """Bytes a restore of `state` copies: its tail and fixed copies (its full pages are shared)."""
        return state.copy_bytes

    # -- accounting ---------------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The pool's kept holds are exactly the states' pages, every state's pages and copies cover exactly its
        rows, and the tier is within its budget."""
        counted: dict[int, int] = {}
        layers = self.memory.kv.layout.layers
        for state in self._states.values():
            for page in state.pages:
                counted[page] = counted.get(page, 0) + 1
            if state.tail_start != len(state.pages) * (self.page_rows or 0) or state.at != len(state.tokens):
                raise PoolCorrupt(f"a state kept at {state.at} holds {len(state.pages)} pages from row "
                                  f"{state.tail_start}")
            for i, name, tensor in state.fixed:
                held = self.memory.kv.fixed_states(i, name)
                if (tuple(tensor.shape), tensor.dtype) != (tuple(held.shape[1:]), held.dtype):
                    raise PoolCorrupt(f"a state kept at {state.at} copies fixed {i} {name!r} as "
                                      f"{tuple(tensor.shape)} {tensor.dtype}, the Layout declares "
                                      f"{tuple(held.shape[1:])} {held.dtype}")
            for i, name, tensor in state.tail:
                every = next(s.every for s in layers[i].rows if s.name == name)
                if tensor.shape[0] != state.at // every - state.tail_start // every:
                    raise PoolCorrupt(f"a state kept at {state.at} copies {tensor.shape[0]} entries of layer {i} "
                                      f"{name!r} from row {state.tail_start}")
        pool = self.memory.pool
        held = pool.kept_holds() if pool is not None else {}
        if counted != held:
            raise PoolCorrupt(f"kept states hold {sum(counted.values())} page references, the pool counts "
                              f"{sum(held.values())}")
        if self.nbytes > self.budget:
            raise PoolCorrupt(f"the prompt cache holds {self.nbytes} bytes, over its budget of {self.budget}")

    def describe(self) -> dict[str, int]:
        """Numbers for /memory."""
        self._harvest()
        return {"prompt_cache_states": len(self), "prompt_cache_bytes": self.nbytes,
                "prompt_cache_budget": self.budget, "prompt_cache_hits": self.hits,
                "prompt_cache_evicted": self.evicted, "prompt_cache_promoted": self.promoted,
                "prompt_cache_restored_bytes": self.restored_bytes,
                "prompt_cache_restore_seconds": round(self.restore_seconds, 6),
                "prompt_cache_restore_bytes_per_s": round(self.rate.value)}
