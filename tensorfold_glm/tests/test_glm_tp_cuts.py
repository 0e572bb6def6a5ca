"""The glm family's tensor-parallel declarations, without processes: which tensor each rank cuts and how, the
rank's Layout, the rank's model built from its slices, and the refusals naming what does not divide."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold.family import Family, PluginError
from tensorfold.follow.rank import load_rank, rank_layout
from tensorfold.plugins import load_families
from tensorfold.shard import Shard
from tensorfold_glm import plugin
from tensorfold_glm.config import GlmConfig
from tensorfold_glm.parallel import tensor_parallel

H, D = 2, 16                        # the tiny checkpoint's KDA heads and head dim: [q | k | v] pieces of 32
COLUMN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight",
          "self_attn.f_b_proj.weight", "self_attn.A_log", "self_attn.dt_bias", "self_attn.b_proj.weight",
          "self_attn.g_b_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
          "gate_proj.weight", "up_proj.weight")
ROW = ("self_attn.o_proj.weight", "down_proj.weight")


@pytest.fixture(scope="module")
def glm() -> Family:
    return load_families(["glm"])["glm"]


@pytest.fixture(scope="module")
def tiny(glm: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-glm")
    glm.make_tiny(directory, seed=0)
    return directory


def test_refusals_name_each_count_the_world_does_not_divide(glm: Family, tiny: Path):
    config = Checkpoint(tiny).config
    assert glm.tp_refusals(config, 2) == []
    assert [line.split(": ", 1)[1] for line in glm.tp_refusals(config, 4)] == [
        "--tensor-parallel-size 4 does not divide the KDA heads (linear_num_heads), 2"]
    assert [line.split(": ", 1)[1] for line in glm.tp_refusals(config, 3)] == [
        "--tensor-parallel-size 3 does not divide the KDA heads (linear_num_heads), 2",
        "--tensor-parallel-size 3 does not divide the MLA attention heads (num_attention_heads), 4",
        "--tensor-parallel-size 3 does not divide the dense MLP columns (intermediate_size), 128",
        "--tensor-parallel-size 3 does not divide the columns of each routed and shared expert "
        "(moe_intermediate_size), 32"]
    assert all(line.startswith("family 'glm' (plugin ") for line in glm.tp_refusals(config, 3))


def test_only_the_parts_a_config_has_must_divide():
    config = {**plugin.TINY_CONFIG, "layer_types": ["linear_attention"] * 4, "mlp_layer_types": ["sparse"] * 4,
              "num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 99}
    assert tensor_parallel(GlmConfig.from_dict(config)).refusals(2) == []


def test_every_tensor_of_the_tiny_checkpoint_is_cut_as_the_docs_say(glm: Family, tiny: Path):
    checkpoint = Checkpoint(tiny)
    parallel = glm.tensor_parallel(checkpoint.config)
    kinds = {"column": 0, "row": 0, "replicated": 0}
    for name in checkpoint.names():
        whole = checkpoint.tensor(name)
        part = parallel.part(name, whole, 1, 2)
        if name.endswith(COLUMN):
            kinds["column"] += 1
            assert torch.equal(part, whole.chunk(2, 0)[1]), name
        elif name.endswith(ROW):
            kinds["row"] += 1
            assert torch.equal(part, whole.chunk(2, 1)[1]), name
        else:                       # mHC, norms, f_a/g_a, o_norm, q_a/kv_a, the indexer, the router, embed, head
            kinds["replicated"] += 1
            assert torch.equal(part, whole), name
    # KDA 3 layers x 11 column + 1 row; MLA 2 + 1; dense 2 + 1; MoE 3 layers x (8 experts + 1 shared) x (2 + 1)
    assert kinds == {"column": 33 + 2 + 2 + 54, "row": 3 + 1 + 1 + 27, "replicated": len(checkpoint.names()) - 123}


def test_the_fused_conv_gives_each_rank_its_channels_of_q_k_and_v(glm: Family, tiny: Path):
    parallel = glm.tensor_parallel(Checkpoint(tiny).config)
    fused = torch.arange(3.0 * H * D)[:, None, None].expand(3 * H * D, 1, 4)
    part = parallel.part("model.language_model.layers.0.self_attn.conv1d.weight", fused, 1, 2)
    assert part[:, 0, 0].tolist() == [*range(16, 32), *range(48, 64), *range(80, 96)]


def test_a_rank_layout_splits_the_kda_states_and_keeps_mla_and_indexer_states_whole(glm: Family, tiny: Path):
    layout = rank_layout(glm, Checkpoint(tiny), torch.float32, 2)
    kda, mla = layout.layers[0], layout.layers[3]
    assert {s.name: s.shape for s in kda.fixed} == {"conv": (3 * H * D // 2, 3), "recurrent": (1, D, D)}
    assert {s.name: s.shape for s in mla.rows} == {"latent": (32,), "pooled_key": (16,)}
    assert {s.name: s.shape for s in mla.fixed} == {"pool_tail": (3, 2, 16)}


def test_a_rank_builds_its_part_from_its_slices(glm: Family, tiny: Path):
    checkpoint = Checkpoint(tiny)
    model, _ = load_rank(glm, checkpoint, torch.float32, torch.device("cpu"), Shard(1, 2))
    c = model.config
    assert (c.linear_num_heads, c.num_attention_heads, c.intermediate_size, c.moe_intermediate_size) == (1, 2, 64, 16)
    assert (c.index_n_heads, c.kv_lora_rank, c.n_routed_experts) == (4, 32, 8)        # whole on every rank

    def whole(name: str) -> torch.Tensor:
        return checkpoint.tensor(f"model.language_model.layers.{name}")

    conv = model.weights.layers[0].mixer.conv
    assert torch.equal(conv, torch.cat([whole(f"0.self_attn.{p}_conv1d.weight").squeeze(1)[16:] for p in "qkv"]))
    assert torch.equal(model.weights.layers[0].mixer.A_log, whole("0.self_attn.A_log")[1:])
    mla = model.weights.layers[3].mixer
    assert torch.equal(mla.kv_a_proj_with_mqa, whole("3.self_attn.kv_a_proj_with_mqa.weight"))
    assert torch.equal(mla.indexer.wq_b, whole("3.self_attn.indexer.wq_b.weight"))
    assert torch.equal(mla.kv_b_proj, whole("3.self_attn.kv_b_proj.weight")[64:])   # heads 2, 3 of 32 rows each
    moe = model.weights.layers[1].ffn
    assert moe.gate_up.shape == (8, 32, 64) and moe.down.shape == (8, 64, 16)
    assert torch.equal(moe.gate_up[5], torch.cat([whole("1.mlp.experts.5.gate_proj.weight")[16:],
                                                  whole("1.mlp.experts.5.up_proj.weight")[16:]]))
    assert torch.equal(moe.down[5], whole("1.mlp.experts.5.down_proj.weight")[:, 16:])
    assert torch.equal(moe.router, whole("1.mlp.gate.weight"))
    assert moe.shared_experts.down_proj.shape == (64, 16)


def test_fused_experts_are_refused_above_tp_1_by_name(glm: Family, tiny: Path, tmp_path: Path):
    state = load_file(str(tiny / "model.safetensors"))
    for i in (1, 2, 3):
        prefix = f"model.language_model.layers.{i}.mlp.experts."
        experts = [[state.pop(f"{prefix}{e}.{p}_proj.weight") for p in ("gate", "up", "down")] for e in range(8)]
        state[f"{prefix}gate_up_proj"] = torch.stack([torch.cat([gate, up]) for gate, up, _ in experts])
        state[f"{prefix}down_proj"] = torch.stack([down for _, _, down in experts])
    for path in tiny.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(state, str(tmp_path / "model.safetensors"))
    checkpoint = Checkpoint(tmp_path)
    load_rank(glm, checkpoint, torch.float32, torch.device("cpu"), Shard())                # TP=1 serves it
    with pytest.raises(PluginError, match=r"family_load raised ValueError: .* fused experts \(model\.language_model"
                                          r"\.layers\.1\.mlp\.experts\.down_proj, HF's in-memory form\) at "
                                          r"--tensor-parallel-size 1 only"):
        load_rank(glm, checkpoint, torch.float32, torch.device("cpu"), Shard(0, 2))


def test_per_rank_memory_of_the_default_config_at_tp_8():
    """Glm5NextTextConfig()'s defaults, bf16, at TP=8: the latents and pooled keys stay whole (11,440 B per token);
    the KDA states hold 8 of the 64 heads: 34 · (8·128·128 · 4 B + 3·8·128 · 3 · 2 B) + 11 · 15·2·128 · 2 B pool
    tails = 18,536,960 B ≈ 17.7 MiB per stream per rank (140.9 MiB at TP=1)."""
    config = {"model_type": "glm5_next"}
    parallel = tensor_parallel(GlmConfig.from_dict(config))
    assert parallel.refusals(8) == []
    layout = parallel.layout(plugin.family_kv_layout(config=config, dtype=torch.bfloat16), 8)
    assert layout.bytes_per_token == 11_440
    assert layout.fixed_bytes == 34 * (8 * 128 * 128 * 4 + 3 * 8 * 128 * 3 * 2) + 11 * 15 * 2 * 128 * 2 == 18_536_960
