"""The glm decode step (decode.py) through the core's DecodeRunner on the CPU (graphs=False): the steps it covers
run `decode` on static buffers padded to 1, 2 or 4 rows and give the per-stream path's logits within the fp32 bound
(glm_decode_cases.TOLERANCE) and its greedy tokens, and a lone stream's step `forward`'s own bits (its one-token
row goes through `decode` too); padded rows leave an idle slot's states alone, the steps it does not cover fall
back to `forward`; and a real Engine with the runner, with and without steps launched ahead, gives every token and
finish reason of the engine without it."""

from __future__ import annotations

from functools import partial

import glm_decode_cases as cases
import pytest
import torch

from tensorfold.engine.graphs import DecodeRunner
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.testing.decode_engine import check_engine_with_decode, runner_covers_decode_steps


@pytest.fixture(scope="module")
def subjects(tmp_path_factory):
    return cases.load_subjects(tmp_path_factory.mktemp("glm-decode-runner"), ["tiny", "shared"], [torch.float32])


def test_the_runner_takes_decode_steps_and_falls_back_otherwise(subjects):
    subject = subjects["tiny", torch.float32]
    got, expected, chunk, decode = runner_covers_decode_steps(
        subject, cases.tokens(5, 0), cases.CONTEXT, cases.PAGE_ROWS, partial(cases.per_stream, subject.model))
    assert float((got - expected).abs().max()) <= cases.TOLERANCE[torch.float32]
    twin = subject.store(3, cases.CONTEXT, page_rows=cases.PAGE_ROWS)
    subject.model.forward(chunk, twin)
    assert cases.same_bytes(got, subject.model.forward(decode, twin))


@pytest.mark.parametrize("streams", [1, 3])
def test_the_runner_pads_and_matches_forward(subjects, streams):
    """runner.forward (static buffers padded to 1, 2 or 4 rows) against the per-stream path on a twin store, four
    steps."""
    subject = subjects["shared", torch.float32]
    prompts = {slot: 9 + 7 * slot for slot in range(streams)}
    reference, padded = (subject.store(cases.SLOTS, cases.CONTEXT, page_rows=cases.PAGE_ROWS) for _ in range(2))
    cases.prefill(subject, reference, prompts)
    cases.prefill(subject, padded, prompts)
    runner = DecodeRunner(subject.model, padded, sizes=(1, 2, 4), context=cases.CONTEXT, graphs=False)
    idle = cases.fixed_states(padded, cases.SLOTS - 1)
    position, worst = dict(prompts), 0.0
    for _ in range(4):
        plan = StepPlan(tuple(StreamStep(slot, position[slot], (position[slot] % 400 + 5,)) for slot in prompts))
        assert runner.covers(plan, padded)
        expected, got = cases.per_stream(subject.model, plan, reference), runner.forward(plan, padded)
        assert got.shape == expected.shape and torch.equal(expected.argmax(-1), got.argmax(-1))
        worst = max(worst, float((expected - got).abs().max()))
        for slot in prompts:
            position[slot] += 1
    assert worst <= cases.TOLERANCE[torch.float32]
    assert all(cases.same_bytes(a, b) for a, b in zip(idle, cases.fixed_states(padded, cases.SLOTS - 1), strict=True))


# ---------------------------------------------------------------- the engine


def test_an_engine_with_decode_gives_the_tokens_of_one_without(subjects):
    """Greedy and seeded requests through a CPU Engine: the decode runner (eager), with and without steps launched
    ahead, gives every token and finish reason the family's forward alone gives."""
    check_engine_with_decode(subjects["tiny", torch.float32], cases.tokens, cases.CONTEXT, cases.PAGE_ROWS)
