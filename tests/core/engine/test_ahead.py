"""Which streams a decode step launched ahead takes (engine/ahead.py): those that may go on past the step in
flight, each fed its row of that step's ids at the next position; the rest (ended, cancelled, ending by length)
have no row. What the rows compute is checked through a real family in tensorfold_qwen/tests/test_qwen_ahead.py."""

from __future__ import annotations

import torch

from tensorfold.engine.ahead import InFlight, ahead_of, is_decode
from tensorfold.engine.api import Request, Sampling
from tensorfold.engine.sampler import SampleRow
from tensorfold.engine.stream import Stream
from tensorfold.memory import Claim
from tensorfold.plan import StepPlan, StreamStep

CONTEXT = 64


def stream(slot: int, position: int, produced: int, max_tokens: int = 100) -> Stream:
    sampling = Sampling(temperature=0.0, max_tokens=max_tokens)
    request = Request(f"r{slot}", tuple(range(1, 11)), sampling, lambda event: None)
    return Stream(request, Claim(slot, None), SampleRow.of(sampling), position=position, produced=produced)


def in_flight(streams: list[Stream]) -> InFlight:
    plan = StepPlan(tuple(StreamStep(s.claim.slot, s.position, (7,)) for s in streams))
    ids = torch.arange(len(streams), dtype=torch.int64) + 100
    return InFlight.launched(plan, streams, ids, torch.zeros((len(streams), 8)), started=0.0)


def test_the_step_ahead_feeds_each_going_stream_its_row_at_the_next_position():
    streams = [stream(0, 10, 1), stream(3, 20, 5), stream(5, 15, 2)]
    step = in_flight(streams)
    plan, going = ahead_of(step, CONTEXT)
    assert going == streams
    assert plan.streams == (StreamStep(0, 11, (0,)), StreamStep(3, 21, (1,)), StreamStep(5, 16, (2,)))
    assert is_decode(plan) and step.ids() == [100, 101, 102]


def test_ended_cancelled_and_length_bound_streams_get_no_row():
    ended, cancelled = stream(0, 10, 1), stream(1, 10, 1)
    ended.ended = True
    cancelled.request.cancel()
    last_token = stream(2, 10, 4, max_tokens=5)      # its 5th token is in flight: max_tokens ends it there
    context_end = stream(3, CONTEXT - 2, 1)            # the row in flight is at CONTEXT - 2: the context ends it
    going = stream(4, CONTEXT - 3, 3, max_tokens=5)    # its 4th token is in flight, one more may follow
    step = in_flight([ended, cancelled, last_token, context_end, going])
    plan, streams = ahead_of(step, CONTEXT)
    assert streams == [going] and plan.streams == (StreamStep(4, CONTEXT - 2, (4,)),)
    going.ended = True
    assert ahead_of(step, CONTEXT) is None


def test_prefill_and_first_token_steps_are_not_decode():
    assert not is_decode(StepPlan((StreamStep(0, 0, (1, 2, 3)),)))
    assert not is_decode(StepPlan((StreamStep(0, 0, (1,)),)))
    assert not is_decode(StepPlan((StreamStep(0, 5, (1,), sample=False),)))
    assert is_decode(StepPlan((StreamStep(0, 5, (1,)), StreamStep(1, 9, (2,)))))
