"""Forks: the other choices of one prompt (the API's `n`), prefilled once. A request's `forks` (Request.forks) are
requests with its prompt and their own ids, sampling, events and grammars; only the request itself is submitted.

    admission   the request is admitted only when a slot and the pages of its reach fit for it and for each fork,
                all at once (StreamMemory.fits); the forks' claims are taken then (`reserve`), so nothing they need
                can be missing later; when one cannot be taken, all are given back and the request waits. A group
                that could not run even alone (more streams than slots, more pages than the pool) fails
    fork point  the step whose share ends the request's prefill and samples: right after the forward, each fork
                gets a copy of its state at the prompt's end (StreamMemory.copy_state: fixed states and rows
                [0, prompt_len)), joins the running streams at that position, and draws its first token from a
                copy of the request's logits row in the same batched draw, with its own seed, grammar mask and
                penalties (`fork_point`, `first_tokens`); from then on a fork is a stream like any other, its
                `cached` the request's
    ending      a request that ends before its fork point (cancelled, failed, the engine stopping) ends its forks
                the same way, each with its own last event, once (`fork_event`; Engine._finish), and their claims
                go back; a fork cancelled before the fork point ends `cancelled` there, never copied into
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Protocol

import torch

from tensorfold.engine.api import DoneEvent, Event, Request
from tensorfold.engine.sampler import SampleRow
from tensorfold.engine.stream import Stream
from tensorfold.memory import StreamMemory
from tensorfold.pool.pages import PoolExhausted

if TYPE_CHECKING:
    from tensorfold.plan import StepPlan

Drawn = tuple[float, tuple[tuple[int, float], ...]] | None  # one drawn row's logprobs, when asked for


class Running(Protocol):
    """The scheduler as forks see it: the running streams (engine/scheduler.py)."""

    running: list[Stream]


class Host(Protocol):
    """The engine as the fork point sees it (engine/steps.py StepPath, engine/runner.py Engine)."""

    memory: StreamMemory
    scheduler: Running
    _step_streams: list[Stream] | None

    def _end(self, stream: Stream, reason: str) -> None:
        """End a stream with a finish reason (a fork cancelled before its fork point)."""
        ...

    def _stream_failed(self, stream: Stream, err: Exception) -> None:
        """Fail one stream alone (a fork whose copy or first token raised)."""
        ...

    def _sampled(self, stream: Stream, token: int, logits: torch.Tensor, now: float, logprob: Drawn = None) -> None:
        """Hand a stream its drawn token (a fork's first)."""
        ...


def reserve(memory: StreamMemory, request: Request, reaches: tuple[int, ...], cuts: tuple[int, ...],
            unseeded: random.Random | None) -> list[Stream] | None:
    """A stream for each fork of `request`, holding its claim of `reaches[i]` rows (its own slot and pages) and its
    own sampling row; None, with every claim taken here given back, when one does not fit. A fork whose prompt
    differs or whose sampling cannot be read raises, with nothing held."""
    streams: list[Stream] = []
    try:
        for fork, reach in zip(request.forks, reaches, strict=True):
            if fork.prompt != request.prompt:
                raise ValueError(f"fork {fork.id} has a prompt of its own: a fork continues its request's prompt")
            row = SampleRow.of(fork.sampling, unseeded)
            if memory.slots.free == 0:
                release(memory, streams)
                return None
            streams.append(Stream(fork, memory.take(fork.id, reach), row, cuts=cuts))
    except PoolExhausted:
        release(memory, streams)
        return None
    except BaseException:
        release(memory, streams)
        raise
    return streams


def release(memory: StreamMemory, streams: list[Stream]) -> None:
    """Give back the claims of forks that never ran."""
    for stream in streams:
        memory.release(stream.claim)


def fork_point(engine: Host, streams: list[Stream], plan: StepPlan, drawn: list[Stream],
               logits: torch.Tensor) -> tuple[list[Stream], torch.Tensor, list[Stream]]:
    """After the forward: the forks of the streams whose prefill this step ends start now, each at its parent's
    state, and draw from a copy of its logits row. Returns the drawn streams with the started forks after them,
    the logits with their rows, and the started forks; nothing is copied in a step without one."""
    if not any(stream.forks for stream in drawn):
        return drawn, logits, []
    rows: list[int] = []
    started: list[Stream] = []
    engine._step_streams = step_streams = list(streams)  # a step that fails from here fails the forks too
    row = 0
    for stream, share in zip(streams, plan.streams, strict=True):
        if not share.sample:
            continue
        forks, stream.forks = stream.forks, []
        for fork in forks:
            fork.position, fork.cached = share.end, stream.cached
            engine.scheduler.running.append(fork)
            step_streams.append(fork)
            if fork.request.cancelled.is_set():
                engine._end(fork, "cancelled")
                continue
            try:
                engine.memory.copy_state(stream.claim, fork.claim, share.end)
            except Exception as err:
                engine._stream_failed(fork, err)
                continue
            started.append(fork)
            rows.append(row)
        row += 1
    if not started:
        return drawn, logits, []
    index = torch.tensor([*range(len(drawn)), *rows], dtype=torch.int64).to(logits.device)
    return [*drawn, *started], logits.index_select(0, index), started


def first_tokens(engine: Host, forks: list[Stream], row: int, tokens: list[int], logits: torch.Tensor,
                 logprobs: list[Drawn] | None, now: float) -> None:
    """The started forks' first tokens, drawn at rows `row`... of the step's draw; one that fails fails alone."""
    for fork in forks:
        try:
            if not fork.ended:  # its grammar failed before the draw
                engine._sampled(fork, tokens[row], logits[row], now, logprobs[row] if logprobs is not None else None)
        except Exception as err:
            engine._stream_failed(fork, err)
        row += 1


def fork_event(event: Event, fork: Stream) -> Event:
    """The last event of a fork whose parent ended before its fork point with `event`: the same reason or error,
    with the fork's own counts."""
    if isinstance(event, DoneEvent):
        return DoneEvent(event.finish_reason, fork.prompt_len, fork.produced, fork.cached)
    return event
