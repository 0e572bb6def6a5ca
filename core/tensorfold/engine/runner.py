"""The step loop: one thread that admits requests, runs steps that mix prefill chunks and decode rows, and
reports events. It runs no hooks and no string lookups; the forward is resolved once at startup.

    a failure   fails only the requests it concerns, and the loop goes on: an admission that raises (a tier's
                lookup or restore) fails its request; an exception in one stream's part after the forward (its
                position, keeping its state, a logits row the sampler refused, its event) fails that stream; the
                forward, the step's one batched sampling pass, or anything not pinned on one stream, fails the
                streams of the step (before the plan exists: every running one).
                A failed stream is released (slot and pages) once and gets one ErrorEvent; waiting requests stay
    dead        the loop stops for good when it cannot go on: the device is lost (a family's DeviceLost or torch's
                accelerator errors, anywhere in a step); memory integrity does not hold at the next idle moment
                after a failure; FAILED_STEPS_DEAD steps in a row fail as a whole; an exception escapes the
                recovery; or another thread hands it a reason with `die` (a tensor-parallel follower gone). Then
                `failure` says why, every running, waiting and later request fails with it, and `wait_failed`
                returns (launch.py: /health 503, the process exits with status 3)
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import torch

from tensorfold.engine.ahead import InFlight
from tensorfold.engine.api import DoneEvent, ErrorEvent, Event, Request
from tensorfold.engine.failures import LoopStopped, death_reason, device_lost, failed_request, named
from tensorfold.engine.forks import fork_event
from tensorfold.engine.outbox import Outbox
from tensorfold.engine.sampler import NonFiniteLogits, Sampler
from tensorfold.engine.scheduler import Scheduler
from tensorfold.engine.stats import EngineStats
from tensorfold.engine.steps import StepPath
from tensorfold.engine.stream import Stream
from tensorfold.family import FamilyModel
from tensorfold.memory import StreamMemory
from tensorfold.service import EngineDead, QueueFull
from tensorfold.settings import DEFAULT_MIN_CHUNK

if TYPE_CHECKING:
    from tensorfold.tiers.device import DeviceTier
    from tensorfold.tiers.disk import DiskTier
    from tensorfold.tiers.host import HostTier

log = logging.getLogger(__name__)
FAILED_STEPS_DEAD = 3  # whole steps failing in a row, none completing between: the loop does no useful work


class Engine(StepPath):
    """Many streams share one memory and one step loop; the server only ever calls `submit`."""

    def __init__(self, model: FamilyModel, memory: StreamMemory, prefill_chunk: int, context: int,
                 max_waiting: int, min_chunk: int = DEFAULT_MIN_CHUNK, tier: DeviceTier | None = None,
                 host: HostTier | None = None, disk: DiskTier | None = None,
                 stats: EngineStats | None = None, overlap: bool = False, seed: int | None = None,
                 step_rows: int | None = None) -> None:
        self.model = model
        # with `overlap`, decode steps are launched ahead (engine/ahead.py) when the model can take its tokens on
        # the device: graphs.DecodeRunner.forward_ahead
        self._ahead = getattr(model, "forward_ahead", None) if overlap else None
        self._inflight: InFlight | None = None  # a decode step launched and not read back yet
        self._read_at = 0.0                     # when the last step's ids were read back
        self.stats = stats if stats is not None else EngineStats()
        self.memory = memory
        self.tier = tier
        self.host = host
        self.disk = disk
        self.scheduler = Scheduler(memory, context, prefill_chunk, min_chunk, tier, host, disk, seed, step_rows)
        self.sampler = Sampler()
        self.context = context
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[Request | BaseException | None] = queue.SimpleQueue()
        self._queued = 0
        self._lock = threading.Lock()
        self._stopping = False
        self.integrity = "not checked yet"
        self._failure: str | None = None
        self._dead = threading.Event()
        self._suspect: str | None = None  # the last failure recovered from, until the idle integrity check passes
        self._failed_steps = 0            # steps failed as a whole since the last one that completed
        self._step_streams: list[Stream] | None = None
        self._outbox = Outbox()  # events to sinks leave once per step (engine/outbox.py)
        self._thread = threading.Thread(target=self._run, name="tensorfold-engine", daemon=True)

    @property
    def tiers(self) -> tuple[DeviceTier | HostTier | DiskTier, ...]:
        """The kept-state tiers, fastest first (each has `stats()`, `describe()`, `check_integrity()`)."""
        kept = self.scheduler.tiers
        return kept.tiers if kept is not None else ()

    @property
    def kv(self):
        """The store the forward reads and writes."""
        return self.memory.kv

    @property
    def failure(self) -> str | None:
        """Why the step loop stopped for good; None while it runs (and before it starts)."""
        return self._failure

    def wait_failed(self, timeout: float | None = None) -> str | None:
        """Block until the engine is dead (then its reason) or `timeout` seconds pass (then None)."""
        self._dead.wait(timeout)
        return self._failure

    def start(self) -> None:
        """Start the step loop thread."""
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop; streams still running are cancelled; with a disk tier, the states kept in RAM are written within
        its flush bound (tiers/disk.py)."""
        if self._thread.ident is None:  # never started: stop here, in this thread
            self._stopping = True
            with torch.inference_mode():
                self.scheduler.shutdown()
        else:
            self._inbox.put(None)
            self._thread.join(timeout)
        if self.scheduler.tiers is not None:
            self.scheduler.tiers.close()

    def die(self, err: BaseException) -> None:
        """Stop for good from another thread (a watcher found a tensor-parallel rank gone, follow/spawn.py): the
        step loop raises `err` at its next turn (at once when idle), so everything held fails with its reason."""
        self._inbox.put(err)

    def submit(self, request: Request) -> None:
        """Queue a request; raises QueueFull when --max-waiting requests already wait, EngineDead once the loop
        has stopped for good (put under the lock, so a dying engine finds every request queued before)."""
        with self._lock:
            if self._failure is not None:
                raise EngineDead(self._failure)
            if self._queued >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting")
            self._queued += 1
            now = time.monotonic()
            for one in (request, *request.forks):  # each fork counts as a request of its own
                self.stats.arrived(one.id, now)
            self._inbox.put(request)

    def _run(self) -> None:
        """The thread: the step loop until close(); whatever ends it otherwise leaves the engine dead."""
        try:
            with torch.inference_mode():
                self._loop()
        except BaseException as err:  # the thread would end: never leave a live server on a dead loop
            self._die(err)

    def _loop(self) -> None:
        while not self._stopping:
            idle = not self.scheduler.running and not self.scheduler.waiting and self._inflight is None
            if idle:
                self._check_memory()
            self._take_inbox(block=idle)
            try:
                self._step()
            except Exception as err:
                self._step_failed(err)
            finally:
                self._step_streams = None
        for stream in list(self.scheduler.running):
            self._end(stream, "cancelled")
        try:
            self.scheduler.shutdown()
        except Exception:  # stopping anyway: the states not staged are lost, the engine did not fail
            log.exception("staging the kept states for disk at shutdown failed")

    def _check_memory(self) -> None:
        """With nothing running, every page and slot must be back; a failure is logged and shown on /memory, and
        after a failure recovered from, it stops the loop (raises LoopStopped)."""
        try:
            self.memory.check_integrity()
            if self.scheduler.tiers is not None:
                self.scheduler.tiers.check_integrity()
            if self.memory.slots.free != self.memory.slots.count:
                raise AssertionError(f"{self.memory.slots.count - self.memory.slots.free} slots held with no stream")
        except Exception as err:
            if device_lost(err):
                raise
            log.error("memory integrity: %s", err)
            self.integrity = str(err) or type(err).__name__
            if self._suspect is not None:
                raise LoopStopped(f"memory integrity does not hold after a failure ({self._suspect}): "
                                  f"{self.integrity}") from err
            return
        self.integrity = "ok"
        self._suspect = None

    def _take_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self._stopping = True
                return
            if not item.prompt or len(item.prompt) >= self.context:
                self._dequeued()
                self._tell_all(item, ErrorEvent(f"prompt of {len(item.prompt)} tokens does not fit the context of "
                                                f"{self.context}"))
                continue
            self.scheduler.waiting.append(item)

    def _dequeued(self, count: int = 1) -> None:
        with self._lock:
            self._queued -= count

    def _step(self) -> None:
        with self._outbox.held():  # the step's events leave in one hand-off per sink when it ends, however it ends
            self._reap_cancelled()
            if self._inflight is not None:
                self._step_ahead(self._inflight)
                return
            self._admit()
            self._outbox.flush()  # cancels and refused admissions leave now, not after the forward
            planned = self.scheduler.plan()
            if planned is None:
                return
            self._forward(*planned)

    def _admit(self) -> None:
        """Admit what fits; each admission that raised fails its request alone."""
        waiting = len(self.scheduler.waiting)
        admitted = []
        try:
            admitted = self.scheduler.admit()
        finally:
            self._dequeued(waiting - len(self.scheduler.waiting))
            failed, self.scheduler.failed = self.scheduler.failed, []
            for request, err in failed:
                self._suspect = f"{request.id}: {named(err)}"
                self._tell_all(request, ErrorEvent(failed_request(err)))
        now = time.monotonic()
        for stream in admitted:
            for one in (stream, *stream.forks):
                self.stats.admitted(one.request.id, now, stream.prompt_len, stream.cached)
        lost = next((err for _, err in failed if device_lost(err)), None)
        if lost is not None:
            raise lost

    def _stream_failed(self, stream: Stream, err: Exception) -> None:
        """One stream's part of a step raised: fail that stream; the others go on."""
        if device_lost(err):
            raise err
        log.error("%s: failed: %s", stream.request.id, named(err),
                  exc_info=None if isinstance(err, NonFiniteLogits) else err)
        self._suspect = f"{stream.request.id}: {named(err)}"
        self._fail(stream, failed_request(err))

    def _step_failed(self, err: Exception) -> None:
        """A step raised where no one stream is to blame: fail the streams of the step (every running one when
        the plan was not made yet); stop the loop when the device is lost or steps keep failing."""
        self._inflight = None  # a step launched ahead belongs to streams failed here, or is read no more
        if device_lost(err):
            raise err
        self._failed_steps += 1
        if self._failed_steps >= FAILED_STEPS_DEAD:
            raise LoopStopped(f"{self._failed_steps} steps in a row failed, the last with {named(err)}") from err
        streams = self._step_streams if self._step_streams is not None else list(self.scheduler.running)
        log.error("a step of %d streams failed: %s", len(streams), named(err), exc_info=err)
        self._suspect = f"a step: {named(err)}"
        for stream in streams:
            self._fail(stream, failed_request(err))

    def _reap_cancelled(self) -> None:
        for stream in list(self.scheduler.running):
            if stream.request.cancelled.is_set():
                self._end(stream, "cancelled")
        for request in [r for r in self.scheduler.waiting if r.cancelled.is_set()]:
            self.scheduler.waiting.remove(request)
            self._dequeued()
            self._tell_all(request, DoneEvent("cancelled", len(request.prompt), 0, 0))

    def _end(self, stream: Stream, reason: str) -> None:
        self._finish(stream, DoneEvent(reason, stream.prompt_len, stream.produced, stream.cached))

    def _fail(self, stream: Stream, message: str) -> None:
        self._finish(stream, ErrorEvent(message))

    def _finish(self, stream: Stream, event: Event) -> None:
        """Take a stream out, return its slot and pages and send its last event: once, whatever raises; forks not
        started yet end with it, the same way (engine/forks.py)."""
        if stream.ended:
            return
        stream.ended = True
        forks, stream.forks = stream.forks, []
        try:
            self.scheduler.finish(stream)
        except Exception as err:  # its memory may be half returned: the idle integrity check decides
            log.error("%s: releasing it failed: %s", stream.request.id, named(err), exc_info=err)
            self._suspect = f"{stream.request.id} released: {named(err)}"
            if stream in self.scheduler.running:
                self.scheduler.running.remove(stream)
        self._tell(stream.request, event)
        for fork in forks:
            self._finish(fork, fork_event(event, fork))

    def _tell_all(self, request: Request, event: Event) -> None:
        """The last event of a request that never ran, and the same for each of its forks."""
        for one in (request, *request.forks):
            self._tell(one, event)

    def _tell(self, request: Request, event: Event) -> None:
        """A request's last event; a handler that raises is logged (it is the receiver's fault, not a step's)."""
        reason = event.finish_reason if isinstance(event, DoneEvent) else "error"
        self.stats.finished(request.id, reason, time.monotonic())
        try:
            self._outbox.emit(request, event)
        except Exception:
            log.exception("%s: its event handler raised on %s", request.id, type(event).__name__)

    def _die(self, err: BaseException) -> None:
        """The loop cannot go on: say why, and fail every request held, waiting or queued with that reason."""
        reason = death_reason(err)
        log.critical("the engine stopped: %s", reason, exc_info=err)
        with self._lock:
            self._failure = reason
            self._stopping = True
        self._dead.set()
        event = ErrorEvent(f"the engine stopped: {reason}")
        with self._outbox.held():  # every request's last event, in one hand-off per sink
            for stream in list(self.scheduler.running):
                self._finish(stream, event)
            while self.scheduler.waiting:
                self._tell_all(self.scheduler.waiting.popleft(), event)
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    return
                if isinstance(item, Request):
                    self._tell_all(item, event)

    def snapshot(self) -> dict[str, object]:
        """Streams and memory now, for /memory (read from another thread: numbers may be a step old); `failure`
        says why the engine stopped for good (None while it runs)."""
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "failure": self._failure, "integrity_when_idle": self.integrity, **self.memory.snapshot(),
                **(self.scheduler.tiers.describe() if self.scheduler.tiers is not None else {})}
