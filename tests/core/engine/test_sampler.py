"""Sampling one row: greedy, seeded reproducibility, the counter-based noise's exact bits, what each filter lets
through, and that every parameter forms a distribution (the most likely token always stays) while non-finite
logits are refused. (Batches, the distribution of the draws and the GPU: test_sampler_batch.py.)"""

from __future__ import annotations

import attrs
import pytest
import torch

from tensorfold.engine import noise
from tensorfold.engine.api import Sampling
from tensorfold.engine.sampler import NonFiniteLogits, Sampler, SampleRow, probabilities, refused

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
WORD = (1 << 64) - 1


def draws(logits: torch.Tensor, sampling: Sampling, count: int = 24) -> list[int]:
    """The tokens a request draws for its first `count` token indices from one row of logits, one step each."""
    row, sampler = SampleRow.of(sampling), Sampler()
    return [sampler.sample(logits[None], [row], [t])[0] for t in range(count)]


def splitmix(state: int, index: int) -> int:
    """The index-th output of splitmix64 seeded with `state`, in plain Python integers (the reference)."""
    z = (state + (index + 1) * noise.GAMMA) & WORD
    z = ((z ^ (z >> 30)) * noise.MIX1) & WORD
    z = ((z ^ (z >> 27)) * noise.MIX2) & WORD
    return z ^ (z >> 31)


def test_temperature_zero_is_argmax():
    assert draws(LOGITS, Sampling(temperature=0.0), 4) == [0] * 4


def test_a_seed_reproduces_the_draws_and_the_token_index_moves_them():
    assert draws(LOGITS, Sampling(seed=7)) == draws(LOGITS, Sampling(seed=7))
    assert len(set(draws(LOGITS, Sampling(seed=7)))) > 1
    assert draws(LOGITS, Sampling(seed=7)) != draws(LOGITS, Sampling(seed=8))


def test_an_unseeded_request_draws_its_own_seed():
    assert len({SampleRow.of(Sampling()).root for _ in range(8)}) == 8


@pytest.mark.parametrize("seed", [0, 1, 7, -1, -(2**63), 2**63, 2**64 - 1])
def test_the_noise_is_splitmix64_of_seed_token_index_and_vocab_position(seed):
    start = splitmix(seed % (1 << 64), -1)  # mix(seed): splitmix64's "-1-th" output is the finaliser alone
    assert noise.root(seed) == noise.signed(start)
    for t in (0, 1, 5, 1 << 40):
        key = noise.keys(torch.tensor([noise.root(seed)]), torch.tensor([t]))
        assert int(key[0]) == noise.signed(splitmix(start, t))
        u = noise.uniforms(key, noise.positions(40, "cpu"))[0].tolist()
        assert u == [((splitmix(splitmix(start, t), v) >> 12) + 0.5) / 2**52 for v in range(40)]


def test_signed_words_cover_every_seed_once():
    assert [noise.signed(s) for s in (0, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63))] == [
        0, 2**63 - 1, -(2**63), -1, -1, -(2**63)]


@pytest.mark.parametrize(("sampling", "drawn"), [
    (Sampling(seed=7), [1, 0, 0, 0, 1, 2, 0, 0, 0, 1, 0, 1, 1, 0, 1, 2, 0, 0, 4, 2, 0, 0, 2, 1]),
    (Sampling(seed=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05),
     [0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 2, 0]),
    (Sampling(seed=2**64 - 1, temperature=1.5),
     [1, 0, 1, 4, 0, 4, 0, 3, 2, 1, 5, 3, 0, 0, 0, 0, 4, 3, 4, 0, 0, 0, 3, 2]),
], ids=["plain", "every-filter", "largest-seed-hot"])
def test_seeded_draws_are_the_ones_they_always_were(sampling, drawn):
    assert draws(LOGITS, sampling) == drawn


def test_top_k_keeps_k():
    probs = probabilities(LOGITS, SampleRow.of(Sampling(top_k=2)))
    assert (probs > 0).sum() == 2 and abs(probs[:2].sum().item() - 1) < 1e-12


def test_top_k_keeps_ties_with_the_kth():
    probs = probabilities(torch.tensor([2.0, 1.0, 1.0, 0.0]), SampleRow.of(Sampling(top_k=2)))
    assert (probs > 0).tolist() == [True, True, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = torch.softmax(LOGITS.double(), -1)
    probs = probabilities(LOGITS, SampleRow.of(Sampling(top_p=0.7)))
    kept = int((probs > 0).sum())
    assert full[: kept - 1].sum() < 0.7 <= full[:kept].sum()
    assert torch.allclose(probs[:kept], full[:kept] / full[:kept].sum(), rtol=1e-12, atol=0)


def test_top_p_is_read_on_what_top_k_kept():
    kept = probabilities(LOGITS, SampleRow.of(Sampling(top_k=2, top_p=0.7)))  # of the two: 0.73 before 0.27
    assert (kept > 0).tolist() == [True, False, False, False, False, False]


def test_min_p_drops_tokens_below_a_share_of_the_top():
    probs = probabilities(LOGITS, SampleRow.of(Sampling(min_p=0.3)))
    full = torch.softmax(LOGITS.double(), -1)
    assert torch.equal(probs > 0, full >= 0.3 * full.max())


@pytest.mark.parametrize("sampling", [Sampling(top_p=1e-46), Sampling(top_p=0.0), Sampling(min_p=5.0),
                                      Sampling(top_k=1, top_p=1e-46, min_p=1.0)],
                         ids=["top_p-rounds-to-0", "top_p-0", "min_p-over-1", "all-at-their-tightest"])
def test_the_most_likely_token_always_stays(sampling):
    assert probabilities(LOGITS, SampleRow.of(sampling)).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert {draws(LOGITS, attrs.evolve(sampling, seed=seed), 4)[seed % 4] for seed in range(16)} == {0}


def test_a_temperature_that_overflows_the_logits_is_the_same_distribution_shifted():
    huge = torch.tensor([3e38, 2.9e38, -3e38])
    assert probabilities(huge, SampleRow.of(Sampling(temperature=0.5))).tolist() == [1.0, 0.0, 0.0]
    assert set(draws(huge, Sampling(temperature=1e-300, seed=1), 8)) == {0}


def test_a_temperature_past_float32_is_uniform_over_the_unmasked_tokens():
    probs = probabilities(torch.tensor([1.0, float("-inf"), 2.0]), SampleRow.of(Sampling(temperature=1e300)))
    assert probs.tolist() == [0.5, 0.0, 0.5]


def test_minus_inf_masks_tokens_that_are_never_drawn():
    masked = torch.tensor([float("-inf"), 0.0, float("-inf"), 0.0])
    assert set(draws(masked, Sampling(seed=2), 64)) == {1, 3}


@pytest.mark.parametrize(("row", "what"), [
    ([1.0, float("nan"), 0.0], "NaN for 1 of 3 tokens"),
    ([float("inf"), float("inf"), 0.0], "+inf for 2 of 3 tokens"),
    ([float("-inf")] * 3, "-inf for all 3 tokens"),
], ids=["nan", "plus-inf", "all-minus-inf"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_non_finite_logits_are_refused(row, what, temperature):
    logits = torch.tensor(row)
    assert draws(logits, Sampling(temperature=temperature, seed=1), 1) == [-1]
    error = refused(logits)
    assert isinstance(error, NonFiniteLogits) and str(error) == f"the model's logits hold {what}"


@pytest.mark.parametrize(("field", "value"), [("temperature", float("nan")), ("top_p", -0.5),
                                              ("min_p", float("inf"))])
def test_parameters_no_rule_can_read_are_refused(field, value):
    with pytest.raises(ValueError, match=f"sampling {field} must be a finite number of at least 0"):
        SampleRow.of(Sampling(**{field: value}))
