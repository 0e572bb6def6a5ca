"""The batched pass: greedy is torch.argmax exactly; a row's token (and the bits it is drawn from) is the same alone
and in any batch, at any place, whatever the other rows hold (greedy, seeded, filtered, non-finite, padding);
the draws follow the rule's distribution (chi-square over fixed seeds: deterministic); the rule matches a plain
per-row reference. The GPU tests (marked gpu) do the same on the device and compare its tokens with the CPU's."""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch

from tensorfold.engine import noise
from tensorfold.engine.api import Sampling
from tensorfold.engine.sampler import Sampler, SampleRow, adjusted, filtered, probabilities

CUDA = torch.cuda.is_available()
BATCHES = (1, 3, 8, 17, 64)
SUBJECTS = [
    Sampling(temperature=0.0),
    Sampling(seed=3),
    Sampling(seed=5, temperature=0.7, top_p=0.9),
    Sampling(seed=2**64 - 1, top_k=20),
    Sampling(seed=-(2**63), temperature=1.3, min_p=0.05),
    Sampling(seed=9, temperature=0.6, top_k=50, top_p=0.8, min_p=0.02),
    Sampling(seed=1, top_p=1e-46),
    Sampling(seed=11, temperature=1e-30),
    Sampling(seed=12, temperature=0.9, logit_bias=((3, 5.0), (40, -100.0), (77, 2.5))),
    Sampling(temperature=0.0, logit_bias=((5, 30.0),), min_tokens=1 << 31, stop_token_ids=(5, 6)),
    Sampling(seed=13, top_k=30, min_tokens=1 << 31, stop_token_ids=tuple(range(0, 400, 3))),
]  # the rows whose tokens are followed from batch to batch (the last two hold their stops back at any counter)
OTHERS = [*SUBJECTS, Sampling(seed=4, top_k=1), Sampling(seed=6, temperature=3.0, top_p=0.5), Sampling(min_p=1.0)]
KINDS = ("normal", "normal", "normal", "ties", "padding", "nan", "plus-inf", "minus-inf", "masked")


def logits_of(kind: str, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """One row of float32 logits: model-like, tied, a padding row's zeros, non-finite, or partly masked."""
    row = torch.randn(vocab, generator=gen) * 4
    if kind == "ties":
        row = torch.randint(0, 4, (vocab,), generator=gen).float()
    elif kind == "padding":
        row = torch.zeros(vocab)
    elif kind == "nan":
        row[torch.randint(0, vocab, (3,), generator=gen)] = float("nan")
    elif kind == "plus-inf":
        row[torch.randint(0, vocab, (1,), generator=gen)] = float("inf")
    elif kind == "minus-inf":
        row[:] = float("-inf")
    elif kind == "masked":
        row[torch.rand(vocab, generator=gen) < 0.5] = float("-inf")
    return row


def batch_around(subjects: list[torch.Tensor], size: int, vocab: int, gen: torch.Generator
                 ) -> tuple[torch.Tensor, list[SampleRow], list[int], list[int]]:
    """`size` rows: the subjects' at random places, random others around them (any kind, any parameters, any
    token index); the logits, rows, counters and the subjects' places."""
    places = torch.randperm(size, generator=gen)[: len(subjects)].tolist()
    logits = torch.empty(size, vocab)
    rows, counters = [], []
    for i in range(size):
        kind = KINDS[int(torch.randint(0, len(KINDS), (1,), generator=gen))]
        logits[i] = logits_of(kind, vocab, gen)
        rows.append(SampleRow.of(OTHERS[int(torch.randint(0, len(OTHERS), (1,), generator=gen))]))
        counters.append(int(torch.randint(0, 1 << 20, (1,), generator=gen)))
    for subject, place in zip(subjects, places, strict=False):
        logits[place] = subject
    return logits, rows, counters, places


def scores(logits: torch.Tensor, rows: list[SampleRow], counters: list[int]) -> torch.Tensor:
    """What the pass takes the argmax of for sampled rows: kept x plus noise, float64 [R, V] (the bits compared)."""
    params = torch.tensor([row.values for row in rows], dtype=torch.float64, device=logits.device)
    logits = adjusted(logits, rows, counters)
    kept = filtered(logits, logits.amax(dim=-1), params, any(row.sorts for row in rows))
    keys = noise.keys(torch.tensor([row.root for row in rows]), torch.tensor(counters)).to(logits.device)
    return kept + noise.gumbel(keys, noise.positions(logits.shape[1], logits.device))


def check_invariance(device: str, vocab: int, batches: tuple[int, ...], seed: int, repeats: int = 2) -> None:
    """Each subject's token, and for a sampled one its score bits, alone == in every batch."""
    gen = torch.Generator().manual_seed(seed)
    subjects = [logits_of(("normal", "ties", "masked")[i % 3], vocab, gen) for i in range(len(SUBJECTS))]
    mine = [SampleRow.of(s) for s in SUBJECTS]
    counters = [int(c) for c in torch.randint(0, 1 << 30, (len(SUBJECTS),), generator=gen)]
    sampler = Sampler()
    alone = [sampler.sample(row[None].to(device), [r], [c])[0] for row, r, c in zip(subjects, mine, counters,
                                                                                       strict=True)]
    bits = {i: scores(subjects[i][None].to(device), [mine[i]], [counters[i]])[0]
            for i in range(len(SUBJECTS)) if not mine[i].greedy}
    for size in batches:
        for _ in range(repeats):
            count = min(size, len(SUBJECTS))
            pick = torch.randperm(len(SUBJECTS), generator=gen)[:count].tolist()
            logits, rows, steps, places = batch_around([subjects[i] for i in pick], size, vocab, gen)
            for i, place in zip(pick, places, strict=True):
                rows[place], steps[place] = mine[i], counters[i]
            logits = logits.to(device)
            tokens = sampler.sample(logits, rows, steps)
            assert [tokens[place] for place in places] == [alone[i] for i in pick], f"batch of {size}"
            drawn = [p for p, row in enumerate(rows) if not row.greedy]
            if not drawn:
                continue
            batch_scores = scores(logits[drawn], [rows[p] for p in drawn], [steps[p] for p in drawn])
            for i, place in zip(pick, places, strict=True):
                if i in bits:
                    assert torch.equal(batch_scores[drawn.index(place)], bits[i]), f"scores in a batch of {size}"


@pytest.mark.parametrize("vocab", [500, 4099])
def test_a_row_is_the_same_alone_and_in_any_batch(vocab):
    check_invariance("cpu", vocab, BATCHES, seed=vocab)


@pytest.mark.slow
def test_a_row_is_the_same_alone_and_in_any_batch_at_a_real_vocabulary():
    check_invariance("cpu", 151936, (1, 17), seed=1, repeats=1)


def test_greedy_is_torch_argmax_exactly():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, (64, 4099), generator=gen).float()  # many ties: the lowest id wins
    logits[5, :] = 2.5
    tokens = Sampler().sample(logits, [SampleRow.of(Sampling(temperature=0.0))] * 64, [0] * 64)
    assert tokens == logits.argmax(dim=-1).tolist() and tokens[5] == 0


def test_non_finite_rows_come_back_as_minus_one_and_alone():
    gen = torch.Generator().manual_seed(3)
    kinds = ["normal", "nan", "normal", "plus-inf", "minus-inf", "masked", "nan"]
    logits = torch.stack([logits_of(kind, 300, gen) for kind in kinds])
    rows = [SampleRow.of(Sampling(seed=i, temperature=0.0 if i % 2 else 0.8, top_p=0.95)) for i in range(7)]
    tokens = Sampler().sample(logits, rows, list(range(7)))
    bad = {i for i, kind in enumerate(kinds) if kind in ("nan", "plus-inf", "minus-inf")}
    assert {i for i, token in enumerate(tokens) if token == -1} == bad
    for i in set(range(7)) - bad:
        assert tokens[i] == Sampler().sample(logits[i: i + 1], [rows[i]], [i])[0]


def reference(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The rule read plainly, one row in float64: temperature, top_k (ties kept), top_p on what top_k kept (the
    tokens tied with its last kept), min_p against the top probability; renormalised."""
    x = logits.double()
    x = (x - x.max()) / s.temperature
    order = torch.argsort(x, descending=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < s.top_k < x.numel():
        keep &= x >= x[order[s.top_k - 1]]
    p = torch.softmax(x.masked_fill(~keep, -math.inf), -1)
    if s.top_p < 1.0:
        ordered = p[order]
        before = torch.cumsum(ordered, 0) - ordered
        last = max(int((before < s.top_p).sum()), 1)
        keep &= x >= x[order[last - 1]]
    keep &= p >= min(s.min_p, 1.0) * p.max()
    return torch.softmax(x.masked_fill(~keep, -math.inf), -1)


RULES = [Sampling(), Sampling(temperature=0.7), Sampling(top_k=7), Sampling(top_p=0.8), Sampling(min_p=0.1),
         Sampling(temperature=1.4, top_k=20, top_p=0.9, min_p=0.01), Sampling(temperature=0.9, top_p=0.6, top_k=3)]


@pytest.mark.parametrize("sampling", RULES, ids=[str(i) for i in range(len(RULES))])
def test_the_rule_is_the_plain_per_row_reference(sampling):
    gen = torch.Generator().manual_seed(11)
    for _ in range(100):
        logits = torch.randn(60, generator=gen) * 3
        ours, theirs = probabilities(logits, SampleRow.of(sampling)), reference(logits, sampling)
        assert torch.equal(ours > 0, theirs > 0)
        assert torch.allclose(ours, theirs, rtol=1e-9, atol=0)


DRAWS = 24000
SPREAD = torch.tensor([2.0, 1.6, 1.5, 1.0, 0.7, 0.2, 0.0, -0.5, -1.0, -2.0, -4.0, float("-inf")])


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square test's p-value of counts against probabilities over their support."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    freedom = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("over", ["token-indices", "seeds"])
@pytest.mark.parametrize("sampling", RULES, ids=[str(i) for i in range(len(RULES))])
def test_the_draws_follow_the_distribution(sampling, over):
    """DRAWS draws of one row, over token indices 0.. of seed 1 or over seeds 0.. at token index 0: none outside
    the kept set, and a chi-square p-value above 1e-3 against the per-row reference (fixed seeds: the same
    verdict every run); the same draws against a hotter one (1.5× the temperature) are rejected (the test has teeth)."""
    if over == "seeds":
        rows = [SampleRow.of(attrs.evolve(sampling, seed=seed)) for seed in range(DRAWS)]
        counters = [0] * DRAWS
    else:
        rows, counters = [SampleRow.of(attrs.evolve(sampling, seed=1))] * DRAWS, list(range(DRAWS))
    tokens = torch.tensor(Sampler().sample(SPREAD.expand(DRAWS, -1), rows, counters))
    counts = torch.bincount(tokens, minlength=SPREAD.numel()).double()
    probs = reference(SPREAD, sampling)
    assert counts[probs == 0].sum() == 0
    assert chi_square_p(counts, probs) > 1e-3
    wrong = reference(SPREAD, attrs.evolve(sampling, temperature=sampling.temperature * 1.5))
    if torch.equal(wrong > 0, probs > 0) and int((probs > 0).sum()) > 1:
        assert chi_square_p(counts, wrong) < 1e-6


# -- on the device ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("vocab", [4099, 151936])
def test_gpu_a_row_is_the_same_alone_and_in_any_batch(vocab):
    check_invariance("cuda", vocab, (*BATCHES, 256), seed=vocab + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_noise_bits_are_the_cpus():
    """The uniforms are int64 arithmetic: the same bits; the float64 logs after them agree within an ulp or two."""
    roots = torch.tensor([SampleRow.of(Sampling(seed=s)).root for s in range(64)])
    keys = noise.keys(roots, torch.arange(64) * 977)
    cpu = noise.uniforms(keys, noise.positions(151936, "cpu"))
    gpu_u = noise.uniforms(keys.cuda(), noise.positions(151936, "cuda")).cpu()
    assert torch.equal(cpu, gpu_u)
    g_cpu = noise.gumbel(keys, noise.positions(151936, "cpu"))
    g_gpu = noise.gumbel(keys.cuda(), noise.positions(151936, "cuda")).cpu()
    differ = int((g_cpu != g_gpu).sum())
    print(json.dumps({"bench": "gumbel_cpu_vs_gpu", "values": g_cpu.numel(), "differ": differ,
                      "max_abs": float((g_cpu - g_gpu).abs().max())}))
    assert torch.allclose(g_cpu, g_gpu, rtol=4e-16, atol=4e-16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_tokens_are_the_cpus_for_equal_logits():
    """Equal logits on the CPU and the GPU: greedy rows the same token; seeded rows too (their noise is equal
    up to the logs' last ulp, which moves a draw only when two scores tie that closely)."""
    gen = torch.Generator().manual_seed(5)
    agree, total = 0, 0
    for size in (8, 64):
        logits, rows, counters, _ = batch_around([], size, 151936, gen)
        cpu = Sampler().sample(logits, rows, counters)
        gpu_tokens = Sampler().sample(logits.cuda(), rows, counters)
        greedy = [i for i, row in enumerate(rows) if row.greedy]
        assert [gpu_tokens[i] for i in greedy] == [cpu[i] for i in greedy]
        agree += sum(a == b for a, b in zip(cpu, gpu_tokens, strict=True))
        total += size
    print(json.dumps({"bench": "tokens_cpu_vs_gpu", "rows": total, "agree": agree}))
    assert agree == total


def test_logit_bias_is_added_before_every_rule():
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(300, generator=gen) * 3
    bias = ((7, 4.0), (8, -100.0), (299, 1.5))
    for sampling in (Sampling(seed=1), Sampling(seed=1, temperature=0.6, top_p=0.8, top_k=40, min_p=0.01)):
        shifted = logits.clone()
        for token, value in bias:
            shifted[token] += value
        ours = probabilities(logits, SampleRow.of(attrs.evolve(sampling, logit_bias=bias)))
        assert torch.equal(ours, probabilities(shifted, SampleRow.of(sampling)))
    pushed = Sampling(temperature=0.0, logit_bias=((123, 100.0),))
    assert Sampler().sample(logits[None].repeat(3, 1), [SampleRow.of(pushed)] * 3, [0, 5, 9]) == [123] * 3


def test_min_tokens_holds_the_stop_tokens_back_until_the_counter_reaches_it():
    gen = torch.Generator().manual_seed(22)
    logits = torch.randn(300, generator=gen)
    stop = int(logits.argmax())
    logits[stop] += 50.0                                 # the stop token is the greedy choice by far
    row = SampleRow.of(Sampling(temperature=0.0, min_tokens=3, stop_token_ids=(stop, 2)))
    tokens = Sampler().sample(logits[None].repeat(5, 1), [row] * 5, [0, 1, 2, 3, 4])
    held = int(logits.clone().index_fill_(0, torch.tensor([stop, 2]), float("-inf")).argmax())
    assert tokens == [held, held, held, stop, stop]
    sampled = SampleRow.of(Sampling(seed=4, min_tokens=2, stop_token_ids=(stop,)))
    assert probabilities(logits, sampled, counter=1)[stop] == 0.0
    assert probabilities(logits, sampled, counter=2)[stop] > 0.99
