"""The TP declarations and the store journal, without processes: cuts, per-rank Layouts, refusals, replay."""

from __future__ import annotations

import pytest
import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.follow.rank import load_rank
from tensorfold.follow.sharded import ShardedCheckpoint
from tensorfold.kv import PagedStore
from tensorfold.kv.journal import Bind, Clear, Copy, Fill
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState
from tensorfold.shard import Shard, Split, StateSplit, TensorParallel

PARALLEL = TensorParallel(divides={"attention heads (num_attention_heads)": 4, "experts (num_experts)": 6},
                          params=[Split("*.qkv.weight", "column", parts=(4, 2, 2)), Split("*.o.*", "row"),
                                  Split("*.norm.weight", "replicated")],
                          states=[StateSplit("k", 0), StateSplit("ssm", 0, kind="linear")])


def test_refusals_name_what_does_not_divide():
    assert PARALLEL.refusals(2) == []
    assert PARALLEL.refusals(4) == ["--tensor-parallel-size 4 does not divide the experts (num_experts), 6"]
    assert len(PARALLEL.refusals(5)) == 2


def test_a_fused_column_tensor_gives_each_rank_its_heads_of_every_part():
    fused = torch.arange(8.0)[:, None].expand(8, 3)          # q rows 0-3, k rows 4-5, v rows 6-7
    assert PARALLEL.part("l.0.qkv.weight", fused, 0, 2)[:, 0].tolist() == [0, 1, 4, 6]
    assert PARALLEL.part("l.0.qkv.weight", fused, 1, 2)[:, 0].tolist() == [2, 3, 5, 7]


def test_row_cuts_inputs_keeps_its_bias_whole_and_unmatched_is_refused():
    weight = torch.arange(12.0).view(2, 6)
    assert PARALLEL.part("l.o.weight", weight, 1, 2).tolist() == [[3, 4, 5], [9, 10, 11]]
    assert PARALLEL.part("l.o.bias", torch.ones(2), 1, 2).shape == (2,)
    with pytest.raises(ValueError, match="l.up.weight matches no rule"):
        PARALLEL.part("l.up.weight", weight, 0, 2)
    with pytest.raises(ValueError, match=r"does not split in 4 along dim 1"):
        PARALLEL.part("l.o.weight", weight, 0, 4)


def test_a_rank_layout_splits_named_states_alone():
    layout = Layout([LayerLayout("attention", rows=[RowState("k", (4, 8), "float32"), RowState("c", (16,),
                                                                                                "float32")]),
                     LayerLayout("linear", fixed=[FixedState("ssm", (4, 8, 8), "float32")]),
                     LayerLayout("other", fixed=[FixedState("ssm", (4, 8, 8), "float32")])])
    cut = PARALLEL.layout(layout, 2)
    assert cut.layers[0].rows[0].shape == (2, 8) and cut.layers[0].rows[1].shape == (16,)   # a latent stays whole
    assert cut.layers[1].fixed[0].shape == (2, 8, 8) and cut.layers[2].fixed[0].shape == (4, 8, 8)
    with pytest.raises(ValueError, match=r"layer 0 \(attention\) state 'k' of shape \(4, 8\) does not split in 3"):
        PARALLEL.layout(layout, 3)


def test_an_axis_cuts_stacked_experts_off_a_linears_own_dims():
    gate_up = torch.arange(2 * 8 * 3.0).view(2, 8, 3)              # [experts, gate rows 0-3 | up rows 4-7, E]
    column = Split("*.gate_up", "column", parts=(4, 4), axis=1)
    parallel = TensorParallel(divides={}, params=[column, Split("*.down", "row", axis=-1)])
    cut = parallel.part("l.gate_up", gate_up, 1, 2)
    assert cut.shape == (2, 4, 3) and torch.equal(cut, gate_up[:, [2, 3, 6, 7]])
    down = torch.arange(2 * 3 * 4.0).view(2, 3, 4)                  # [experts, E, F]
    assert torch.equal(parallel.part("l.down", down, 0, 2), down[..., :2])
    assert Split("*", "row", axis=-1).dim(torch.ones(4)) is None     # a row rule's 1-D tensor stays whole


def test_a_state_split_by_parts_gives_each_rank_its_channels_of_every_piece():
    conv = StateSplit("conv", 0, kind="linear", parts=(4, 4, 8))
    whole = torch.arange(16.0)[:, None].expand(16, 3)               # q channels 0-3, k 4-7, v 8-15
    assert conv.part(whole, 0, 2)[:, 0].tolist() == [0, 1, 4, 5, 8, 9, 10, 11]
    assert conv.part(whole, 1, 2)[:, 0].tolist() == [2, 3, 6, 7, 12, 13, 14, 15]
    parallel = TensorParallel(divides={}, params=[], states=[conv])
    layout = Layout([LayerLayout("linear", fixed=[FixedState("conv", (16, 3), "float32")])])
    assert parallel.layout(layout, 2).layers[0].fixed[0].shape == (8, 3)
    with pytest.raises(ValueError, match=r"state 'conv' of shape \(16, 3\) \(parts \[4, 4, 8\]\) does not split "
                                         r"in 8 along dim 0"):
        parallel.layout(layout, 8)                                  # 16 splits in 8, its 4-channel pieces do not
    with pytest.raises(ValueError, match=r"does not split in 8 along dim 0"):
        conv.part(whole, 0, 8)


def test_a_state_of_pieces_is_cut_piece_by_piece():
    """A conv tail over [x | B | C] (8 + 2 + 2 channels): whole pieces must each divide, not just their sum."""
    parallel = TensorParallel(divides={}, params=[],
                              states=[StateSplit("conv", 0, kind="mamba", parts=(8, 2, 2))])
    layout = Layout([LayerLayout("mamba", fixed=[FixedState("conv", (12, 3), "float32")])])
    assert parallel.layout(layout, 2).layers[0].fixed[0].shape == (6, 3)
    with pytest.raises(ValueError, match=r"state 'conv' of shape \(12, 3\) \(parts \[8, 2, 2\]\) does not split "
                                         r"in 4 along dim 0"):
        parallel.layout(layout, 4)                       # 12 divides by 4, the B and C pieces of 2 do not
    wrong = TensorParallel(divides={}, params=[], states=[StateSplit("conv", 0, parts=(8, 2))])
    with pytest.raises(ValueError, match=r"\(parts \[8, 2\]\) does not split in 2"):
        wrong.layout(layout, 2)                          # the pieces must add up to the dim


def test_shard_split_and_single_reduce():
    assert Shard(0, 2).split(4, "heads") == 2
    with pytest.raises(ValueError, match="does not divide KV heads 3"):
        Shard(0, 2).split(3, "KV heads")
    x = torch.randn(3)
    assert Shard().reduce(x) is x


def test_a_rank_reads_its_slices_and_builds_its_part(example, tiny_dir):
    checkpoint = Checkpoint(tiny_dir)
    parallel = example.tensor_parallel(checkpoint.config)
    shard = Shard(1, 2)
    sliced = ShardedCheckpoint(checkpoint, parallel, shard)
    whole = checkpoint.tensor("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(sliced.tensor("model.layers.0.self_attn.q_proj.weight"), whole.chunk(2, 0)[1])
    assert torch.equal(sliced.tensor("model.norm.weight"), checkpoint.tensor("model.norm.weight"))
    model, layout = load_rank(example, checkpoint, torch.float32, torch.device("cpu"), shard)
    assert model.config.heads == 2 and model.config.kv_heads == 1 and model.config.intermediate_size == 64
    assert layout.layers[0].rows[0].shape == (1, 16)


def test_the_journal_replays_what_was_done_outside_the_forward():
    layout = Layout([LayerLayout("attention", rows=[RowState("k", (2,), "float32")],
                                 fixed=[FixedState("s", (2,), "float32")])])
    lead, follow = (PagedStore(layout, 2, 4, 2) for _ in range(2))
    lead.journal = []
    lead.fixed(0, "s", 0).fill_(3.0)
    follow.fixed(0, "s", 0).fill_(3.0)
    lead.clear(1)
    lead.bind(0, [2])
    lead.bind(1, [3])
    lead.fill([3])
    lead.copy_slot(0, 1, 0)
    assert lead.journal == [Clear(1), Bind(0, (2,)), Bind(1, (3,)), Fill((3,)), Copy(0, 1, 0)]
    for command in lead.journal:
        command.apply(follow)
    assert follow.journal is None
    assert follow.host_table(1) == (3,) and torch.equal(follow.fixed(0, "s", 1), torch.full((2,), 3.0))
