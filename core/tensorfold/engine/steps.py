"""The step's hot path: the forward, the batched draw and each stream's token, for a step planned now or a decode
step launched ahead (engine/ahead.py). The Engine (runner.py) owns the loop, admission and failures; these methods
read its state and call back into it (`_stream_failed`, `_end`) for what is bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tensorfold.engine.ahead import InFlight, ahead_of, is_decode
from tensorfold.engine.api import TokenEvent
from tensorfold.engine.sampler import Sampler, refused
from tensorfold.engine.stats import EngineStats
from tensorfold.engine.stream import Stream
from tensorfold.family import FamilyModel
from tensorfold.memory import StreamMemory

if TYPE_CHECKING:
    from tensorfold.engine.outbox import Outbox
    from tensorfold.engine.scheduler import Scheduler
    from tensorfold.plan import StepPlan


class StepPath:
    """The Engine's step methods (a base class of Engine, kept apart so the hot path reads on its own)."""

    model: FamilyModel
    memory: StreamMemory
    scheduler: Scheduler
    sampler: Sampler
    stats: EngineStats
    context: int
    _ahead: Callable[..., torch.Tensor | None] | None
    _inflight: InFlight | None
    _read_at: float
    _failed_steps: int
    _step_streams: list[Stream] | None
    _outbox: Outbox
    _stream_failed: Callable[[Stream, Exception], None]  # the Engine's: fail one stream, the step goes on
    _end: Callable[[Stream, str], None]                   # the Engine's: a stream ends with a finish reason

    def _forward(self, plan: StepPlan, streams: list[Stream]) -> None:
        """The planned step: the forward, the batched draw, then each stream's part (failing that stream alone)."""
        self._step_streams = streams
        started = time.monotonic()
        logits = self.model.forward(plan, self.memory.kv)
        drawn = [stream for stream, share in zip(streams, plan.streams, strict=True) if share.sample]
        tokens: list[int] = []
        if drawn and self._ahead is not None and is_decode(plan):  # read back once the next step is launched
            ids = self.sampler.draw(logits, [s.sample_row for s in drawn], [s.produced for s in drawn])
            self._inflight = InFlight.launched(plan, streams, ids, logits, started)
            return
        if drawn:
            tokens = self.sampler.sample(logits, [s.sample_row for s in drawn], [s.produced for s in drawn])
        self._failed_steps = 0
        now = time.monotonic()
        decode_rows = sum(1 for stream in streams if not stream.prefilling)
        waited = bool(drawn) or not logits.is_cuda  # on CUDA a step that samples nothing never waits for the device
        self.stats.step(sum(len(share.tokens) for share in plan.streams) - decode_rows, decode_rows,
                        now - started if waited else None)
        row = 0
        for stream, share in zip(streams, plan.streams, strict=True):
            mine = row if share.sample else None
            row += share.sample
            try:
                stream.position = share.end
                if share.start < stream.prompt_len:
                    self.scheduler.kept(stream, share.end)
                if mine is not None:
                    self._sampled(stream, tokens[mine], logits[mine], now)
            except Exception as err:
                self._stream_failed(stream, err)

    def _step_ahead(self, step: InFlight) -> None:
        """A decode step is in flight: launch the next one from its ids on the device (unless a request waits
        for a free slot, or none of its streams goes on), then read it back and hand out its tokens."""
        self._inflight = None
        self._step_streams = step.streams
        if not (self.scheduler.waiting and self.memory.slots.free > 0):
            self._inflight = self._launch_ahead(step)
        tokens = step.ids()
        self._failed_steps = 0
        now = time.monotonic()
        self.stats.step(0, len(step.streams), now - max(step.started, self._read_at))
        self._read_at = now
        for row, (stream, share) in enumerate(zip(step.streams, step.plan.streams, strict=True)):
            if stream.ended:  # ended at an earlier step: this row was launched ahead and is dropped
                continue
            try:
                if stream.request.cancelled.is_set():
                    self._end(stream, "cancelled")
                    continue
                stream.position = share.end
                self._sampled(stream, tokens[row], step.logits[row], now)
            except Exception as err:
                self._stream_failed(stream, err)

    def _launch_ahead(self, step: InFlight) -> InFlight | None:
        """The decode step after `step`, launched on its ids still on the device; None when there is none."""
        planned = ahead_of(step, self.context)
        if planned is None:
            return None
        plan, streams = planned
        for stream, share in zip(streams, plan.streams, strict=True):
            self.memory.extend(stream.claim, share.end)
        started = time.monotonic()
        logits = self._ahead(plan, self.memory.kv, step.tokens)
        if logits is None:
            return None
        ids = self.sampler.draw(logits, [s.sample_row for s in streams], [s.produced + 1 for s in streams])
        return InFlight.launched(plan, streams, ids, logits, started)

    def _sampled(self, stream: Stream, token: int, logits: torch.Tensor, now: float) -> None:
        """A stream's token from the step's batched draw (-1: its logits row cannot be sampled, which fails it)."""
        if token < 0:
            raise refused(logits)
        self.stats.token(stream.request.id, now)
        stream.produced += 1
        self._outbox.emit(stream.request, TokenEvent(token))
        sampling = stream.request.sampling
        if token in sampling.stop_token_ids:
            self._end(stream, "stop")
        elif stream.produced >= sampling.max_tokens or stream.position + 1 >= self.context:
            self._end(stream, "length")
        else:
            stream.pending = token

