"""Admission and step building: who runs, and which rows each running stream feeds this step.

    each step:  every decoding stream feeds 1 row;
                prefilling streams, oldest first, feed their next chunk [p, next cut) while the step's rows
                stay within one chunk's worth (the oldest prefilling stream always gets its chunk, so every
                stream progresses); the cuts are planned once at admission, plan_cuts(prompt, starts, chunk,
                min_chunk) (engine/cuts.py): the absolute grid when the request has no starts
    admission:  with a prompt cache (tiers/device.py), a request resumes from the longest kept state it may
                (its lease shares the state's full pages); when its lease does not fit, kept states are evicted,
                least recently used first, before it waits
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from typing import TYPE_CHECKING

from tensorfold.engine.api import Request
from tensorfold.engine.cuts import plan_cuts, usable_starts
from tensorfold.engine.memory import StreamMemory
from tensorfold.engine.sampler import Sampler
from tensorfold.engine.stream import Stream
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.settings import DEFAULT_MIN_CHUNK

if TYPE_CHECKING:
    from tensorfold.tiers.device import DeviceTier


class Scheduler:
    """Bookkeeping only: it never touches tensors beyond binding page tables through StreamMemory."""

    def __init__(self, memory: StreamMemory, context: int, prefill_chunk: int,
                 min_chunk: int = DEFAULT_MIN_CHUNK, tier: DeviceTier | None = None) -> None:
        self.memory = memory
        self.tier = tier
        self.context = context
        self.prefill_chunk = prefill_chunk
        self.min_chunk = min_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Stream] = []

    def reach(self, request: Request) -> int:
        """Rows a request can reach: prompt + max_tokens, capped by the context."""
        return min(len(request.prompt) + request.sampling.max_tokens, self.context)

    def admit(self) -> list[Stream]:
        """Admit waiting requests in order while a slot and their lease fit; the first that does not, waits."""
        admitted = []
        while self.waiting and self.memory.slots.free > 0:
            request = self.waiting[0]
            reach = self.reach(request)
            kept = None
            if self.tier is not None:
                kept = self.tier.lookup(request.prompt, request.starts, self.prefill_chunk, self.min_chunk)
            shared = kept.pages if kept is not None else ()
            if not self.memory.fits(reach, len(shared)) and self._evicting_helps(reach, len(shared)):
                while not self.memory.fits(reach, len(shared)) and self.tier.evict_one(kept):
                    pass
            if not self.memory.fits(reach, len(shared)):
                break
            self.waiting.popleft()
            claim = self.memory.take(request.id, reach, shared)
            cuts = plan_cuts(len(request.prompt), request.starts, self.prefill_chunk, self.min_chunk)
            stream = Stream(request, claim, Sampler(request.sampling), cuts=cuts)
            if kept is not None:
                self.tier.restore(kept, claim)
                stream.position = stream.cached = kept.at
            if self.tier is not None:
                points = set(usable_starts(len(request.prompt), request.starts)) | {len(request.prompt)}
                stream.keep_at = frozenset(c for c in cuts if c in points and c > stream.position)
            self.running.append(stream)
            admitted.append(stream)
        return admitted

    def _evicting_helps(self, rows: int, shared: int) -> bool:
        """Whether the pages kept states alone hold would let a lease of `rows` rows fit (else it waits for
        running streams, and the kept states stay)."""
        pool = self.memory.pool
        if self.tier is None or pool is None:
            return False
        return pool.pages_for(rows) - shared <= pool.available + pool.kept

    def kept(self, stream: Stream, end: int) -> None:
        """After a step that ended a prefill share at `end`: keep the stream's state there if it is a keep point."""
        if self.tier is None or end not in stream.keep_at:
            return
        self.tier.keep_from(stream.claim, stream.request.prompt[:end], tuple(c for c in stream.cuts if c <= end))

    def plan(self) -> tuple[StepPlan, list[Stream]] | None:
        """The next step and the streams in it, in plan order; None when nothing runs."""
        shares: list[tuple[Stream, StreamStep]] = []
        rows = 0
        for stream in self.running:
            if not stream.prefilling:
                shares.append((stream, self._decode_share(stream)))
                rows += 1
        first = True
        for stream in self.running:
            if stream.prefilling:
                share = self._prefill_share(stream)
                if not first and rows + len(share.tokens) > self.prefill_chunk:
                    continue
                shares.append((stream, share))
                rows += len(share.tokens)
                first = False
        if not shares:
            return None
        for stream, share in shares:
            self.memory.extend(stream.claim, share.end)
        return StepPlan(tuple(share for _, share in shares)), [stream for stream, _ in shares]

    def finish(self, stream: Stream) -> None:
        """Take a stream out and return everything it holds."""
        self.running.remove(stream)
        self.memory.release(stream.claim)

    def _decode_share(self, stream: Stream) -> StreamStep:
        assert stream.pending is not None
        return StreamStep(stream.claim.slot, stream.position, (stream.pending,), sample=True)

    def _prefill_share(self, stream: Stream) -> StreamStep:
        start = stream.position
        end = stream.cuts[bisect_right(stream.cuts, start)]
        tokens = stream.request.prompt[start:end]
        return StreamStep(stream.claim.slot, start, tokens, sample=end == stream.prompt_len)
