"""The step loop: one thread that admits requests, runs steps that mix prefill chunks and decode rows, and
reports events. It runs no hooks and no string lookups; the forward is resolved once at startup."""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

import torch

from tensorfold.engine.api import DoneEvent, ErrorEvent, Request, TokenEvent
from tensorfold.engine.memory import StreamMemory
from tensorfold.engine.scheduler import Scheduler
from tensorfold.engine.stream import Stream
from tensorfold.family import FamilyModel
from tensorfold.service import QueueFull
from tensorfold.settings import DEFAULT_MIN_CHUNK

if TYPE_CHECKING:
    from tensorfold.tiers.device import DeviceTier
    from tensorfold.tiers.disk import DiskTier
    from tensorfold.tiers.host import HostTier

log = logging.getLogger(__name__)


class Engine:
    """Many streams share one memory and one step loop; the server only ever calls `submit`."""

    def __init__(self, model: FamilyModel, memory: StreamMemory, prefill_chunk: int, context: int,
                 max_waiting: int, min_chunk: int = DEFAULT_MIN_CHUNK, tier: DeviceTier | None = None,
                 host: HostTier | None = None, disk: DiskTier | None = None) -> None:
        self.model = model
        self.memory = memory
        self.tier = tier
        self.host = host
        self.disk = disk
        self.scheduler = Scheduler(memory, context, prefill_chunk, min_chunk, tier, host, disk)
        self.context = context
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._queued = 0
        self._lock = threading.Lock()
        self._stopping = False
        self.integrity = "not checked yet"
        self._thread = threading.Thread(target=self._loop, name="tensorfold-engine", daemon=True)

    @property
    def tiers(self) -> tuple[DeviceTier | HostTier | DiskTier, ...]:
        """The kept-state tiers, fastest first (each has `stats()`, `describe()`, `check_integrity()`)."""
        kept = self.scheduler.tiers
        return kept.tiers if kept is not None else ()

    @property
    def kv(self):
        """The store the forward reads and writes."""
        return self.memory.kv

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

    def submit(self, request: Request) -> None:
        """Queue a request; raises QueueFull when --max-waiting requests already wait."""
        with self._lock:
            if self._queued >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting")
            self._queued += 1
        self._inbox.put(request)

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                idle = not self.scheduler.running and not self.scheduler.waiting
                if idle:
                    self._check_memory()
                self._take_inbox(block=idle)
                self._step()
            for stream in list(self.scheduler.running):
                self._end(stream, "cancelled")
            self.scheduler.shutdown()

    def _check_memory(self) -> None:
        """With nothing running, every page and slot must be back; a failure is logged and shown on /memory."""
        try:
            self.memory.check_integrity()
            if self.scheduler.tiers is not None:
                self.scheduler.tiers.check_integrity()
            if self.memory.slots.free != self.memory.slots.count:
                raise AssertionError(f"{self.memory.slots.count - self.memory.slots.free} slots held with no stream")
            self.integrity = "ok"
        except AssertionError as err:
            log.error("memory integrity: %s", err)
            self.integrity = str(err)

    def _take_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self._stopping = True
                return
            if not item.prompt or len(item.prompt) >= self.context:
                self._dequeued()
                item.on_event(ErrorEvent(f"prompt of {len(item.prompt)} tokens does not fit the context of "
                                         f"{self.context}"))
                continue
            self.scheduler.waiting.append(item)

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _step(self) -> None:
        self._reap_cancelled()
        for _ in self.scheduler.admit():
            self._dequeued()
        planned = self.scheduler.plan()
        if planned is None:
            return
        plan, streams = planned
        try:
            logits = self.model.forward(plan, self.memory.kv)
        except Exception as err:
            log.exception("step of %d streams failed", len(streams))
            for stream in streams:
                self._fail(stream, f"the engine failed this request: {type(err).__name__}: {err}")
            return
        row = 0
        for stream, share in zip(streams, plan.streams, strict=True):
            stream.position = share.end
            if share.start < stream.prompt_len:
                self.scheduler.kept(stream, share.end)
            if share.sample:
                self._sampled(stream, logits[row])
                row += 1

    def _reap_cancelled(self) -> None:
        for stream in list(self.scheduler.running):
            if stream.request.cancelled.is_set():
                self._end(stream, "cancelled")
        for request in [r for r in self.scheduler.waiting if r.cancelled.is_set()]:
            self.scheduler.waiting.remove(request)
            self._dequeued()
            request.on_event(DoneEvent("cancelled", len(request.prompt), 0, 0))

    def _sampled(self, stream: Stream, logits: torch.Tensor) -> None:
        token = stream.sampler.sample(logits)
        stream.produced += 1
        stream.request.on_event(TokenEvent(token))
        sampling = stream.request.sampling
        if token in sampling.stop_token_ids:
            self._end(stream, "stop")
        elif stream.produced >= sampling.max_tokens or stream.position + 1 >= self.context:
            self._end(stream, "length")
        else:
            stream.pending = token

    def _end(self, stream: Stream, reason: str) -> None:
        self.scheduler.finish(stream)
        stream.request.on_event(DoneEvent(reason, stream.prompt_len, stream.produced, stream.cached))

    def _fail(self, stream: Stream, message: str) -> None:
        self.scheduler.finish(stream)
        stream.request.on_event(ErrorEvent(message))

    def snapshot(self) -> dict[str, object]:
        """Streams and memory now, for /memory (read from another thread: numbers may be a step old)."""
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "integrity_when_idle": self.integrity, **self.memory.snapshot(),
                **(self.scheduler.tiers.describe() if self.scheduler.tiers is not None else {})}
