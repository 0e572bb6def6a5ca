"""The step's hot path: the forward, the batched draw and each stream's token, for a step planned now or a decode
step launched ahead (engine/ahead.py). The Engine (runner.py) owns the loop, admission and failures; these methods
read its state and call back into it (`_stream_failed`, `_end`) for what is bookkeeping.

A stream with a grammar (Request.grammar, engine/grammar.py) has its mask filled on the host once the forward is
launched, drawn among the tokens it allows in the same batched pass, and its matcher advanced by the token before
it is emitted; a matcher that raises fails that stream alone, and one that is complete ends it with `stop`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tensorfold.engine.ahead import InFlight, ahead_of, is_decode
from tensorfold.engine.api import TokenEvent
from tensorfold.engine.forks import first_tokens, fork_point
from tensorfold.engine.penalties import Penalties
from tensorfold.engine.prompt_logprobs import entries_of, first_rows, prompt_event, sampled_rows
from tensorfold.engine.sampler import Allowed, Sampler, logprobs_of, refused
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
        if plan.every_row:
            logits = self._prompt_rows(plan, streams, logits)
        drawn = [stream for stream, share in zip(streams, plan.streams, strict=True) if share.sample]
        drawn, logits, forked = fork_point(self, streams, plan, drawn, logits)  # engine/forks.py
        allowed = self._allowed(drawn, logits)
        penalties = penalties_for(drawn, logits)
        tokens: list[int] = []
        read_now = any(s.sample_row.logprobs is not None for s in drawn)
        if drawn and self._ahead is not None and is_decode(plan) and not read_now:  # read back once the next
            ids = self.sampler.draw(logits, [s.sample_row for s in drawn], [s.produced for s in drawn],  # step is
                                    allowed, penalties)                                                # launched
            self._inflight = InFlight.launched(plan, streams, ids, logits, started)
            return
        logprobs: list | None = None
        if drawn:
            tokens = self.sampler.sample(logits, [s.sample_row for s in drawn], [s.produced for s in drawn],
                                         allowed, penalties)
            if read_now:
                logprobs = logprobs_for(drawn, logits, tokens)
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
            if stream.ended:  # its grammar failed before the draw
                continue
            try:
                stream.position = share.end
                if share.start < stream.prompt_len:
                    self.scheduler.kept(stream, share.end)
                if mine is not None:
                    self._sampled(stream, tokens[mine], logits[mine], now,
                                  logprobs[mine] if logprobs is not None else None)
                elif share.end == stream.prompt_len:  # max_tokens 0: the prompt alone (its logprobs) was asked for
                    self._end(stream, "length")
            except Exception as err:
                self._stream_failed(stream, err)
        first_tokens(self, forked, row, tokens, logits, logprobs, now)

    def _prompt_rows(self, plan: StepPlan, streams: list[Stream], logits: torch.Tensor) -> torch.Tensor:
        """A step with every_row shares: gather their prompt logprobs (a PromptEvent for the request and its forks
        where its prefill ends; a failure fails that stream alone) and return the sampled rows alone."""
        if logits.shape[0] != plan.logit_rows:
            raise ValueError(f"the family's forward returned {logits.shape[0]} logit rows for a step that asks for "
                             f"{plan.logit_rows}: StreamStep.every_row wants every row of its share (docs/hooks.md)")
        for stream, share, first in zip(streams, plan.streams, first_rows(plan), strict=True):
            if not share.every_row or stream.ended:
                continue
            try:
                prompt = stream.request.prompt
                stream.prompt_entries += entries_of(logits, first, share, prompt,
                                                    stream.request.sampling.prompt_logprobs or 0)
                if share.end == stream.prompt_len:
                    event, stream.prompt_entries = prompt_event(prompt, stream.prompt_entries), []
                    for request in (stream.request, *(fork.request for fork in stream.forks)):
                        self._outbox.emit(request, event)
            except Exception as err:
                self._stream_failed(stream, err)
        rows = torch.tensor(sampled_rows(plan), dtype=torch.int64).to(logits.device)
        return logits.index_select(0, rows)

    def _step_ahead(self, step: InFlight) -> None:
        """A decode step is in flight: launch the next one from its ids on the device (unless the first waiting
        request finds a slot for it and its forks, or none of its streams goes on), then read it back and hand out
        its tokens."""
        self._inflight = None
        self._step_streams = step.streams
        waiting = self.scheduler.waiting
        if not (waiting and self.memory.slots.free > len(waiting[0].forks)):
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

    def _allowed(self, drawn: list[Stream], logits: torch.Tensor) -> Allowed | None:
        """The masks of the drawn streams that have a grammar, None when none has: nothing is built for a step
        without one. A matcher that raises fails its stream here; its row is drawn unmasked and dropped."""
        index = [i for i, stream in enumerate(drawn) if stream.request.grammar is not None]
        if not index:
            return None
        allowed = Allowed.empty(index, logits.shape[1], logits.device)
        for k, i in enumerate(index):
            try:
                drawn[i].request.grammar.allowed(allowed.bits[k])
            except Exception as err:
                allowed.bits[k].fill_(-1)
                self._stream_failed(drawn[i], err)
        return allowed

    def _sampled(self, stream: Stream, token: int, logits: torch.Tensor, now: float,
                 logprob: tuple[float, tuple[tuple[int, float], ...]] | None = None) -> None:
        """A stream's token from the step's batched draw (-1: its logits row cannot be sampled, which fails it),
        taken by its grammar first (a token it refuses fails the stream, unsent)."""
        grammar = stream.request.grammar
        if token < 0:
            raise refused(logits, constrained=grammar is not None)
        if grammar is not None:
            grammar.advance(token)
        self.stats.token(stream.request.id, now)
        stream.produced += 1
        stream.outputs.append(token)
        event = TokenEvent(token) if logprob is None else TokenEvent(token, logprob[0], logprob[1])
        self._outbox.emit(stream.request, event)
        sampling = stream.request.sampling
        if token in sampling.stop_token_ids or (grammar is not None and grammar.finished):
            self._end(stream, "stop")
        elif stream.produced >= sampling.max_tokens or stream.position + 1 >= self.context:
            self._end(stream, "length")
        else:
            stream.pending = token


def penalties_for(drawn: list[Stream], logits: torch.Tensor) -> Penalties | None:
    """The penalised drawn streams' penalties, None when none is: nothing is built for a step without one."""
    index = [i for i, stream in enumerate(drawn) if stream.sample_row.penalized]
    if not index:
        return None
    rows = [drawn[i] for i in index]
    vocab, device = logits.shape[1], logits.device
    return Penalties.of(index, [s.sample_row.penalties for s in rows], [s.output_counts(vocab, device) for s in rows],
                        [s.prompt_distinct(device) if s.sample_row.penalties[0] != 1.0 else () for s in rows])


def logprobs_for(drawn: list[Stream], logits: torch.Tensor,
                 tokens: list[int]) -> list[tuple[float, tuple[tuple[int, float], ...]] | None]:
    """Each drawn stream's logprobs for its token (None for those that asked for none)."""
    index = [i for i, stream in enumerate(drawn) if stream.sample_row.logprobs is not None]
    found = logprobs_of(logits, index, [tokens[i] for i in index],
                        [drawn[i].sample_row.logprobs or 0 for i in index])
    out: list[tuple[float, tuple[tuple[int, float], ...]] | None] = [None] * len(drawn)
    for i, value in zip(index, found, strict=True):
        out[i] = value
    return out
