"""The host tier: kept prompt states in host memory, below the device tier (`--host-cache-gib`).

A host state is a whole copy of a state at `at`: every row state's entries for rows [0, at) and every fixed
state, in host memory — pinned when the store is on CUDA, so copies run asynchronously; ordinary memory on the
CPU. It holds no page of the pool and shares nothing with other states.

    in    a state the device tier lets go: its shared pages' rows and its copies, copied here; or a slot's state
          itself when there is no device tier or the device tier refused it
    out   a hit is copied into a fresh claim at admission, before the stream's first step, in pieces of at least
          `piece_bytes` (2 MiB): on CUDA an asynchronous copy from pinned memory per piece, then its scatter into
          the claim's pages, with one synchronisation before the step (`ready`); on the CPU plain copies

Bytes = Σ states (Σ row states entries(at) · entry bytes + fixed bytes). Past the budget states go, moved-past
ones first, then the least recently used (tiers/policy.py), never the state being resumed; a state larger than
the budget is refused and counted. States let go move to the disk tier when there is one (tiers/disk.py).
"""

from __future__ import annotations

import torch

from tensorfold.kv import PagedStore
from tensorfold.layout import DTYPES, RowState
from tensorfold.memory import Claim, StreamMemory
from tensorfold.pool.pages import PoolCorrupt
from tensorfold.tiers.base import Lower, Tier
from tensorfold.tiers.states import Copies, HostState, KeptState

PIECE_BYTES = 2 * 2**20  # the smallest host → device copy: fewer, larger transfers run near the link's speed


class HostTier(Tier[HostState]):
    """Host copies of kept states for one StreamMemory, within `budget` bytes."""

    name = "host"

    def __init__(self, memory: StreamMemory, budget: int, pin: bool | None = None,
                 piece_bytes: int = PIECE_BYTES) -> None:
        if budget <= 0:
            raise ValueError(f"a host tier needs a budget above 0 bytes, got {budget}")
        if piece_bytes < 1:
            raise ValueError(f"copy pieces need at least 1 byte, got {piece_bytes}")
        super().__init__(budget)
        self.memory = memory
        self.cuda = memory.kv.device.type == "cuda"
        self.pin = self.cuda if pin is None else pin
        self.piece_bytes = piece_bytes
        self.lower: Lower[HostState] | None = None  # where states let go are written (tiers/chain.py sets it)
        layout = memory.kv.layout
        self._specs: dict[tuple[int, str], RowState] = {
            (i, s.name): s for i, layer in enumerate(layout.layers) for s in layer.rows}
        self._bytes = 0
        self._pending = False

    @property
    def nbytes(self) -> int:
        """Bytes every state's copies hold (a running count, so other threads may read it)."""
        return self._bytes

    def state_bytes(self, at: int) -> int:
        """Bytes a state at `at` takes here: Σ row states entries(at) · entry bytes + fixed bytes."""
        return self.memory.kv.layout.stream_bytes(at)

    # -- taking states in ---------------------------------------------------------------------------------------

    def take(self, state: KeptState, spare: object | None = None) -> bool:
        """Copy a device state here (its pages' rows and its copies) as the device tier lets it go; False,
        counted as refused, when there is no room for it (never making room by evicting `spare`)."""
        if not self._room(self.state_bytes(state.at), spare):
            return False
        kv = self.memory.kv
        index = torch.tensor(state.pages, dtype=torch.long, device=kv.device) if state.pages else None
        rows = []
        for i, name, tail in state.tail:
            spec = self._specs[i, name]
            host = self._empty((spec.entries(state.at), *spec.shape), DTYPES[spec.dtype])
            full = state.tail_start // spec.every
            if index is not None:
                pages = kv.row_pages(i, name)[index]
                host[:full].copy_(pages.reshape(-1, *spec.shape), non_blocking=self.pin)
            host[full:].copy_(tail, non_blocking=self.pin)
            rows.append((i, name, host))
        self._insert(HostState(tokens=state.tokens, at=state.at, cuts=state.cuts, rows=tuple(rows),
                               fixed=self._copies(state.fixed), why=state.why, passed=state.passed,
                               partition=state.partition))
        return True

    def keep_from(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...],
                  why: frozenset[str] = frozenset(), spare: object | None = None,
                  partition: str = "") -> HostState | None:
        """Copy the state a slot holds at `len(tokens)` (the end of its last step) here, kept in `partition`; None
        when refused."""
        at = len(tokens)
        if not self._room(self.state_bytes(at), spare):
            return None
        kv = self.memory.kv
        rows = self._copies((i, name, kv.rows(i, name, claim.slot, at)) for i, name in self._specs)
        fixed = self._copies((i, s.name, kv.fixed(i, s.name, claim.slot))
                             for i, layer in enumerate(kv.layout.layers) for s in layer.fixed)
        return self._insert(HostState(tokens=tokens, at=at, cuts=cuts, rows=rows, fixed=fixed, why=frozenset(why),
                                      partition=partition))

    def _room(self, need: int, spare: object | None) -> bool:
        """Make room for `need` bytes; False, counted as refused, when the budget cannot hold them."""
        if need > self.budget:
            self.refused += 1
            return False
        while self._bytes + need > self.budget:
            if not self.evict_one(spare):
                self.refused += 1
                return False
        return True

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    def _copies(self, tensors) -> Copies:
        out = []
        for i, name, tensor in tensors:
            host = self._empty(tuple(tensor.shape), tensor.dtype)
            host.copy_(tensor, non_blocking=self.pin)
            out.append((i, name, host))
        return tuple(out)

    def _insert(self, state: HostState) -> HostState:
        if self.cuda:
            torch.cuda.synchronize(self.memory.kv.device)  # the copies out of device memory have landed
        self._add(state)
        self._bytes += state.nbytes
        return state

    # -- letting states go --------------------------------------------------------------------------------------

    def evict_one(self, spare: object | None = None) -> bool:
        """Let one state go (never `spare`): moved past first, then least recently used, into the disk tier when
        there is one, else dropped. False when none may go."""
        key = self._next_out(spare)
        if key is None:
            return False
        if self.lower is not None:
            self.lower.take(self._states[key])
        self._drop(key)
        return True

    def _drop(self, key: int) -> None:
        state = self._states.pop(key)
        self._bytes -= state.nbytes
        self.evicted += 1

    def clear(self) -> None:
        """Drop every state."""
        for key in list(self._states):
            self._drop(key)

    # -- resuming -----------------------------------------------------------------------------------------------

    def restore(self, state: HostState, claim: Claim) -> None:
        """Copy a state into a fresh claim (no shared pages): fixed states into its slot, rows [0, at) into its
        pages in pieces; on CUDA the copies are asynchronous until `ready`."""
        kv = self.memory.kv
        if claim.lease is not None and claim.lease.pages:
            raise ValueError("a host state is restored into a claim that shares no pages")
        for i, name, host in state.fixed:
            kv.write_fixed(i, name, claim.slot, host, non_blocking=self.pin)
        self.memory.extend(claim, state.at)
        for i, name, host in state.rows:
            spec = self._specs[i, name]
            step = max(1, -(-self.piece_bytes // spec.entry_bytes))
            for first in range(0, host.shape[0], step):
                piece = host[first: first + step]
                if self.cuda:
                    piece = piece.to(kv.device, non_blocking=self.pin)
                self._write(claim, i, name, spec, first, piece)
        self._pending = self._pending or self.cuda
        self._served(state)

    def _write(self, claim: Claim, layer: int, name: str, spec: RowState, first: int, values: torch.Tensor) -> None:
        """Entries [first, first + len(values)) into the claim's rows; with pages, scattered by indices made on
        the host, so no copy waits on the device."""
        kv = self.memory.kv
        if not isinstance(kv, PagedStore) or claim.lease is None:
            kv.write_rows(layer, name, claim.slot, first * spec.every, values)
            return
        per_page = kv.page_rows // spec.every
        entry = torch.arange(first, first + values.shape[0])
        if (first + values.shape[0] - 1) // per_page >= len(claim.lease.pages):
            raise IndexError(f"a restore writes {name!r} entry {first + values.shape[0] - 1}; the claim's "
                             f"{len(claim.lease.pages)} pages hold {len(claim.lease.pages) * per_page}")
        pages = torch.tensor(claim.lease.pages, dtype=torch.long)[entry // per_page]
        kv.row_pages(layer, name)[pages.to(kv.device), (entry % per_page).to(kv.device)] = values

    def ready(self) -> None:
        """Wait once for the restores' asynchronous copies, before the step that reads them."""
        if self._pending:
            torch.cuda.synchronize(self.memory.kv.device)
            self._pending = False

    # -- accounting ---------------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Every state holds exactly its rows' entries and the fixed states, the byte count adds up, and the tier
        is within its budget; or raise with the numbers."""
        layout = self.memory.kv.layout
        fixed = {(i, s.name): s for i, layer in enumerate(layout.layers) for s in layer.fixed}
        total = 0
        for state in list(self._states.values()):
            if {(i, n) for i, n, _ in state.rows} != set(self._specs) or {(i, n) for i, n, _ in state.fixed} != set(
                    fixed):
                raise PoolCorrupt(f"a host state at {state.at} does not hold every declared state")
            for i, name, tensor in state.rows:
                spec = self._specs[i, name]
                if tuple(tensor.shape) != (spec.entries(state.at), *spec.shape) or tensor.device.type != "cpu":
                    raise PoolCorrupt(f"a host state at {state.at} holds layer {i} {name!r} as {tuple(tensor.shape)} "
                                      f"on {tensor.device}")
            for i, name, tensor in state.fixed:
                spec = fixed[i, name]
                declared = (spec.shape, DTYPES[spec.dtype])
                if (tuple(tensor.shape), tensor.dtype) != declared or tensor.device.type != "cpu":
                    raise PoolCorrupt(f"a host state at {state.at} holds fixed {i} {name!r} as {tuple(tensor.shape)} "
                                      f"{tensor.dtype}, the Layout declares {spec.shape} {DTYPES[spec.dtype]}")
            if state.nbytes != self.state_bytes(state.at) or state.at != len(state.tokens):
                raise PoolCorrupt(f"a host state at {state.at} holds {state.nbytes} bytes, its rows need "
                                  f"{self.state_bytes(state.at)}")
            total += state.nbytes
        if total != self._bytes:
            raise PoolCorrupt(f"host states hold {total} bytes, the tier counts {self._bytes}")
        if total > self.budget:
            raise PoolCorrupt(f"the host tier holds {total} bytes, over its budget of {self.budget}")

    def describe(self) -> dict[str, int | bool]:
        """Numbers for /memory."""
        return {"host_cache_states": len(self), "host_cache_bytes": self.nbytes, "host_cache_budget": self.budget,
                "host_cache_hits": self.hits, "host_cache_evicted": self.evicted, "host_cache_pinned": self.pin}
