"""Penalties and logprobs in the batched pass: the penalised logits equal a plain per-row reference (vLLM's rule),
a penalised row's token is the same alone and in any batch, and logprobs are the raw logits' log-softmax."""

from __future__ import annotations

import math

import pytest
import torch

from tensorfold.engine.api import Sampling
from tensorfold.engine.penalties import Penalties
from tensorfold.engine.sampler import Sampler, SampleRow, adjusted, logprobs_of

VOCAB = 300


def reference(row: torch.Tensor, prompt: list[int], output: list[int], repetition: float, frequency: float,
              presence: float) -> torch.Tensor:
    """vLLM's rule, one token at a time in Python."""
    out = row.clone()
    for token in range(len(out)):
        value = float(out[token])
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        count = output.count(token)
        value -= frequency * count + presence * (count > 0)
        out[token] = value
    return out


@pytest.mark.parametrize(("repetition", "frequency", "presence"), [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0),
                                                                    (1.0, 0.0, -1.5), (0.8, -0.4, 1.1)])
def test_penalised_logits_follow_the_reference(repetition, frequency, presence):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    prompt = [[5, 9, 9, 200], [], [7]]
    outputs = [[9, 9, 9, 11], [3, 3, 299], []]
    row = SampleRow.of(Sampling(temperature=0.0, repetition_penalty=repetition, frequency_penalty=frequency,
                                presence_penalty=presence))
    plain = SampleRow.of(Sampling(temperature=0.0))
    penalties = Penalties.of([0, 1], [row.penalties] * 2, outputs[:2],
                             [sorted(set(p)) if repetition != 1.0 else () for p in prompt[:2]])
    got = adjusted(logits, [row, row, plain], [0, 0, 0], penalties=penalties)
    for k in range(2):
        want = reference(logits[k], prompt[k] if repetition != 1.0 else [], outputs[k], repetition, frequency,
                         presence)
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-5)
    assert torch.equal(got[2], logits[2])  # a row without penalties is untouched


def test_a_penalised_rows_token_is_the_same_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(2)
    subject = torch.randn(VOCAB, generator=gen) * 4
    history = [int(t) for t in subject.topk(5).indices]  # its most likely tokens were already said
    for sampling in (Sampling(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0),
                     Sampling(seed=7, temperature=0.9, repetition_penalty=1.4)):
        row = SampleRow.of(sampling)
        alone = Sampler().sample(subject[None], [row], [4],
                                 penalties=Penalties.of([0], [row.penalties], [history], [history]))
        for size in (2, 5, 17):
            batch = torch.randn(size, VOCAB, generator=gen) * 4
            at = size // 2
            batch[at] = subject
            rows = [SampleRow.of(Sampling(seed=i, repetition_penalty=1.2)) for i in range(size)]
            rows[at] = row
            others = [i for i in range(size) if i != at]
            penalties = Penalties.of([at, *others], [row.penalties] + [rows[i].penalties for i in others],
                                     [history] + [[i % VOCAB] for i in others], [history] + [[1, 2]] * len(others))
            tokens = Sampler().sample(batch, rows, [4] * size, penalties=penalties)
            assert tokens[at] == alone[0]
        assert alone[0] not in history[:1] or sampling.temperature > 0


def test_logprobs_are_the_raw_log_softmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen) * 2
    found = logprobs_of(logits, [1, 3], [17, 250], [3, 0])
    want = logits.double().log_softmax(-1)
    assert math.isclose(found[0][0], float(want[1, 17]), rel_tol=0, abs_tol=1e-12)
    assert [t for t, _ in found[0][1]] == want[1].topk(3).indices.tolist()
    assert found[1][1] == () and math.isclose(found[1][0], float(want[3, 250]), abs_tol=1e-12)


def test_a_streams_output_counts_follow_its_output_one_step_at_a_time():
    from tensorfold.engine.api import Request
    from tensorfold.engine.stream import Stream

    request = Request("r", (1, 2), Sampling(frequency_penalty=1.0), lambda event: None)
    stream = Stream(request, claim=None, sample_row=SampleRow.of(request.sampling))
    draws = [[], [5], [5, 9], [7], [], [5, 5, 0]]
    for new in draws:
        stream.outputs += new
        counts = stream.output_counts(VOCAB, torch.device("cpu"))
        assert torch.equal(counts, torch.bincount(torch.tensor(stream.outputs, dtype=torch.int64),
                                                  minlength=VOCAB).float())
    assert stream.output_counts(VOCAB, torch.device("cpu")) is counts  # kept, not rebuilt
