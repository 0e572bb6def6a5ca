"""What every tier of kept states shares: its states in use order, its counters, which state a request resumes
from, which state goes next, its TierStats, and the tier below it as an interface. Each tier (tiers/device.py,
tiers/host.py) adds how a state is held, its bytes, how it is restored and its checks; no tier imports another, the
chain (tiers/chain.py) wires each to the one below."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from tensorfold.tiers.policy import Marked, eviction_order, resumable
from tensorfold.tiers.stats import TierStats


class Kept(Marked, Protocol):
    """What a tier reads of its states: the policy's marks and the resumes each served."""

    hits: int


S = TypeVar("S", bound=Kept)
Held = TypeVar("Held", contravariant=True)


class Lower(Protocol[Held]):
    """Where a tier lets its states go: the tier below it (the host tier, the disk tier, or the host tier then the
    disk tier), set by tiers/chain.py."""

    def take(self, state: Held, spare: object | None = None) -> bool:
        """Hold a state the tier above lets go, never making room by letting `spare` go; False when refused."""
        ...


class Tier(Generic[S]):
    """States keyed in use order (least recently used first) within `budget` bytes, and the counters since startup
    that /memory, /metrics and the tests read."""

    name: str

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._states: OrderedDict[int, S] = OrderedDict()
        self._ids = itertools.count()
        self.kept_total = 0
        self.evicted = 0
        self.hits = 0
        self.misses = 0
        self.refused = 0
        self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._states)

    @property
    def states(self) -> list[S]:
        """Kept states, least recently used first."""
        return list(self._states.values())

    @property
    def nbytes(self) -> int:
        """Bytes the tier holds now (each tier counts its own way)."""
        raise NotImplementedError

    def _add(self, state: S) -> S:
        """Hold `state` as the most recently used, counted as kept."""
        self._states[next(self._ids)] = state
        self.kept_total += 1
        return state

    def _next_out(self, spare: object | None) -> int | None:
        """The key of the state that goes next (never `spare`): moved past first, then least recently used; None
        when none may go."""
        order = eviction_order(self._states.values(), spare)
        if not order:
            return None
        return next(k for k, s in self._states.items() if s is order[0])

    def find_exact(self, tokens: tuple[int, ...], cuts: tuple[int, ...], partition: str = "") -> S | None:
        """This exact state of `partition`, if kept (then it is marked used)."""
        for key, state in self._states.items():
            if (state.at == len(tokens) and state.partition == partition and state.cuts == cuts
                    and state.tokens == tokens):
                self._states.move_to_end(key)
                return state
        return None

    def find(self, prompt: tuple[int, ...], cuts: tuple[int, ...], partition: str = "") -> S | None:
        """The longest state kept in `partition` a pass over `prompt` cut at `cuts` may resume from
        (tiers/policy.py), marked used; counts nothing (the caller counts hits and misses once a request is
        admitted)."""
        best: tuple[int, S] | None = None
        for key, state in self._states.items():
            if (best is None or state.at > best[1].at) and resumable(state, prompt, cuts, partition):
                best = (key, state)
        if best is None:
            return None
        self._states.move_to_end(best[0])
        return best[1]

    def candidates(self, prompt: tuple[int, ...], cuts: tuple[int, ...], partition: str = "") -> list[S]:
        """Every state kept in `partition` a pass over `prompt` cut at `cuts` may resume from (tiers/policy.py),
        longest first; marks nothing used."""
        found = [state for state in self._states.values() if resumable(state, prompt, cuts, partition)]
        return sorted(found, key=lambda state: -state.at)

    def touch(self, state: S) -> None:
        """Mark `state` as the most recently used (the one a request resumes from)."""
        for key, held in self._states.items():
            if held is state:
                self._states.move_to_end(key)
                return

    def _served(self, state: S) -> None:
        """Count a resume from `state`: a hit for it and the tier, its rows as cached tokens."""
        state.hits += 1
        self.hits += 1
        self.cached_tokens += state.at

    def stats(self) -> TierStats:
        """Counters and use now (read from other threads: numbers may be a step old)."""
        return TierStats(tier=self.name, states=len(self), bytes=self.nbytes, budget=self.budget,
                         kept=self.kept_total, hits=self.hits, misses=self.misses, evicted=self.evicted,
                         refused=self.refused, cached_tokens=self.cached_tokens)
