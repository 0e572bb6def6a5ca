"""Prompt logprobs (Sampling.prompt_logprobs): every prompt token's logprob equals the model's own one-shot
forward over the prompt, chunk by chunk through the engine; the request never resumes, its neighbours' tokens and
its own reply are those of a run without them, and max_tokens 0 ends after the prompt."""

from __future__ import annotations

import attrs
import pytest
import torch

from tensorfold.engine.api import KeepMarks, Sampling
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.testing import kit
from tensorfold.testing.engine_gates import Client, Rig, ask, running
from tensorfold.testing.fixtures import one_thread  # noqa: F401  (autouse: a tiny model gains nothing from threads)
from tensorfold.tiers.device import DeviceTier

RIG = Rig(context=256, chunk=32, min_chunk=8, page_rows=16, max_waiting=8)
TOP = 3


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((i * 37 + salt * 11) % 480 + 5 for i in range(n))


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def oracle(subject, tokens: tuple[int, ...]) -> torch.Tensor:
    """log_softmax of every row's logits in one pass over the whole prompt (forward_all), float64."""
    kv = subject.store(1, RIG.context)
    logits = subject.model.forward_all(StepPlan((StreamStep(0, 0, tokens),)), kv)
    return logits.double().log_softmax(-1)


def check_entries(entries: list, tokens: tuple[int, ...], want: torch.Tensor) -> None:
    assert len(entries) == len(tokens)
    assert entries[0] == (tokens[0], None, ())
    for p, (token, logprob, top) in enumerate(entries[1:], start=1):
        row = want[p - 1]
        assert token == tokens[p]
        assert logprob == pytest.approx(float(row[token]), abs=1e-5)
        best = row.topk(TOP)
        assert [t for t, _ in top] == best.indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(best.values.tolist(), abs=1e-5)


@pytest.mark.parametrize("length", [1, 5, 32, 90])
def test_prompt_logprobs_equal_a_one_shot_forward(subject, length):
    tokens = prompt(length, length)
    sampling = Sampling(temperature=0.0, max_tokens=4, prompt_logprobs=TOP)
    eng = RIG.engine(subject, RIG.memory(subject))
    with running(eng):
        client = Client("scored", tokens, sampling)
        done = ask(eng, client)
    check_entries(client.prompt_entries, tokens, oracle(subject, tokens))
    assert done.completion_tokens == 4
    assert client.tokens == RIG.fresh(subject, tokens, attrs.evolve(sampling, prompt_logprobs=None))


def test_max_tokens_zero_scores_the_prompt_alone(subject):
    tokens = prompt(70, 3)
    eng = RIG.engine(subject, RIG.memory(subject))
    with running(eng):
        client = Client("zero", tokens, Sampling(temperature=0.0, max_tokens=0, prompt_logprobs=TOP))
        done = ask(eng, client)
    assert (done.finish_reason, done.completion_tokens, client.tokens) == ("length", 0, [])
    check_entries(client.prompt_entries, tokens, oracle(subject, tokens))


def test_a_scored_request_never_resumes_and_leaves_its_neighbours_alone(subject):
    tokens = prompt(100, 7)
    plain = Sampling(temperature=0.0, max_tokens=6)
    others = [(prompt(60 + 9 * i, 20 + i), Sampling(temperature=0.9, seed=i, max_tokens=8)) for i in range(3)]
    solo = [RIG.fresh(subject, p, s) for p, s in others]
    mem = RIG.memory(subject, parallel=4)
    eng = RIG.engine(subject, mem, tier=DeviceTier(mem, budget=1 << 30))
    with running(eng):
        kept = KeepMarks(history=96)
        assert ask(eng, Client("first", tokens, plain, marks=kept)).cached_tokens == 0
        assert ask(eng, Client("again", tokens, plain, marks=kept)).cached_tokens > 0  # a state of it is kept
        clients = [Client(f"n{i}", p, s) for i, (p, s) in enumerate(others)]
        scored = Client("scored", tokens, attrs.evolve(plain, prompt_logprobs=TOP), marks=kept)
        for one in (clients[0], scored, *clients[1:]):
            eng.submit(one.request)
        dones = [one.result() for one in (*clients, scored)]
    assert dones[-1].cached_tokens == 0  # it prefilled the whole prompt, every row scored
    check_entries(scored.prompt_entries, tokens, oracle(subject, tokens))
    assert [one.tokens for one in clients] == solo
    assert scored.tokens == RIG.fresh(subject, tokens, plain)
