"""Grammar masks and penalties in the batched pass on each device: a constrained row's token the same alone and in
any batch, drawn among the allowed tokens, and on the GPU (masks and counts copied from pinned host memory without
waiting for the device) the same tokens as on the CPU for equal logits."""

from __future__ import annotations

import pytest
import torch

from tensorfold.engine.api import Sampling
from tensorfold.engine.grammar import mask_words
from tensorfold.engine.penalties import Penalties
from tensorfold.engine.sampler import Allowed, Sampler, SampleRow

CUDA = torch.cuda.is_available()
VOCAB = 151936
SIZES = (1, 8, 64)


def packed(keep: torch.Tensor) -> torch.Tensor:
    """Booleans [V] as the int32 bitmask words llguidance fills (bit t % 32 of word t // 32)."""
    bits = torch.zeros(mask_words(len(keep)) * 32, dtype=torch.int64)
    bits[: len(keep)] = keep.long()
    words = (bits.view(-1, 32) << torch.arange(32)).sum(1)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def steps(device: str, sampling: Sampling) -> tuple[list[list[int]], torch.Tensor]:
    """The same constrained subject row in batches of SIZES among penalised rows: every batch's tokens, and the mask."""
    gen = torch.Generator().manual_seed(7)
    subject = torch.randn(VOCAB, generator=gen) * 4
    keep = torch.rand(VOCAB, generator=gen) < 0.1
    found = []
    for size in SIZES:
        at = size // 2
        logits = torch.randn(size, VOCAB, generator=gen) * 4
        logits[at] = subject
        rows = [SampleRow.of(Sampling(seed=i, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2))
                for i in range(size)]
        rows[at] = SampleRow.of(sampling)
        others = [i for i in range(size) if i != at]
        outputs = [torch.randint(0, VOCAB, (20,), generator=gen).tolist() for _ in others]
        penalties = Penalties.of(others, [rows[i].penalties for i in others], outputs, [o[:5] for o in outputs])
        allowed = Allowed.empty([at], VOCAB, torch.device(device))
        allowed.bits[0] = packed(keep)
        found.append(Sampler().sample(logits.to(device), rows, [2] * size, allowed, penalties if others else None))
    return found, keep


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0), Sampling(seed=3, temperature=0.8, top_p=0.9)])
def test_a_masked_row_is_the_same_alone_and_among_penalised_rows(sampling):
    found, keep = steps("cpu", sampling)
    picks = {tokens[size // 2] for tokens, size in zip(found, SIZES, strict=True)}
    assert len(picks) == 1 and bool(keep[picks.pop()])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0), Sampling(seed=3, temperature=0.8, top_p=0.9)])
def test_gpu_masked_and_penalised_rows_match_the_cpu(sampling):
    assert steps("cuda", sampling)[0] == steps("cpu", sampling)[0]
