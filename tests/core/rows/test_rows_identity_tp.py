"""The rows store's identity names the tensor-parallel world: at TP=1 its facts are the ones stores were written
with before TP (tp_world "1", no rank), so those stores keep their directory; above 1 they name the world and the
rank, so no two ranks, and no other world size, share a directory (tiers/disk_mirror.py)."""

from __future__ import annotations

import torch

from tensorfold.rows.api import identity_hash
from tensorfold.rows.identity import software_facts

CPU = torch.device("cpu")


def test_tp1_facts_are_unchanged_and_tp2_facts_name_the_world_and_the_rank():
    one = software_facts(CPU)
    assert sorted(one) == ["device", "fla-core", "tensorfold", "torch", "tp_world", "triton"]
    assert one["tp_world"] == "1" and software_facts(CPU, 1, 0) == one
    zero, first = software_facts(CPU, 2, 0), software_facts(CPU, 2, 1)
    assert (zero["tp_world"], zero["tp_rank"], first["tp_world"], first["tp_rank"]) == ("2", "0", "2", "1")
    assert {k: v for k, v in zero.items() if k not in ("tp_world", "tp_rank")} == \
        {k: v for k, v in one.items() if k != "tp_world"}
    assert len({identity_hash(one), identity_hash(zero), identity_hash(first),
                identity_hash(software_facts(CPU, 4, 1))}) == 4
