"""Decode steps launched ahead: while the device runs decode step N, the step loop launches step N+1 from N's sampled
ids still on the device, and only then reads N's ids back (SGLang's overlap scheduler, vLLM's async scheduling), so
the device never waits for the host between decode steps.

    when        step N is pure decode through a model with `forward_ahead` (engine/graphs.py), nothing waits for a
                free slot, some stream of N may go on past it, and none of those has a grammar (its next mask needs
                N's token, read back and taken by its matcher: engine/grammar.py), a penalty (its next logits
                count N's token) or logprobs (read with the ids); otherwise N is read back first
                and the next step is planned as usual (admission, prefill chunks)
    who         the streams of N that may go on: not ended, not cancelled, and not ending by length at N
                (max_tokens or the context: known without N's token); a stream that samples a stop token at N,
                or fails at N, still has a row in N+1, which is dropped unread: never emitted, never counted
    exact       row i of N+1 feeds the id N sampled for it, at the next position, drawn with its next token number:
                the same inputs, so the same tokens, as the step planned after N's ids are back
    memory      a stream that ends while a step ahead holds its row gives back its slot and pages, but nothing is
                admitted until that step is read back: a page another running stream takes meanwhile is written by
                it after the dropped row's write, in the device's order
"""

from __future__ import annotations

import attrs
import torch

from tensorfold.engine.stream import Stream
from tensorfold.plan import StepPlan, StreamStep


@attrs.define
class InFlight:
    """A launched decode step whose ids are not read back yet."""

    plan: StepPlan
    streams: list[Stream]
    tokens: torch.Tensor                   # int64 [len(streams)] on the device: the sampled ids (-1: refused)
    logits: torch.Tensor                   # float32 [len(streams), V]: read only for a refused row's message
    started: float                         # time.monotonic() at its launch
    host: torch.Tensor | None = None       # pinned: where the ids are copied, on CUDA
    ready: torch.cuda.Event | None = None  # recorded after that copy

    @classmethod
    def launched(cls, plan: StepPlan, streams: list[Stream], tokens: torch.Tensor, logits: torch.Tensor,
                 started: float) -> InFlight:
        """A step whose ids start their way back now: on CUDA, one copy into pinned memory and an event."""
        if not tokens.is_cuda:
            return cls(plan, streams, tokens, logits, started)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(plan, streams, tokens, logits, started, host, ready)

    def ids(self) -> list[int]:
        """The sampled ids, waiting for the device if it has not got there yet."""
        if self.ready is None or self.host is None:
            return self.tokens.tolist()
        self.ready.synchronize()
        return self.host.tolist()


def is_decode(plan: StepPlan) -> bool:
    """Whether every share feeds one token it samples, past position 0 (the steps the decode path takes)."""
    return all(len(s.tokens) == 1 and s.sample and not s.every_row and s.start > 0 for s in plan.streams)


def ahead_of(step: InFlight, context: int) -> tuple[StepPlan, list[Stream]] | None:
    """The decode step after `step` for its streams that may go on, each share's token the index of its row in
    `step.tokens` (graphs.DecodeRunner.forward_ahead reads it so); None when none may, or when one of them has a
    grammar, a penalty or logprobs: `needs_its_token`."""
    shares: list[StreamStep] = []
    streams: list[Stream] = []
    for row, (stream, share) in enumerate(zip(step.streams, step.plan.streams, strict=True)):
        if stream.ended or stream.request.cancelled.is_set():
            continue
        if stream.produced + 1 >= stream.request.sampling.max_tokens or share.end + 1 >= context:
            continue  # it ends by length at `step`, whatever it samples
        if needs_its_token(stream):
            return None
        shares.append(StreamStep(share.slot, share.end, (row,), sample=True))
        streams.append(stream)
    return (StepPlan(tuple(shares)), streams) if shares else None


def needs_its_token(stream: Stream) -> bool:
    """Whether the stream's next step needs this step's token on the host first: a grammar's mask, a penalty's
    counts; or whether its logprobs are read with the ids."""
    row = stream.sample_row
    return stream.request.grammar is not None or row.penalized or row.logprobs is not None
