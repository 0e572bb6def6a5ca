"""Admission and step building: who runs, and which rows each running stream feeds this step.

    each step:  every decoding stream feeds 1 row;
                prefilling streams, oldest first, feed their next chunk [p, next cut) while the step's rows
                stay within step_rows (--max-step-rows; the oldest prefilling stream always gets its chunk, so
                every stream progresses); the cuts are planned once at admission, plan_cuts(prompt, starts, chunk,
                min_chunk) (cuts.py): every request start and the grid from the last cut; the absolute grid when
                the request has no starts
    admission:  with kept tiers (tiers/chain.py), a request resumes from the longest kept state any tier holds
                that it may resume from (a device state's full pages are shared by its lease; a host state is
                copied in; a disk state is read and put back, or, failing its check, the request prefills); when
                its lease does not fit, device states are let go (into the host tier), moved-past ones first, then
                the least recently used, never the one it resumes from, before it waits
    keeping:    a prefilling stream's state is kept after the steps that end at its keep points: the last cut at
                or before its history end and rewind mark, always, and its system end when at least min_chunk
                past the row it started at (tiers/policy.py)
    partitions: a request looks up and keeps states in its own partition only (Request.partition)
    prompt logprobs: a request that asks for them (Sampling.prompt_logprobs) prefills its whole prompt, every row's
                logits returned (StreamStep.every_row); it still keeps its states for others
"""

from __future__ import annotations

import logging
import random
from bisect import bisect_right
from collections import deque
from typing import TYPE_CHECKING

from tensorfold.cuts import plan_cuts
from tensorfold.engine.api import Request
from tensorfold.engine.forks import release, reserve
from tensorfold.engine.sampler import SampleRow
from tensorfold.engine.stream import Stream
from tensorfold.memory import StreamMemory
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.settings import DEFAULT_MIN_CHUNK
from tensorfold.tiers.chain import Hit, KeptTiers
from tensorfold.tiers.policy import keep_points

if TYPE_CHECKING:
    from tensorfold.tiers.device import DeviceTier
    from tensorfold.tiers.disk import DiskTier
    from tensorfold.tiers.host import HostTier

log = logging.getLogger(__name__)


class Scheduler:
    """Bookkeeping only: it never touches tensors beyond binding page tables through StreamMemory."""

    def __init__(self, memory: StreamMemory, context: int, prefill_chunk: int,
                 min_chunk: int = DEFAULT_MIN_CHUNK, tier: DeviceTier | None = None,
                 host: HostTier | None = None, disk: DiskTier | None = None, seed: int | None = None,
                 step_rows: int | None = None) -> None:
        self.memory = memory
        self.unseeded = random.Random(seed) if seed is not None else None  # seeds of requests that give none
        self.tier = tier
        self.host = host
        self.disk = disk
        kept = tier is not None or host is not None or disk is not None
        self.tiers = KeptTiers(tier, host, disk) if kept else None
        self.context = context
        self.prefill_chunk = prefill_chunk
        self.step_rows = prefill_chunk if step_rows is None else step_rows  # a step's rows past its first chunk
        self.min_chunk = min_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Stream] = []
        self.failed: list[tuple[Request, Exception]] = []  # admissions that raised, for the engine to fail

    def reach(self, request: Request) -> int:
        """Rows a request can reach: prompt + max_tokens, capped by the context."""
        return min(len(request.prompt) + request.sampling.max_tokens, self.context)

    def admit(self) -> list[Stream]:
        """Admit waiting requests in order while a slot and their lease fit; the first that does not, waits. A
        request whose admission raises (a tier's lookup or restore) leaves the queue holding nothing and goes to
        `failed` with its error, for the engine to fail; the requests after it are admitted as usual."""
        admitted = []
        while self.waiting and self.memory.slots.free > 0:
            request = self.waiting[0]
            try:
                stream = self._admit_first(request)
            except Exception as err:
                if self.waiting and self.waiting[0] is request:
                    self.waiting.popleft()
                log.exception("%s: admission failed", request.id)
                self.failed.append((request, err))
                continue
            if stream is None:
                break
            admitted.append(stream)
        if admitted and self.tiers is not None:
            self.tiers.ready()
        return admitted

    def _admit_first(self, request: Request) -> Stream | None:
        """Admit `request`, the first waiting, or None when it does not fit yet; when it raises, it holds nothing."""
        reach = self.reach(request)
        more = tuple(self.reach(fork) for fork in request.forks)  # its forks' reaches (engine/forks.py)
        never = self.memory.never_fits(reach, more) if more else None
        if never is not None:
            raise ValueError(never)
        cuts = plan_cuts(len(request.prompt), request.starts, self.prefill_chunk, self.min_chunk)
        whole = request.sampling.prompt_logprobs is not None  # its prompt's logprobs need every row computed
        hit = self.tiers.lookup(request.prompt, cuts, request.partition) if self.tiers is not None and not whole \
            else None
        shared = hit.state.pages if hit is not None else ()
        if not self.memory.fits(reach, len(shared), more) and self._evicting_helps(reach, len(shared), more):
            spare = hit.state if hit is not None else None
            while not self.memory.fits(reach, len(shared), more) and self.tiers.evict_one(spare):
                pass
        if not self.memory.fits(reach, len(shared), more):
            return None
        self.waiting.popleft()
        claim = self.memory.take(request.id, reach, shared)
        forks: list[Stream] | None = []
        try:
            stream = Stream(request, claim, SampleRow.of(request.sampling, self.unseeded), cuts=cuts)
            forks = stream.forks = reserve(self.memory, request, more, cuts, self.unseeded) if more else []
            if forks is None:  # one did not fit after all: nothing is held, and it waits
                self.memory.release(claim)
                self.waiting.appendleft(request)
                return None
            if self.tiers is not None:
                stream.position = stream.cached = self.tiers.admitted(hit, claim, request.id)
                marks = request.marks
                stream.keep_at = keep_points(cuts, len(request.prompt), marks.history, marks.system, marks.rewind,
                                             stream.position, self.min_chunk)
                self._log_resume(stream, hit)
        except BaseException:
            self.memory.release(claim)
            release(self.memory, forks or [])
            raise
        self.running.append(stream)
        return stream

    def _log_resume(self, stream: Stream, hit: Hit | None) -> None:
        rows = stream.prompt_len
        if hit is None or not stream.cached:
            log.info("%s: no kept state; prefilling %s rows", stream.request.id, f"{rows:,}")
        else:
            log.info("%s: resumed at %s of %s from %s", stream.request.id, f"{stream.cached:,}", f"{rows:,}",
                     self.tiers.resumed_from)

    def _evicting_helps(self, rows: int, shared: int, forks: tuple[int, ...] = ()) -> bool:
        """Whether the pages kept states alone hold would let a lease of `rows` rows (and its forks' leases) fit
        (else it waits for running streams, and the kept states stay)."""
        pool = self.memory.pool
        if self.tier is None or pool is None:
            return False
        return self.memory.pages_needed(rows, shared, forks) <= pool.available + pool.kept

    def kept(self, stream: Stream, end: int) -> None:
        """After a step that ended a prefill share at `end`: keep the stream's state there if it is a keep point."""
        why = stream.keep_at.get(end)
        if self.tiers is None or why is None:
            return
        keep = self.tiers.keep_from(stream.claim, stream.request.prompt[:end],
                                    tuple(c for c in stream.cuts if c <= end), why, stream.request.partition)
        reasons = ", ".join(sorted(why))
        if keep.tier is None:
            log.info("%s: not kept at %s (%s): larger than every tier", stream.request.id, f"{end:,}", reasons)
        elif keep.tier == "disk":
            log.info("%s: staged at %s (%s) for disk", stream.request.id, f"{end:,}", reasons)
        elif keep.fresh:
            log.info("%s: kept at %s (%s) on %s", stream.request.id, f"{end:,}", reasons, keep.tier)
        else:
            log.debug("%s: already kept at %s (%s) on %s", stream.request.id, f"{end:,}", reasons, keep.tier)

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
                if not first and rows + len(share.tokens) > self.step_rows:
                    continue
                shares.append((stream, share))
                rows += len(share.tokens)
                first = False
        if not shares:
            return None
        for stream, share in shares:
            self.memory.extend(stream.claim, share.end)
        return StepPlan(tuple(share for _, share in shares)), [stream for stream, _ in shares]

    def shutdown(self) -> None:
        """The engine stopped: stage the states still kept in RAM for the disk tier (when there is one)."""
        if self.tiers is not None:
            staged = self.tiers.spill()
            if staged:
                log.info("staged %d kept state(s) for disk at shutdown", staged)

    def finish(self, stream: Stream) -> None:
        """Take a stream out (a fork that never started is not in `running`) and return everything it holds."""
        if any(running is stream for running in self.running):
            self.running.remove(stream)
        self.memory.release(stream.claim)

    def _decode_share(self, stream: Stream) -> StreamStep:
        assert stream.pending is not None
        return StreamStep(stream.claim.slot, stream.position, (stream.pending,), sample=True)

    def _prefill_share(self, stream: Stream) -> StreamStep:
        start = stream.position
        end = stream.cuts[bisect_right(stream.cuts, start)]
        tokens = stream.request.prompt[start:end]
        sampling = stream.request.sampling
        return StreamStep(stream.claim.slot, start, tokens, sample=end == stream.prompt_len and sampling.max_tokens > 0,
                          every_row=sampling.prompt_logprobs is not None)
