"""Per-request token sampling; a seeded request draws the same tokens whatever else runs.

    the rule   every filter keeps the most likely token, so any parameters form a distribution:
               top_k keeps the k largest (ties kept), top_p the smallest most-likely-first set whose mass reaches
               top_p and at least the first token (a top_p that rounds to 0 in float32 samples the most likely
               token, as vLLM and HF do), min_p the tokens of at least min_p (at most 1) times the top probability;
               a temperature whose scaled logits overflow is applied to the logits less their maximum (the same
               distribution); a temperature above float32's largest is read as that largest
    refused    logits holding NaN or +inf, or all -inf (a masked row), raise NonFiniteLogits: the engine fails
               that request alone; -inf for some tokens is a mask and is sampled around
"""

from __future__ import annotations

import math
import secrets

import torch

from tensorfold.engine.api import Sampling

FLOAT32_MAX = torch.finfo(torch.float32).max


class NonFiniteLogits(ValueError):
    """The model's logits for one stream cannot be sampled from; the message says what they hold."""


class Sampler:
    """Turns one row of logits into a token with the request's own generator."""

    def __init__(self, sampling: Sampling) -> None:
        check(sampling)
        self.sampling = sampling
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def sample(self, logits: torch.Tensor) -> int:
        """A token id from float32 logits [vocab]; NonFiniteLogits when they hold NaN or +inf, or only -inf."""
        s = self.sampling
        logits = logits.detach().float().cpu()
        refuse_non_finite(logits)
        if s.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = self.probabilities(logits)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampled from after temperature, top-k, top-p and min-p (finite logits: see the rule)."""
        s = self.sampling
        temperature = min(s.temperature, FLOAT32_MAX)
        scaled = logits / temperature
        if not math.isfinite(scaled.max()):  # overflow past float32: shift first, same distribution
            scaled = (logits - logits.max()) / temperature
        if 0 < s.top_k < scaled.numel():
            kth = torch.topk(scaled, s.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if s.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            before = torch.cumsum(ordered, dim=-1) - ordered
            drop = before >= s.top_p
            drop[0] = False  # the most likely token always stays
            probs = probs.clone()
            probs[order[drop]] = 0.0
        if s.min_p > 0.0:
            probs = probs.masked_fill(probs < min(s.min_p, 1.0) * probs.max(), 0.0)
        return probs / probs.sum()


def refuse_non_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits unless the row's maximum is finite (NaN and +inf reach the maximum; all -inf is it)."""
    top = float(logits.max())
    if math.isfinite(top):
        return
    if math.isnan(top):
        what = f"NaN for {int(torch.isnan(logits).sum())} of {logits.numel()} tokens"
    elif top > 0:
        what = f"+inf for {int(torch.isposinf(logits).sum())} of {logits.numel()} tokens"
    else:
        what = f"-inf for all {logits.numel()} tokens"
    raise NonFiniteLogits(f"the model's logits hold {what}")


def check(sampling: Sampling) -> None:
    """Parameters no rule can read (the server refuses them first; this guards other callers): ValueError."""
    for name in ("temperature", "top_p", "min_p"):
        value = getattr(sampling, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"sampling {name} must be a finite number of at least 0, got {value!r}")
