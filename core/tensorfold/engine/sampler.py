"""Per-request token sampling; a seeded request draws the same tokens whatever else runs."""

from __future__ import annotations

import secrets

import torch

from tensorfold.engine.api import Sampling


class Sampler:
    """Turns one row of logits into a token with the request's own generator."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def sample(self, logits: torch.Tensor) -> int:
        """A token id from float32 logits [vocab]."""
        s = self.sampling
        logits = logits.detach().float().cpu()
        if s.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = self.probabilities(logits)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampled from after temperature, top-k, top-p and min-p."""
        s = self.sampling
        scaled = logits / s.temperature
        if 0 < s.top_k < scaled.numel():
            kth = torch.topk(scaled, s.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if s.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            before = torch.cumsum(ordered, dim=-1) - ordered
            drop = before >= s.top_p
            probs = probs.clone()
            probs[order[drop]] = 0.0
        if s.min_p > 0.0:
            probs = probs.masked_fill(probs < s.min_p * probs.max(), 0.0)
        return probs / probs.sum()
