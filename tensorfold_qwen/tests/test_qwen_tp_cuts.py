"""The qwen family's tensor-parallel cuts without processes (parallel.py): each rank's slice of every fused tensor
holds its own heads of every piece, both expert forms cut the same, each rank's Layout, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_qwen_load_experts import fused

from tensorfold.checkpoint import Checkpoint
from tensorfold.family import PluginError
from tensorfold.follow.rank import load_rank, rank_layout
from tensorfold.follow.sharded import ShardedCheckpoint
from tensorfold.plugins import load_families
from tensorfold.shard import Shard
from tensorfold_qwen import plugin
from tensorfold_qwen.config import QwenConfig
from tensorfold_qwen.mlp import MoeWeights

WORLD = 2
H, KV, D = 4, 2, 16                 # the tiny checkpoints' attention heads, KV heads, head_dim
NK, NV, DK, DV = 2, 4, 16, 16       # their GDN key and value heads and dims
E = 64


@pytest.fixture(scope="module")
def qwen():
    return load_families(["qwen"])["qwen"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen-tp-dense")
    plugin.write_tiny(directory, seed=5)
    return directory


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen-tp-moe")
    plugin.write_tiny(directory, seed=6, moe=True)
    return directory


def heads(rank: int, count: int) -> range:
    """The heads of `count` rank `rank` holds."""
    share = count // WORLD
    return range(rank * share, (rank + 1) * share)


def rows(tensor: torch.Tensor, per_head: int, picked: range) -> torch.Tensor:
    """The rows of heads `picked`, each head `per_head` rows."""
    return torch.cat([tensor[h * per_head:(h + 1) * per_head] for h in picked])


def sliced(directory: Path, qwen, rank: int) -> tuple[Checkpoint, ShardedCheckpoint]:
    checkpoint = Checkpoint(directory)
    return checkpoint, ShardedCheckpoint(checkpoint, qwen.tensor_parallel(checkpoint.config), Shard(rank, WORLD))


@pytest.mark.parametrize("rank", [0, 1])
def test_attention_cuts_whole_gated_heads_and_keeps_the_norms(dense, qwen, rank):
    whole, part = sliced(dense, qwen, rank)
    layer = "model.layers.1.self_attn."                                   # layer 1 is full attention
    q = whole.tensor(layer + "q_proj.weight")                             # [H·2D, E]: per head D query, D gate rows
    assert torch.equal(part.tensor(layer + "q_proj.weight"), rows(q, 2 * D, heads(rank, H)))
    for name in ("k_proj", "v_proj"):
        assert torch.equal(part.tensor(layer + f"{name}.weight"),
                           rows(whole.tensor(layer + f"{name}.weight"), D, heads(rank, KV)))
    o = whole.tensor(layer + "o_proj.weight")                             # [E, H·D]: inputs by head
    assert torch.equal(part.tensor(layer + "o_proj.weight"), rows(o.T, D, heads(rank, H)).T)
    for name in ("q_norm", "k_norm"):
        assert torch.equal(part.tensor(layer + f"{name}.weight"), whole.tensor(layer + f"{name}.weight"))


@pytest.mark.parametrize("rank", [0, 1])
def test_gdn_cuts_each_piece_of_the_fused_projection_and_conv_by_head(dense, qwen, rank):
    whole, part = sliced(dense, qwen, rank)
    layer = "model.layers.0.linear_attn."                                 # layer 0 is Gated DeltaNet
    for name, squeeze in (("in_proj_qkv.weight", False), ("conv1d.weight", True)):
        full = whole.tensor(layer + name)                                 # [q NK·DK | k NK·DK | v NV·DV, ...]
        q, k, v = full.split([NK * DK, NK * DK, NV * DV])
        expected = torch.cat([rows(q, DK, heads(rank, NK)), rows(k, DK, heads(rank, NK)),
                              rows(v, DV, heads(rank, NV))])
        got = part.tensor(layer + name)
        assert got.shape[0] == (2 * NK * DK + NV * DV) // WORLD and torch.equal(got, expected), name
        assert not squeeze or got.shape[1:] == (1, 4)
    assert torch.equal(part.tensor(layer + "in_proj_z.weight"),
                       rows(whole.tensor(layer + "in_proj_z.weight"), DV, heads(rank, NV)))
    for name in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        assert torch.equal(part.tensor(layer + name), rows(whole.tensor(layer + name), 1, heads(rank, NV))), name
    out = whole.tensor(layer + "out_proj.weight")                         # [E, NV·DV]
    assert torch.equal(part.tensor(layer + "out_proj.weight"), rows(out.T, DV, heads(rank, NV)).T)
    assert torch.equal(part.tensor(layer + "norm.weight"), whole.tensor(layer + "norm.weight"))


def test_mlp_embeddings_and_norms(dense, qwen):
    whole, part = sliced(dense, qwen, 1)
    mlp = "model.layers.2.mlp."
    for name in ("gate_proj", "up_proj"):
        assert torch.equal(part.tensor(mlp + f"{name}.weight"), whole.tensor(mlp + f"{name}.weight")[64:])
    assert torch.equal(part.tensor(mlp + "down_proj.weight"), whole.tensor(mlp + "down_proj.weight")[:, 64:])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.2.input_layernorm.weight", "model.layers.2.post_attention_layernorm.weight"):
        assert torch.equal(part.tensor(name), whole.tensor(name)), name


def test_moe_cuts_every_experts_columns_and_keeps_the_router(moe, qwen):
    whole, part = sliced(moe, qwen, 1)
    mlp = "model.layers.0.mlp."
    for prefix, F in ((f"{mlp}experts.5.", 32), (f"{mlp}shared_expert.", 64)):
        for name in ("gate_proj", "up_proj"):
            assert torch.equal(part.tensor(f"{prefix}{name}.weight"),
                               whole.tensor(f"{prefix}{name}.weight")[F // 2:]), prefix + name
        assert torch.equal(part.tensor(f"{prefix}down_proj.weight"),
                           whole.tensor(f"{prefix}down_proj.weight")[:, F // 2:])
    for name in ("gate.weight", "shared_expert_gate.weight"):
        assert torch.equal(part.tensor(mlp + name), whole.tensor(mlp + name))


@pytest.mark.parametrize("rank", [0, 1])
def test_both_expert_forms_give_a_rank_the_same_experts(moe, qwen, tmp_path, rank):
    """Fused experts [N, 2F, E] are cut along their columns, gate and up rows each on their own."""
    config = json.loads((moe / "config.json").read_text())
    shutil.copy(moe / "config.json", tmp_path / "config.json")
    tensors = load_file(moe / "model.safetensors")
    save_file(fused(tensors, config), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    built = [load_rank(qwen, Checkpoint(directory), torch.float32, torch.device("cpu"), Shard(rank, WORLD))[0]
             for directory in (moe, tmp_path)]
    half = slice(rank * 16, (rank + 1) * 16)
    for i in range(4):
        per_expert, from_fused = (model.weights.layers[i].ffn for model in built)
        assert isinstance(per_expert, MoeWeights) and per_expert.gate_up.shape == (8, 32, E)
        assert torch.equal(per_expert.gate_up, from_fused.gate_up) and torch.equal(per_expert.down, from_fused.down)
        prefix = f"model.layers.{i}.mlp.experts.3."
        assert torch.equal(from_fused.gate_up[3], torch.cat([tensors[prefix + "gate_proj.weight"][half],
                                                             tensors[prefix + "up_proj.weight"][half]]))
        assert torch.equal(from_fused.down[3], tensors[prefix + "down_proj.weight"][:, half])


def test_a_rank_holds_its_share_of_every_head_and_state(moe, qwen):
    checkpoint = Checkpoint(moe)
    model, layout = load_rank(qwen, checkpoint, torch.float32, torch.device("cpu"), Shard(0, WORLD))
    c = model.config
    assert (c.heads, c.kv_heads, c.k_heads, c.v_heads, c.conv_dim) == (2, 1, 1, 2, 64)
    assert (c.moe_intermediate_size, c.shared_intermediate_size, c.experts, c.top_k) == (16, 32, 8, 2)
    shapes = [{s.name: s.shape for s in layer.rows + layer.fixed} for layer in layout.layers]
    assert shapes[0] == {"conv": (64, 3), "recurrent": (2, 16, 16)}
    assert shapes[1] == {"k": (1, 16), "v": (1, 16)}
    assert rank_layout(qwen, checkpoint, torch.float32, 1) == qwen.declare(checkpoint.config, torch.float32).layout


def test_the_conv_state_splits_by_piece(dense, qwen):
    """A rank's conv tail holds its key heads' q and k channels and its value heads' v channels."""
    conv = next(s for s in qwen.tensor_parallel(Checkpoint(dense).config).states if s.name == "conv")
    tail = torch.arange(2 * NK * DK + NV * DV, dtype=torch.float32)[:, None].expand(-1, 3)
    assert conv.part(tail, 1, WORLD)[:, 0].long().tolist() == [*range(16, 32), *range(48, 64), *range(96, 128)]


def refusals(qwen, config: dict, world: int) -> list[str]:
    return [line.removeprefix("family 'qwen' (plugin tensorfold_qwen.plugin): --tensor-parallel-size ")
            for line in qwen.tp_refusals(config, world)]


def test_refusals_name_every_count_that_does_not_divide(dense, moe, qwen):
    config = Checkpoint(dense).config
    assert refusals(qwen, config, 2) == []
    assert refusals(qwen, config, 4) == ["4 does not divide the KV heads (num_key_value_heads), 2",
                                         "4 does not divide the GDN key heads (linear_num_key_heads), 2"]
    assert refusals(qwen, config, 3) == [
        "3 does not divide the attention heads (num_attention_heads), 4",
        "3 does not divide the KV heads (num_key_value_heads), 2",
        "3 does not divide the GDN key heads (linear_num_key_heads), 2",
        "3 does not divide the GDN value heads (linear_num_value_heads), 4",
        "3 does not divide the MLP columns (intermediate_size), 128"]
    odd = {**Checkpoint(moe).config, "num_key_value_heads": 4, "num_attention_heads": 8, "linear_num_key_heads": 4,
           "moe_intermediate_size": 36, "shared_expert_intermediate_size": 20}
    assert refusals(qwen, odd, 8) == [
        "8 does not divide the KV heads (num_key_value_heads), 4",
        "8 does not divide the GDN key heads (linear_num_key_heads), 4",
        "8 does not divide the GDN value heads (linear_num_value_heads), 4",
        "8 does not divide the experts' intermediate columns (moe_intermediate_size), 36",
        "8 does not divide the shared expert's intermediate columns (shared_expert_intermediate_size), 20"]


def test_a_rank_of_a_world_that_does_not_divide_is_refused_at_load(dense, qwen):
    config = Checkpoint(dense).config
    with pytest.raises(ValueError, match=r"^the tensor-parallel world of 4 does not divide KV heads "
                                         r"\(num_key_value_heads\) 2$"):
        QwenConfig.from_dict(config).on_rank(Shard(0, 4))
    # 64 divides the conv's 128 channels but not its 32-channel q and k pieces
    with pytest.raises(PluginError, match=r"layer 0 \(gdn\) state 'conv' of shape \(128, 3\) \(parts "
                                          r"\[32, 32, 64\]\) does not split in 64 along dim 0"):
        load_rank(qwen, Checkpoint(dense), torch.float32, torch.device("cpu"), Shard(0, 64))
