"""The glm family at TP=2 over gloo in real spawned processes, on its tiny checkpoint (KDA, MLA with its own DSA
indexer, dense and MoE feed-forwards, mHC): greedy tokens equal TP=1's, concurrent == solo, the same bits run to run.
A second checkpoint adds a shared-indexer MLA layer (it reuses the selection the layer before it made).

Tolerance: every logits row rank 0 sampled from at TP=2 is within 1e-4 (absolute, float32) of TP=1's; the tokens
are compared exactly (the measured differences: docs/families/glm.md, "Tensor parallelism").
DSA top-k ties: the indexer is whole on every rank, so its scores are the same bits on both ranks; against TP=1
they differ by the rounding of the reduced activations they are computed from, which can flip only a near tie (a
flipped pool would move a logits row far past the tolerance).
TP=2 against TP=2 is bitwise (every reduction adds the ranks' parts in rank order)."""

from __future__ import annotations

import pytest

from tensorfold.testing.tp_world import Job, greedy_gap, replied, same_bits, tp1_and_tp2
from tensorfold_glm import plugin

pytestmark = pytest.mark.slow

LOGIT_ATOL = 1e-4
# 37 + 12 rows hold 12 pools of 4 where the indexer keeps 4: its top-k picks; 19 rows cross the 16-token budget
PROMPTS = (tuple(range(1, 20)), tuple(range(30, 41)), (5, 5, 5), tuple(range(100, 137)))
SHARED = {"num_hidden_layers": 5,
          "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                          "indexed_attention"],
          "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
          "indexer_types": ["full", "full", "shared", "full", "full"]}


@pytest.fixture(scope="module", params=["tiny", "shared-indexer"])
def worlds(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    plugin.write_tiny(directory, seed=0, **(SHARED if request.param == "shared-indexer" else {}))
    job = Job(family="glm", model=directory, prompts=PROMPTS)
    return tp1_and_tp2(job, tmp_path_factory.mktemp(f"{request.param}-worlds"))


def test_tp2_greedy_tokens_equal_tp1(worlds):
    one, (two, _) = worlds
    rows, worst = greedy_gap(one, two, 12)
    print(f"\n[glm] TP=2 vs TP=1: max |logit difference| over {rows} sampled rows {worst:.2e}")
    assert rows >= len(PROMPTS) * 12 and worst <= LOGIT_ATOL, worst


def test_tp2_concurrent_equals_solo(worlds):
    _, runs = worlds
    assert all(replied(run["together"]) == replied(run["alone"]) for run in runs)


def test_tp2_is_the_same_bits_run_to_run(worlds):
    _, (first, second) = worlds
    assert same_bits(first, second)
