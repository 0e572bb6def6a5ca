"""Sampling: greedy, seeded reproducibility, what each filter lets through, and that every parameter forms a
distribution (the most likely token always stays) while non-finite logits are refused."""

from __future__ import annotations

import attrs
import pytest
import torch

from tensorfold.engine.api import Sampling
from tensorfold.engine.sampler import NonFiniteLogits, Sampler

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_temperature_zero_is_argmax():
    assert Sampler(Sampling(temperature=0.0)).sample(LOGITS) == 0


def test_a_seed_reproduces_the_draws():
    one = Sampler(Sampling(seed=7))
    two = Sampler(Sampling(seed=7))
    assert [one.sample(LOGITS) for _ in range(20)] == [two.sample(LOGITS) for _ in range(20)]


def test_top_k_keeps_k():
    probs = Sampler(Sampling(top_k=2)).probabilities(LOGITS)
    assert (probs > 0).sum() == 2 and abs(probs[:2].sum().item() - 1) < 1e-6


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = torch.softmax(LOGITS, -1)
    probs = Sampler(Sampling(top_p=0.7)).probabilities(LOGITS)
    kept = int((probs > 0).sum())
    assert full[: kept - 1].sum() < 0.7 <= full[:kept].sum()


def test_min_p_drops_tokens_below_a_share_of_the_top():
    probs = Sampler(Sampling(min_p=0.3)).probabilities(LOGITS)
    full = torch.softmax(LOGITS, -1)
    assert torch.equal(probs > 0, full >= 0.3 * full.max())


def test_samples_follow_the_distribution():
    sampler = Sampler(Sampling(seed=1, temperature=1.0))
    counts = torch.bincount(torch.tensor([sampler.sample(LOGITS) for _ in range(3000)]), minlength=6).float()
    assert (counts / 3000 - torch.softmax(LOGITS, -1)).abs().max() < 0.03


@pytest.mark.parametrize(("sampling", "draws"), [
    (Sampling(seed=7), [0, 0, 1, 0, 0, 1, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 3, 2, 0, 1]),
    (Sampling(seed=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05),
     [0, 0, 1, 0, 0, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0]),
], ids=["plain", "every-filter"])
def test_seeded_draws_are_the_ones_they_always_were(sampling, draws):
    sampler = Sampler(sampling)
    assert [sampler.sample(LOGITS) for _ in range(len(draws))] == draws


@pytest.mark.parametrize("sampling", [Sampling(top_p=1e-46), Sampling(top_p=0.0), Sampling(min_p=5.0),
                                      Sampling(top_k=1, top_p=1e-46, min_p=1.0)],
                         ids=["top_p-rounds-to-0", "top_p-0", "min_p-over-1", "all-at-their-tightest"])
def test_the_most_likely_token_always_stays(sampling):
    assert Sampler(sampling).probabilities(LOGITS).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert {Sampler(attrs.evolve(sampling, seed=seed)).sample(LOGITS) for seed in range(16)} == {0}


def test_a_temperature_that_overflows_the_logits_is_the_same_distribution_shifted():
    huge = torch.tensor([3e38, 2.9e38, -3e38])
    probs = Sampler(Sampling(temperature=0.5)).probabilities(huge)
    assert torch.equal(probs, torch.softmax((huge - huge.max()) / 0.5, dim=-1)) and probs[0] == 1.0


def test_a_temperature_past_float32_is_uniform_over_the_unmasked_tokens():
    probs = Sampler(Sampling(temperature=1e300)).probabilities(torch.tensor([1.0, float("-inf"), 2.0]))
    assert probs.tolist() == [0.5, 0.0, 0.5]


def test_minus_inf_masks_tokens_that_are_never_drawn():
    masked = torch.tensor([float("-inf"), 0.0, float("-inf"), 0.0])
    sampler = Sampler(Sampling(seed=2))
    assert {sampler.sample(masked) for _ in range(64)} == {1, 3}


@pytest.mark.parametrize(("row", "what"), [
    ([1.0, float("nan"), 0.0], "NaN for 1 of 3 tokens"),
    ([float("inf"), float("inf"), 0.0], "+inf for 2 of 3 tokens"),
    ([float("-inf")] * 3, "-inf for all 3 tokens"),
], ids=["nan", "plus-inf", "all-minus-inf"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_non_finite_logits_are_refused(row, what, temperature):
    with pytest.raises(NonFiniteLogits) as refused:
        Sampler(Sampling(temperature=temperature)).sample(torch.tensor(row))
    assert str(refused.value) == f"the model's logits hold {what}"


@pytest.mark.parametrize(("field", "value"), [("temperature", float("nan")), ("top_p", -0.5),
                                              ("min_p", float("inf"))])
def test_parameters_no_rule_can_read_are_refused(field, value):
    with pytest.raises(ValueError, match=f"sampling {field} must be a finite number of at least 0"):
        Sampler(Sampling(**{field: value}))
