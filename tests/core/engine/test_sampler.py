"""Sampling: greedy, seeded reproducibility, and what each filter lets through."""

from __future__ import annotations

import torch

from tensorfold.engine.api import Sampling
from tensorfold.engine.sampler import Sampler

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
