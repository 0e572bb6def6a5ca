"""The template family at TP=2 over gloo in real processes: greedy tokens equal TP=1's, concurrent == solo, the
same bits run to run, and a follower killed mid-run stops rank 0's engine with a clear reason instead of a hang.

Tolerance: every logits row rank 0 sampled from at TP=2 is within 1e-4 (absolute, float32) of TP=1's; the tokens
are compared exactly. TP=2 against TP=2 is bitwise (the reductions add the ranks' parts in rank order)."""

from __future__ import annotations

import pytest

from tensorfold.plugins import load_families
from tensorfold.testing.tp_world import Job, greedy_gap, replied, run_world, same_bits, tp1_and_tp2

LOGIT_ATOL = 1e-4
PROMPTS = (tuple(range(1, 20)), tuple(range(30, 41)), (5, 5, 5), tuple(range(100, 137)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-example")
    load_families(["example"])["example"].make_tiny(directory, seed=0)
    return directory


@pytest.fixture(scope="module")
def worlds(tiny, tmp_path_factory):
    """TP=1 once, TP=2 twice: rank 0's replies and logits rows."""
    return tp1_and_tp2(Job(family="example", model=tiny, prompts=PROMPTS), tmp_path_factory.mktemp("worlds"))


def test_tp2_greedy_tokens_equal_tp1(worlds):
    one, (two, _) = worlds
    rows, worst = greedy_gap(one, two, 12)
    assert rows >= len(PROMPTS) * 12 and worst <= LOGIT_ATOL, worst


def test_tp2_concurrent_equals_solo(worlds):
    _, runs = worlds
    assert all(replied(run["together"]) == replied(run["alone"]) for run in runs)


def test_tp2_is_the_same_bits_run_to_run(worlds):
    _, (first, second) = worlds
    assert same_bits(first, second)


def test_a_killed_follower_stops_rank_0_with_a_clear_reason(tiny, tmp_path):
    job = Job(family="example", model=tiny, prompts=PROMPTS, die_after=5, timeout_s=10.0)
    result, codes = run_world(2, job, tmp_path)
    assert codes[1] == -9                            # the follower was killed (SIGKILL)
    assert codes[0] == 0, (tmp_path / "rank0.error").read_text() if (tmp_path / "rank0.error").exists() else codes
    assert "a tensor-parallel rank is lost" in result["failure"]
    ends = [reply["end"] for reply in result["alone"] + result["together"]]
    assert ends and all("ErrorEvent" in end or "EngineDead" in end for end in ends), ends
