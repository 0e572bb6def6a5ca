"""The step loop: one thread that admits requests, prefills them on the grid, decodes and reports events."""

from __future__ import annotations

import logging
import queue
import threading

import torch

from tensorfold.engine.api import DoneEvent, ErrorEvent, Request, TokenEvent
from tensorfold.engine.grid import grid_cuts
from tensorfold.engine.sampler import Sampler
from tensorfold.family import FamilyModel
from tensorfold.kv import KvStore
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.service import QueueFull

log = logging.getLogger(__name__)
SLOT = 0


class Engine:
    """Serves one request at a time in slot 0; the server only ever calls `submit`."""

    def __init__(self, model: FamilyModel, kv: KvStore, prefill_chunk: int, context: int, max_waiting: int) -> None:
        self.model = model
        self.kv = kv
        self.prefill_chunk = prefill_chunk
        self.context = context
        self._waiting: queue.Queue[Request | None] = queue.Queue(maxsize=max_waiting)
        self._thread = threading.Thread(target=self._loop, name="tensorfold-engine", daemon=True)

    def start(self) -> None:
        """Start the step loop thread."""
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the request in flight."""
        self._waiting.put(None)
        self._thread.join(timeout)

    def submit(self, request: Request) -> None:
        """Queue a request; raises QueueFull past --max-waiting."""
        try:
            self._waiting.put_nowait(request)
        except queue.Full as err:
            raise QueueFull(f"{self._waiting.maxsize} requests are already waiting") from err

    def _loop(self) -> None:
        while (request := self._waiting.get()) is not None:
            try:
                with torch.inference_mode():
                    self._serve(request)
            except Exception as err:
                log.exception("request %s failed", request.id)
                request.on_event(ErrorEvent(f"the engine failed this request: {type(err).__name__}: {err}"))

    def _serve(self, request: Request) -> None:
        prompt = request.prompt
        if not prompt or len(prompt) >= self.context:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {self.context}")
        self.kv.clear(SLOT)
        logits = self._prefill(request)
        if logits is None:
            request.on_event(DoneEvent("cancelled", len(prompt), 0, 0))
            return
        self._decode(request, logits)

    def _prefill(self, request: Request) -> torch.Tensor | None:
        prompt = request.prompt
        logits = None
        for a, b in grid_cuts(0, len(prompt), self.prefill_chunk):
            if request.cancelled.is_set():
                return None
            plan = StepPlan((StreamStep(SLOT, a, prompt[a:b], sample=b == len(prompt)),))
            logits = self.model.forward(plan, self.kv)
        return logits

    def _decode(self, request: Request, logits: torch.Tensor) -> None:
        sampling = request.sampling
        sampler = Sampler(sampling)
        position = len(request.prompt)
        produced = 0
        while True:
            token = sampler.sample(logits[0])
            produced += 1
            request.on_event(TokenEvent(token))
            reason = self._finish_reason(request, token, produced, position + 1)
            if reason is not None:
                request.on_event(DoneEvent(reason, len(request.prompt), produced, 0))
                return
            logits = self.model.forward(StepPlan((StreamStep(SLOT, position, (token,)),)), self.kv)
            position += 1

    def _finish_reason(self, request: Request, token: int, produced: int, rows: int) -> str | None:
        sampling = request.sampling
        if token in sampling.stop_token_ids:
            return "stop"
        if produced >= sampling.max_tokens or rows >= self.context:
            return "length"
        if request.cancelled.is_set():
            return "cancelled"
        return None
