"""The host tier: kept prompt states in host memory, below the device tier (`--host-cache-gib`).

A host state is a whole copy of a state at `at`: every row state's entries for rows [0, at) and every fixed
state, in host memory carved from the tier's arena (tiers/arena.py): slabs pinned when the store is on CUDA, so
copies run asynchronously, reserved at startup (up to HOST_RESERVE_BYTES of the budget) and grown ahead on a thread
of their own, so keeping, restoring and dropping a state allocate and free no host memory; ordinary memory on the
CPU. It holds no page of the pool and shares nothing with other states.

    in    a state the device tier lets go: its shared pages' rows and its copies; or a slot's state itself when
          there is no device tier or the device tier refused it. Copied out through the tier's Lane
          (tiers/lanes.py): per layer, its pages gathered in pieces of up to `piece_bytes` on the copy stream and
          copied into the state's memory asynchronously, its fixed states straight from the slot; each layer's
          end marked by an event that the compute stream waits on before it next touches that layer (so the step
          after a keep never overwrites what is still being copied out), the last one the state's `landed`, which
          a reader on the host (the disk's I/O thread) waits for. The host never waits
    out   a hit is copied into a fresh claim at admission, layer by layer, through the same Lane: per row state,
          its full pages in pieces of up to `piece_bytes` (64 MiB), each one asynchronous copy from pinned memory
          into a device buffer on the copy stream, then one index_copy_ of its pages into the claim's pages there;
          the last partial page copied into place; each layer's end marked by an event that the compute stream
          waits on at the step's first access to that layer (kv/base.py), so neither the host nor the step waits
          for more than the layer it reads. The state's memory is fenced with the last event: dropped meanwhile,
          it is carved again only once the copies have read it. On the CPU the same code runs as plain copies.
          With `promote`, the tail and fixed copies a device state needs are cloned on the device from the claim
          once restored there (chain.py moves the state up to the device tier when it has room)

Bytes = Σ states (Σ row states entries(at) · entry bytes + fixed bytes). Past the budget states go, moved-past
ones first, then the least recently used (tiers/policy.py), never the state being resumed; a state larger than
the budget is refused and counted. States let go move to the disk tier when there is one (tiers/disk.py).
"""

from __future__ import annotations

from tensorfold.kv import PagedStore
from tensorfold.layout import DTYPES, RowState
from tensorfold.memory import Claim, StreamMemory
from tensorfold.pool.pages import PoolCorrupt
from tensorfold.tiers.arena import HostArena
from tensorfold.tiers.base import Lower, Tier
from tensorfold.tiers.copy_out import CopiedOut, kept_out, slot_out
from tensorfold.tiers.host_restore import Promoted, restore_host
from tensorfold.tiers.lanes import Lane
from tensorfold.tiers.mirror import Drop, HostKeep, HostRestore, HostSetup, ToHost, new_key
from tensorfold.tiers.rates import HOST_BYTES_PER_S, Rate, TimedRestores
from tensorfold.tiers.states import HostState, KeptState

PIECE_BYTES = 64 * 2**20        # the largest copy between host and device (its device buffer): large copies run at
                                # the link's speed
HOST_RESERVE_BYTES = 4 * 2**30  # host memory carved ready at startup (within the budget, pinned on CUDA)


class HostTier(TimedRestores, Tier[HostState]):
    """Host copies of kept states for one StreamMemory, within `budget` bytes."""

    name = "host"

    def __init__(self, memory: StreamMemory, budget: int, pin: bool | None = None,
                 piece_bytes: int = PIECE_BYTES, reserve: int = HOST_RESERVE_BYTES) -> None:
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
        self.arena = HostArena(self.pin, limit=budget + budget // 4)   # a quarter more: room for its free runs
        if self.pin:
            self.arena.reserve(min(budget, reserve))
        if memory.kv.journal is not None:
            memory.kv.journal.append(HostSetup(budget, piece_bytes, reserve))
        self.lane = Lane(memory.kv.device)
        self._timing(Rate(HOST_BYTES_PER_S.get(memory.kv.device.type, HOST_BYTES_PER_S["cpu"])))

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
        counted as refused, when there is no room for it (never making room by evicting `spare`). The copies run
        on the lane; the host never waits for them (module docstring)."""
        if not self._room(self.state_bytes(state.at), spare):
            return False
        out = kept_out(self.memory.kv, self.lane, self.arena, state, self.piece_bytes)
        held = self._insert(HostState(tokens=state.tokens, at=state.at, cuts=state.cuts, rows=out.rows,
                                      fixed=out.fixed, why=state.why, passed=state.passed,
                                      partition=state.partition), out, None)
        journal = self.memory.kv.journal
        if journal is not None:
            held.key = new_key()
            journal.append(ToHost(state.key, held.key))
        return True

    def keep_from(self, claim: Claim, tokens: tuple[int, ...], cuts: tuple[int, ...],
                  why: frozenset[str] = frozenset(), spare: object | None = None,
                  partition: str = "") -> HostState | None:
        """Copy the state a slot holds at `len(tokens)` (the end of its last step) here, kept in `partition`; None
        when refused. The copies run on the lane; the host never waits for them (module docstring)."""
        at = len(tokens)
        if not self._room(self.state_bytes(at), spare):
            return None
        out = slot_out(self.memory.kv, self.lane, self.arena, claim, at, self.piece_bytes)
        held = self._insert(HostState(tokens=tokens, at=at, cuts=cuts, rows=out.rows, fixed=out.fixed,
                                      why=frozenset(why), partition=partition), out, claim.slot)
        journal = self.memory.kv.journal
        if journal is not None:
            held.key = new_key()
            pages = tuple(claim.lease.pages) if isinstance(self.memory.kv, PagedStore) and claim.lease else None
            journal.append(HostKeep(held.key, claim.slot, at, pages))
        return held

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

    def _insert(self, state: HostState, out: CopiedOut, slot: int | None) -> HostState:
        """Hold a state whose copies out of the device are queued (copy_out.py: the store's reader waits for them
        per layer, the arena for the last, which is the state's `landed`)."""
        state.landed = out.publish(self.memory.kv, self.arena, slot)
        self._add(state)
        self._bytes += state.nbytes
        if self.pin:
            self.arena.ahead(state.nbytes)    # room for one more like it, grown off the engine's thread
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
        if self.memory.kv.journal is not None:
            self.memory.kv.journal.append(Drop(state.key))

    def clear(self) -> None:
        """Drop every state."""
        for key in list(self._states):
            self._drop(key)

    # -- resuming -----------------------------------------------------------------------------------------------

    def restore(self, state: HostState, claim: Claim, promote: int | None = None) -> Promoted | None:
        """Copy a state into a fresh claim (no shared pages): per layer, its fixed states into the slot and its
        rows [0, at) into the claim's pages, on the lane (module docstring). With `promote` (the device tier's
        page rows, 0 without pages) also the device copies of the tail from the last full page on and of the fixed
        states, which a device state over the claim's pages needs: cloned from the claim on the device."""
        kv = self.memory.kv
        if claim.lease is not None and claim.lease.pages:
            raise ValueError("a host state is restored into a claim that shares no pages")
        self.memory.extend(claim, state.at)
        pages = claim.lease.pages if isinstance(kv, PagedStore) and claim.lease is not None else None
        self._harvest()
        if kv.journal is not None:
            kv.journal.append(HostRestore(state.key, claim.slot, tuple(pages) if pages is not None else None,
                                          promote))
        made, timer = restore_host(kv, self.lane, self.arena, state, claim.slot, pages, promote, self.piece_bytes,
                                   self.pin)
        self._timed_restore(timer, state.nbytes)
        self._served(state)
        return made

    def restore_bytes(self, state: HostState) -> int:
        """Bytes a restore of `state` copies: all of it."""
        return state.nbytes

    def forget(self, state: HostState) -> bool:
        """Drop `state` (moved up to the device tier: chain.py), counted as evicted; False when not held."""
        key = next((k for k, s in self._states.items() if s is state), None)
        if key is None:
            return False
        self._drop(key)
        return True

    def ready(self) -> None:
        """Nothing to wait for on the host: the compute stream waits for each layer's copies (kv/base.py)."""

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
        self._harvest()
        return {"host_cache_states": len(self), "host_cache_bytes": self.nbytes, "host_cache_budget": self.budget,
                "host_cache_hits": self.hits, "host_cache_evicted": self.evicted, "host_cache_pinned": self.pin,
                "host_restored_bytes": self.restored_bytes, "host_restore_seconds": round(self.restore_seconds, 6),
                "host_restore_bytes_per_s": round(self.rate.value),
                **{f"host_arena_{k}": v for k, v in self.arena.describe().items()}}

