"""The nemotron family's config, names, Layout, tiny checkpoint and refusals: the config read in every spelling as HF
reads it, tensor names as HF's save_pretrained writes them (and as HF holds them), the Layout's arithmetic at
Nemotron-3-Nano-30B-A3B and Nemotron-H-8B, the SSM state carrying the prompt's start, and each refusal naming its
field."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from nemotron_oracle import VOCAB, every_row, hf_checkpoint, ours, prompt_tokens, store, transformers_module
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold.kernels.moe import TILES
from tensorfold.settings import Settings
from tensorfold_nemotron import plugin
from tensorfold_nemotron.config import NemotronConfig
from tensorfold_nemotron.load import canonical, expected_shapes
from tensorfold_nemotron.shapes import SHAPES

MiB = 2**20
MAMBA_ONLY = {"layers_block_type": ["linear_attention", "mlp", "linear_attention", "mlp"]}


# ---------------------------------------------------------------- config

def test_every_spelling_reads_as_hf_reads_it() -> None:
    """Legacy field names and the legacy pattern give the record HF's own config (re-serialised) gives."""
    transformers = transformers_module()
    legacy = {**{k: v for k, v in plugin.TINY_CONFIG.items() if k not in ("layers_block_type", "n_groups",
                                                                          "conv_kernel", "time_step_limit")},
              "hybrid_override_pattern": "ME*M-", "mamba_n_groups": 2, "mamba_d_conv": 3,
              "mamba_dt_limit": [0.001, 0.5]}
    ours_ = NemotronConfig.from_dict(legacy)
    assert (ours_.schedule, ours_.n_groups, ours_.conv_kernel, ours_.dt_limit) == ("ME*M-", 2, 3, (0.001, 0.5))
    assert NemotronConfig.from_dict(transformers.NemotronHConfig(**legacy).to_dict()) == ours_
    renamed = {**plugin.TINY_CONFIG, "layers_block_type": None,
               "layer_types": ["mamba", "moe", "attention", "mamba", "mlp"]}
    assert NemotronConfig.from_dict(renamed).schedule == "ME*M-"
    as_hf_writes = {**plugin.TINY_CONFIG, "time_step_limit": [0.0, {"__float__": "Infinity"}]}
    assert NemotronConfig.from_dict(as_hf_writes).dt_limit == (0.0, math.inf)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_shapes_are_hf_configs(shape: str) -> None:
    transformers = transformers_module()
    built = transformers.NemotronHConfig(**SHAPES[shape]).to_dict()
    assert NemotronConfig.from_dict(SHAPES[shape]) == NemotronConfig.from_dict(built)
    if shape == "nemotron_h-default":        # HF's class default, field for field
        assert NemotronConfig.from_dict(transformers.NemotronHConfig().to_dict()) == NemotronConfig.from_dict(built)


def test_expected_shapes_are_what_hf_writes_and_holds(tmp_path: Path) -> None:
    fields = dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                  ssm_state_size=16, intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=24, moe_shared_expert_intermediate_size=32, moe_latent_size=32)
    directory = hf_checkpoint(tmp_path, seed=0, **fields)
    config = NemotronConfig.from_dict(Checkpoint(directory).config)
    on_disk = {name: tuple(t.shape) for name, t in load_file(directory / "model.safetensors").items()}
    assert on_disk == expected_shapes(config)
    transformers = transformers_module()
    held = transformers.NemotronHForCausalLM.from_pretrained(directory).state_dict()
    assert {canonical(name): tuple(t.shape) for name, t in held.items()} == expected_shapes(config, fused=True)


# ---------------------------------------------------------------- the tiny checkpoint and the state

def test_make_tiny_is_deterministic(tmp_path: Path) -> None:
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        (tmp_path / name).mkdir()
        plugin.write_tiny(tmp_path / name, seed=seed)
    read = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert read["a"] == read["b"] != read["c"]
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "c" / "config.json").read_text()


def test_the_first_32_tokens_still_move_the_last_logits(tmp_path: Path) -> None:
    """With Mamba2 and MLP layers only (no attention to look back), the last of 96 logits still depends on the
    first 32 tokens: the draws keep the SSM state alive that long, so resume tests cut a state that matters."""
    plugin.write_tiny(tmp_path, seed=0, **MAMBA_ONLY)
    model = ours(tmp_path)
    tokens = prompt_tokens(seed=5, length=96)
    other = prompt_tokens(seed=6, length=32) + tokens[32:]
    last = [every_row(model, store(tmp_path, capacity=97), t, cuts=[])[-1] for t in (tokens, other)]
    moved, spread = float((last[0] - last[1]).abs().max()), float(last[0].std())
    print(f"\n[nemotron] other first 32 of 96 tokens move the last logits by {moved:.3f} (logit std {spread:.2f})")
    assert moved > 0.2 * spread


def test_the_mtp_head_is_skipped_and_hfs_in_memory_names_load(tmp_path: Path, caplog) -> None:
    published, held = tmp_path / "published", tmp_path / "held"
    for directory in (published, held):
        directory.mkdir()
        plugin.write_tiny(directory, seed=0)
    weights = load_file(held / "model.safetensors")
    renamed = {name.replace("backbone.", "model.", 1): t for name, t in weights.items() if ".experts." not in name}
    for i in (1,):                                    # the tiny schedule's one MoE layer, experts stacked
        for part in ("up_proj", "down_proj"):
            renamed[f"model.layers.{i}.mixer.experts.{part}"] = torch.stack(
                [weights[f"backbone.layers.{i}.mixer.experts.{e}.{part}.weight"] for e in range(8)])
    renamed.update({"mtp.layers.0.norm.weight": torch.ones(64), "mtp.norm.weight": torch.ones(64)})
    save_file(renamed, str(held / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="tensorfold_nemotron.load"):
        model = ours(held)
    assert [r.getMessage() for r in caplog.records if r.name == "tensorfold_nemotron.load"] == [
        "skipped 2 tensors the served model does not use (the MTP head mtp.*)"]
    tokens = prompt_tokens(seed=8, length=16)
    assert torch.equal(every_row(ours(published), store(published), tokens, []),
                       every_row(model, store(held), tokens, []))


def test_missing_unexpected_misshapen_and_mixed_tensors_are_named(tmp_path: Path) -> None:
    plugin.write_tiny(tmp_path, seed=0)
    path = tmp_path / "model.safetensors"
    weights = load_file(path)
    cases = [
        ({"drop": "backbone.layers.0.mixer.A_log"}, r"missing tensors: backbone\.layers\.0\.mixer\.A_log"),
        ({"add": ("backbone.layers.2.mixer.A_log", torch.zeros(4))},
         r"unexpected tensors \(not part of a nemotron_h ME\*M- .*backbone\.layers\.2\.mixer\.A_log"),
        ({"add": ("backbone.layers.3.mixer.conv1d.weight", torch.zeros(128, 1, 3))},
         r"conv1d\.weight has shape \(128, 1, 3\), the config needs \(128, 1, 4\)"),
        ({"add": ("backbone.layers.1.mixer.experts.up_proj", torch.zeros(8, 32, 64))}, r"mixes the two expert forms"),
        ({"drop": "lm_head.weight"}, r"missing tensors: lm_head\.weight"),
    ]
    for change, message in cases:
        changed = dict(weights)
        if "drop" in change:
            del changed[change["drop"]]
        else:
            changed[change["add"][0]] = change["add"][1]
        save_file(changed, str(path), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            ours(tmp_path)


# ---------------------------------------------------------------- declarations

def test_declarations_through_the_entry_point(tmp_path: Path) -> None:
    from tensorfold.plugins import installed_names, load_families

    assert "nemotron" in installed_names(), "pip install -e tensorfold_nemotron first"
    family = load_families(["nemotron"])["nemotron"]
    assert set(family.model_types) == {"nemotron_h"}
    assert family.request_starts_switch == "TF_NEMOTRON_REQUEST_STARTS"
    family.make_tiny(tmp_path, seed=0)
    checkpoint = Checkpoint(tmp_path)
    found = family.declare(checkpoint.config, torch.bfloat16)
    assert [layer.kind for layer in found.layout.layers] == ["mamba", "moe", "attention", "mamba", "mlp"]
    assert found.layout.bytes_per_token == 2 * 2 * 16 * 2                  # (k, v) · KV·D · bf16, one attention layer
    assert found.layout.fixed_bytes == 2 * (4 * 16 * 16 * 4 + 128 * 3 * 2)  # Mamba2 layers · (SSM fp32 + conv tail)
    assert found.image.name == "nemotron_h-hybrid" and len(found.image.own) == 4 and len(found.image.rows) == 2
    identity = found.identity
    assert identity["schedule"] == "ME*M-" and identity["dtype"] == "bfloat16"
    assert identity["dt_policy"] == "softplus(dt + dt_bias) clamped to [0.0, inf] in every path"
    assert identity["mamba_algorithm"] == "SSD chunked 64 on the absolute grid; 1-token steps recurrent"
    assert identity["experts"] == f"relu2 experts through the kernels' routed_experts ({TILES})"   # E in the schedule
    model = family.load(checkpoint, torch.float32, torch.device("cpu"))
    assert model.vocab_size == VOCAB
    assert family.refusals(checkpoint.config, Settings(context=4096)) == []


def layout_of(shape: str):
    return plugin.family_kv_layout(config=SHAPES[shape], dtype=torch.bfloat16)


def test_layout_arithmetic_of_the_real_shapes() -> None:
    """Nemotron-3-Nano-30B-A3B: 6 attention layers · (k, v) · 2 kv heads · 128 · 2 B = 6,144 B per token; 23 Mamba2
    layers · (64·64·128 · 4 B SSM state + (4096 + 2·8·128) · 3 · 2 B conv tail) = 46.81 MiB per stream; its 23 MoE
    layers keep nothing. Nemotron-H-8B: 4 · 2 · 8 · 128 · 2 = 16,384 B per token; 24 Mamba2 layers · (128·64·128 · 4
    + 10240 · 3 · 2) = 97.41 MiB."""
    nano, dense = layout_of("nemotron_h-30b-a3b"), layout_of("nemotron_h-8b")
    nano_mamba = 64 * 64 * 128 * 4 + (64 * 64 + 2 * 8 * 128) * 3 * 2
    assert nano_mamba == 2 * MiB + 36864
    assert {kind: entry["layers"] for kind, entry in nano.by_kind().items()} == {"mamba": 23, "moe": 23,
                                                                                "attention": 6}
    assert nano.bytes_per_token == 6144 and nano.fixed_bytes == 23 * nano_mamba == 49_082_368
    assert nano.by_kind()["moe"]["fixed_bytes"] == 0 and nano.by_kind()["moe"]["bytes_per_token"] == 0
    assert dense.bytes_per_token == 16384 and dense.fixed_bytes == 24 * (128 * 64 * 128 * 4 + 10240 * 3 * 2)
    assert {kind: entry["layers"] for kind, entry in dense.by_kind().items()} == {"mamba": 24, "mlp": 24,
                                                                                 "attention": 4}
    print(f"\n[nemotron] 30B-A3B: {nano.bytes_per_token:.0f} B/token, {nano.fixed_bytes / MiB:.2f} MiB fixed; "
          f"8B: {dense.bytes_per_token:.0f} B/token, {dense.fixed_bytes / MiB:.2f} MiB fixed")


# ---------------------------------------------------------------- refusals

def test_refusals_name_the_flag_or_field() -> None:
    config = json.loads(json.dumps(plugin.TINY_CONFIG))

    def refusals(context: int = 4096, dtype: str = "auto", **changes: object) -> list[str]:
        return list(plugin.family_refusals(config={**config, **changes}, settings=Settings(context=context,
                                                                                             dtype=dtype)))

    assert refusals() == [] and refusals(dtype="bfloat16") == [] and refusals(dtype="float32") == []
    assert refusals(num_nextn_predict_layers=1, tie_word_embeddings=True, time_step_limit=[0.001, 0.1]) == []
    (too_long,) = refusals(context=8192)
    assert "--context 8192" in too_long and "max_position_embeddings 4096" in too_long
    (half,) = refusals(dtype="float16")
    assert "--dtype float16" in half
    expectations = {
        "mamba_hidden_act": dict(mamba_hidden_act="gelu"),
        "mlp_hidden_act": dict(mlp_hidden_act="silu"),
        "use_bias": dict(use_bias=True),
        "mlp_bias": dict(mlp_bias=True),
        "attention_bias": dict(attention_bias=True),
        "sliding_window": dict(sliding_window=128),
        "residual_in_fp32": dict(residual_in_fp32=True),
        "n_shared_experts": dict(n_shared_experts=2),
        "mamba_ssm_cache_dtype": dict(mamba_ssm_cache_dtype="bfloat16"),
        "quantization_config": dict(quantization_config={"quant_method": "fp8"}),
        "layers_block_type": dict(layers_block_type=["linear_attention", "sliding_attention"]),
        "hybrid_override_pattern": dict(layers_block_type=None, hybrid_override_pattern="M*X"),
        "num_attention_heads": dict(num_attention_heads=None),
        "n_groups": dict(n_groups=3),
        "n_group": dict(n_group=3),
        "topk_group": dict(topk_group=3),
        "num_experts_per_tok": dict(num_experts_per_tok=5),
    }
    for field, changes in expectations.items():
        (sentence,) = refusals(**changes)
        assert field in sentence, (field, sentence)
    for limit in ([0.1, 0.01], [-1.0, 1.0], [0.0], "inf", [0.0, "many"], [math.inf, math.inf]):
        (sentence,) = refusals(time_step_limit=limit)
        assert "time_step_limit" in sentence, (limit, sentence)
