"""Each rank's states at TP=2 (gloo, real processes) are its heads of TP=1's: the GDN recurrent state by value
head, the conv tail by its q, k and v channel pieces, keys and values by KV head; through the reference, the
batched and the decode forwards, on the tiny dense and MoE checkpoints (tp_states.py runs the steps).

Tolerance: TP=2 logits and states within 1e-4 (absolute, float32) of TP=1's (`-s` prints the measured maxima);
both ranks' logits are the same bits (every rank reduces in rank order)."""

from __future__ import annotations

import pytest
import torch
import tp_states

from tensorfold.checkpoint import Checkpoint
from tensorfold.plugins import load_families
from tensorfold_qwen import plugin

pytestmark = pytest.mark.slow          # two spawned processes, three forwards of two checkpoints each

ATOL = 1e-4
KINDS = ("dense", "moe")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """TP=1 and each rank of TP=2, per checkpoint: (splits, one, two)."""
    models = []
    for kind in KINDS:
        directory = tmp_path_factory.mktemp(f"qwen-tp-states-{kind}")
        plugin.write_tiny(directory, seed=4, moe=kind == "moe")
        models.append(directory)
    one = tp_states.run_world(1, tuple(models), tmp_path_factory.mktemp("tp1"))[0]
    two = tp_states.run_world(2, tuple(models), tmp_path_factory.mktemp("tp2"))
    qwen = load_families(["qwen"])["qwen"]
    splits = [{s.name: s for s in qwen.tensor_parallel(Checkpoint(d).config).states} for d in models]
    return splits, one, two


def worst(pairs) -> float:
    return max(float((a - b).abs().max()) for a, b in pairs if a.numel())


@pytest.mark.parametrize("index", range(len(KINDS)))
def test_tp2_logits_of_every_forward_equal_tp1(runs, index):
    _, one, (rank0, rank1) = runs
    assert one[index]["decoded"] == rank0[index]["decoded"] == rank1[index]["decoded"] == 2
    for path in tp_states.PATHS:
        expected, got, other = (run[index]["logits"][path] for run in (one, rank0, rank1))
        assert all(torch.equal(a, b) for a, b in zip(got, other, strict=True)), path
        assert all(a.shape == b.shape for a, b in zip(expected, got, strict=True))
        assert [a.argmax(-1).tolist() for a in expected] == [b.argmax(-1).tolist() for b in got], path
        measured = worst(zip(expected, got, strict=True))
        print(f"{KINDS[index]} {path}: TP=2 vs TP=1 max |Δlogit| {measured:.2e}")
        assert measured <= ATOL, path


@pytest.mark.parametrize("index", range(len(KINDS)))
def test_each_ranks_states_are_its_heads_of_tp1s(runs, index):
    splits, one, two = runs
    for path in tp_states.PATHS:
        whole = one[index]["states"][path]
        pairs = []
        for rank, run in enumerate(two):
            held = run[index]["states"][path]
            assert held.keys() == whole.keys()
            for (layer, name, slot), state in held.items():
                split = splits[index][name]
                if name in ("k", "v"):                  # rows [end, KV, D]: cut by KV head, the state's dim 0
                    expected = torch.stack([split.part(row, rank, 2) for row in whole[(layer, name, slot)]])
                else:
                    expected = split.part(whole[(layer, name, slot)], rank, 2)
                assert state.shape == expected.shape, (layer, name, slot)
                pairs.append((expected, state))
        measured = worst(pairs)
        print(f"{KINDS[index]} {path}: TP=2 states vs TP=1's heads max |Δ| {measured:.2e} over {len(pairs)} states")
        assert measured <= ATOL, path
