"""The glm family's declarations against HF transformers: the config record and its schedules, the checkpoint
names, the Layout arithmetic, the state image, the tiny checkpoint and the refusals. (The forward has its own tests.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors import safe_open

from tensorfold.checkpoint import Checkpoint
from tensorfold.image import StateImage, put_back, read_out
from tensorfold.kv import WindowStore
from tensorfold.settings import Settings
from tensorfold_glm import plugin
from tensorfold_glm.config import GlmConfig
from tensorfold_glm.names import canonical, expected_shapes, is_ignored

MiB = 2**20
TINY_VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
               "projection_intermediate_size": 64}
# HF-only keys of the tiny config: not text fields
NOT_TEXT = ("model_type", "architectures", "vision_config", "dtype")


def tiny_text(**changes: Any) -> dict[str, Any]:
    """The tiny checkpoint's text fields (with a pad id inside the vocabulary), changed."""
    text = {k: v for k, v in plugin.TINY_CONFIG.items() if k not in NOT_TEXT}
    return {**text, "pad_token_id": 0, **changes}


def saved_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(directory / "model.safetensors", "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


# ---------------------------------------------------------------- the config record against HF's

def hf_text_config(**fields: Any):
    from transformers import Glm5NextTextConfig

    return Glm5NextTextConfig(**fields)


def test_defaults_are_hf_defaults_field_by_field() -> None:
    """Every field the record reads equals Glm5NextTextConfig()'s, from an empty config, HF's own to_dict(), and the
    default container's nested to_dict()."""
    from transformers import Glm5NextConfig

    hf = hf_text_config()
    ours = [GlmConfig.from_dict({"model_type": "glm5_next"}), GlmConfig.from_dict(hf.to_dict()),
            GlmConfig.from_dict(Glm5NextConfig().to_dict())]
    for field in attrs.fields(GlmConfig):
        if field.name == "model_type":
            continue
        theirs = getattr(hf, field.name)
        theirs = tuple(theirs) if isinstance(theirs, list) else theirs
        for record in ours:
            assert getattr(record, field.name) == theirs, field.name
    assert ours[0].schedule == "LLLI" * 11 + "L" and ours[0].mlp_schedule == "DDD" + "M" * 42
    assert ours[1].model_type == "glm5_next_text" and ours[2].model_type == "glm5_next"


SCHEDULES = {
    "default 8": dict(num_hidden_layers=8),
    "pattern string": dict(num_hidden_layers=8, index_topk_pattern="FSFSFFSS"),
    "pattern list": dict(num_hidden_layers=5, index_topk_pattern=["full", "shared", "full", "full", "shared"]),
    "freq 4 offset 3": dict(num_hidden_layers=12, index_topk_freq=4, index_skip_topk_offset=3),
    "freq 2": dict(num_hidden_layers=9, index_topk_freq=2),
    "freq 0 offset 0": dict(num_hidden_layers=6, index_topk_freq=0, index_skip_topk_offset=0),
    "two layers": dict(num_hidden_layers=2),
    "explicit with alias": dict(num_hidden_layers=4, mlp_layer_types=["sparse", "dense", "sparse", "dense"],
                                layer_types=["full_attention", "linear_attention", "indexed_attention",
                                             "linear_attention"], indexer_types=["full", "shared", "shared", "full"]),
    "linear_attn_config": dict(linear_attn_config={"head_dim": 32, "num_heads": 3, "short_conv_kernel_size": 3,
                                                   "gate_lower_bound": None}),
    "unsafe gate": dict(linear_attn_config={"gate_lower_bound": None, "safe_gate": False}),
    "no lower bound": dict(linear_lower_bound=None),
}
SCHEDULE_FIELDS = ("layer_types", "mlp_layer_types", "indexer_types", "linear_head_dim", "linear_num_heads",
                   "linear_conv_kernel_dim", "linear_lower_bound")


@pytest.mark.parametrize("fields", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_schedules_are_derived_as_hf_derives_them(fields: dict[str, Any]) -> None:
    """layer_types (full_attention an alias), mlp_layer_types, indexer_types (pattern, freq/offset) and the KDA
    fields (linear_attn_config) equal HF's, read flat, nested, as glm5_next_text, and from HF's saved dict."""
    from transformers import Glm5NextConfig

    hf = hf_text_config(**fields)
    container = Glm5NextConfig(**fields).text_config                   # HF forwards a flat config's fields
    forms = [{"model_type": "glm5_next", **fields}, {"model_type": "glm5_next", "text_config": fields},
             {"model_type": "glm5_next_text", **fields}, hf.to_dict()]
    for form in forms:
        ours = GlmConfig.from_dict(form)
        for name in SCHEDULE_FIELDS:
            theirs = getattr(hf, name)
            assert getattr(ours, name) == (tuple(theirs) if isinstance(theirs, list) else theirs), (name, form)
            assert getattr(container, name) == theirs, name


def test_flat_and_nested_forms_read_the_same_and_the_container_flag_ties() -> None:
    flat = {"model_type": "glm5_next", **tiny_text()}
    nested = {"model_type": "glm5_next", "text_config": tiny_text()}
    assert GlmConfig.from_dict(flat) == GlmConfig.from_dict(nested)
    assert GlmConfig.from_dict(flat).schedule == "LLLI" and GlmConfig.from_dict(flat).mlp_schedule == "DMMM"
    tied_inside = {"model_type": "glm5_next", "text_config": tiny_text(tie_word_embeddings=True)}
    assert GlmConfig.from_dict(tied_inside).tie_word_embeddings                         # no container flag
    assert not GlmConfig.from_dict({**tied_inside, "tie_word_embeddings": False}).tie_word_embeddings
    assert GlmConfig.from_dict({**flat, "tie_word_embeddings": True}).tie_word_embeddings


# ---------------------------------------------------------------- checkpoint names

def test_expected_shapes_are_what_hf_save_pretrained_writes(tmp_path: Path) -> None:
    """A Glm5NextForConditionalGeneration (tiny vision tower; layers L I S L, dense and MoE, 2 shared experts)
    saved by HF: every text tensor is expected with its shape, every vision tensor ignored, nothing else."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = tiny_text(layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
                     indexer_types=["full", "full", "shared", "full"], n_shared_experts=2,
                     mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=TINY_VISION)).save_pretrained(
        tmp_path)
    config = GlmConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert config.schedule == "LISL"
    saved = saved_shapes(tmp_path)
    kept = {name: shape for name, shape in saved.items() if not is_ignored(name, config)}
    ignored = set(saved) - set(kept)
    assert kept == expected_shapes(config)
    assert ignored and all(name.startswith("model.visual.") for name in ignored)
    assert "model.language_model.layers.1.self_attn.indexer.wk.weight" in kept
    assert not any(name.startswith("model.language_model.layers.2.self_attn.indexer.") for name in kept)
    assert kept["model.language_model.layers.1.mlp.shared_experts.up_proj.weight"] == (64, 64)   # 2 · 32

    tied = GlmConfig.from_dict({"model_type": "glm5_next", **tiny_text(tie_word_embeddings=True)})
    assert "lm_head.weight" not in expected_shapes(tied) and is_ignored("lm_head.weight", tied)


def test_mtp_layers_shared_heads_and_other_spellings() -> None:
    c = GlmConfig.from_dict({"model_type": "glm5_next", **tiny_text()})                     # 4 layers
    for name in ("model.language_model.layers.4.eh_proj.weight", "model.language_model.layers.4.mlp.gate.weight",
                 "model.language_model.layers.1.shared_head.norm.weight", "layers.7.enorm.weight",
                 "model.layers.4.hnorm.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert is_ignored(name, c), name
    for name in ("model.language_model.layers.3.self_attn.q_a_proj.weight", "lm_head.weight", "model.norm.weight"):
        assert not is_ignored(name, c), name
    spellings = ("model.language_model.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight",
                 "layers.0.input_layernorm.weight")
    assert {canonical(name) for name in spellings} == {"model.language_model.layers.0.input_layernorm.weight"}
    assert canonical("embed_tokens.weight") == "model.language_model.embed_tokens.weight"
    assert canonical("lm_head.weight") == "lm_head.weight"
    assert canonical("model.visual.merger.proj.weight") == "model.visual.merger.proj.weight"


# ---------------------------------------------------------------- memory: the Layout and the image

def test_layout_arithmetic_of_the_default_config() -> None:
    """Glm5NextTextConfig(), bf16: 11 MLA layers · (512 latent · 2 B + 128 · 2 B / 16 pooled) = 11,440 B per
    token; 34 KDA layers · (64·128·128 · 4 B state + 3·64·128 · 3 · 2 B conv tail) + 11 · 15·2·128 · 2 B pool
    tails = 147,704,320 B ≈ 140.9 MiB per stream."""
    layout = plugin.family_kv_layout(config=hf_text_config().to_dict(), dtype=torch.bfloat16)
    kda_layer = 64 * 128 * 128 * 4 + 3 * 64 * 128 * 3 * 2
    assert kda_layer == 4 * MiB + 144 * 1024
    kinds = layout.by_kind()
    assert kinds["kda"]["layers"] == 34 and kinds["mla"]["layers"] == 11
    assert layout.bytes_per_token == 11 * (512 * 2 + 128 * 2 / 16) == 11_440
    assert layout.fixed_bytes == 34 * kda_layer + 11 * 15 * 2 * 128 * 2 == 147_704_320
    assert round(layout.fixed_bytes / MiB) == 141
    assert layout.stream_bytes(1000) == 11 * (1000 * 1024 + (1000 // 16) * 256) + layout.fixed_bytes
    print(f"\n[glm] Glm5NextTextConfig() bf16: {layout.bytes_per_token:.0f} B/token, "
          f"{layout.fixed_bytes / MiB:.2f} MiB fixed per stream")


def test_shared_layers_keep_no_indexer_state() -> None:
    config = {"model_type": "glm5_next", **tiny_text(
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"])}
    layout = plugin.family_kv_layout(config=config, dtype=torch.float32)
    full, shared = layout.layers[1], layout.layers[2]
    assert [(s.name, s.shape, s.every) for s in full.rows] == [("latent", (32,), 1), ("pooled_key", (16,), 4)]
    assert [(s.name, s.shape) for s in full.fixed] == [("pool_tail", (3, 2, 16))]
    assert [s.name for s in shared.rows] == ["latent"] and shared.fixed == ()
    assert [(s.name, s.shape, s.dtype) for s in layout.layers[0].fixed] == [("conv", (96, 3), "float32"),
                                                                          ("recurrent", (2, 16, 16), "float32")]


def test_image_round_trip_with_pooled_rows(tmp_path: Path) -> None:
    """A state kept at 10 tokens (two complete pools of 4, two tail rows) becomes bytes and comes back equal, and
    an image at 8 is a byte prefix of it (rows go by position, a pooled key at its pool's last token)."""
    config = {"model_type": "glm5_next", **tiny_text()}
    layout = plugin.family_kv_layout(config=config, dtype=torch.bfloat16)
    fmt = plugin.family_state_image(config=config, layout=layout)
    assert fmt.problems(layout) == []
    kv = WindowStore(layout, slots=2, capacity=16)
    generator = torch.Generator().manual_seed(0)
    kv.write_rows(3, "latent", 0, 0, torch.randn(10, 32, generator=generator).bfloat16())
    kv.write_rows(3, "pooled_key", 0, 0, torch.randn(2, 16, generator=generator).bfloat16())
    for layer, name in fmt.own:
        state = kv.fixed(layer, name, 0)
        state.copy_(torch.randn(state.shape, generator=generator))
    image = StateImage.from_bytes(read_out(kv, 0, 10, fmt).to_bytes())
    put_back(kv, 1, image, fmt)
    for layer, name in fmt.rows:
        assert torch.equal(kv.rows(layer, name, 1, 10), kv.rows(layer, name, 0, 10)), name
    for layer, name in fmt.own:
        assert torch.equal(kv.fixed(layer, name, 1), kv.fixed(layer, name, 0)), (layer, name)
    assert len(image.rows) == 10 * 32 * 2 + 2 * 16 * 2
    assert image.rows.startswith(read_out(kv, 0, 8, fmt).rows)


# ---------------------------------------------------------------- the tiny checkpoint

def test_tiny_checkpoint_is_deterministic_and_loads_in_hf(tmp_path: Path) -> None:
    """Written without transformers; HF loads every text tensor of it (only its vision tower is missing), reads
    the same schedules, and the same seed writes the same bytes."""
    from transformers import Glm5NextForConditionalGeneration

    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        (tmp_path / name).mkdir()
        plugin.family_make_tiny(directory=tmp_path / name, seed=seed)
    for file in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    assert (tmp_path / "a/model.safetensors").read_bytes() != (tmp_path / "c/model.safetensors").read_bytes()
    checkpoint = Checkpoint(tmp_path / "a")
    assert checkpoint.model_type == "glm5_next"
    config = GlmConfig.from_dict(checkpoint.config)
    assert config.schedule == "LLLI" and config.mlp_schedule == "DMMM" and config.vocab_size == 512
    assert saved_shapes(tmp_path / "a") == expected_shapes(config)

    model, info = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "a", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert info["missing_keys"] and all(name.startswith("model.visual.") for name in info["missing_keys"])
    text = model.config.text_config
    assert (tuple(text.layer_types), tuple(text.mlp_layer_types), tuple(text.indexer_types)) == (
        config.layer_types, config.mlp_layer_types, config.indexer_types)
    weight = model.model.language_model.layers[0].self_attn.forget_gate.A_log
    with safe_open(tmp_path / "a/model.safetensors", "pt") as f:
        assert torch.equal(weight.detach(), f.get_tensor("model.language_model.layers.0.self_attn.A_log"))


# ---------------------------------------------------------------- declarations and refusals

def test_declarations_through_the_entry_point(tmp_path: Path) -> None:
    from tensorfold.plugins import installed_names, load_families

    assert "glm" in installed_names(), "pip install -e tensorfold_glm first"
    family = load_families(["glm"])["glm"]
    assert set(family.model_types) == {"glm5_next", "glm5_next_text"}
    assert family.request_starts_switch == "TF_GLM_REQUEST_STARTS"
    family.make_tiny(tmp_path, seed=0)
    config = Checkpoint(tmp_path).config
    found = family.declare(config, torch.bfloat16)
    assert [layer.kind for layer in found.layout.layers] == ["kda", "kda", "kda", "mla"]
    assert found.layout.bytes_per_token == 32 * 2 + 16 * 2 / 4                   # latent + pooled key / kpool
    assert found.layout.fixed_bytes == 3 * (96 * 3 * 2 + 2 * 16 * 16 * 4) + 3 * 2 * 16 * 2
    assert found.image.name == "glm5_next-hybrid" and found.image.version == 1
    assert len(found.image.own) == 7 and len(found.image.rows) == 2
    identity = found.identity
    assert identity["schedule"] == "LLLI" and identity["dtype"] == "bfloat16"
    assert "ties: lower pool wins" in identity["indexer"] and "kpool=4" in identity["indexer"]
    assert "blocks of at most 268435456 bytes" in identity["indexer"]       # the DSA scoring's row blocks
    assert identity["kda_algorithm"] == ("chunked 64 on the absolute grid from q, k, v in bfloat16; "
                                         "1-token steps recurrent")
    assert "masked_attention kernel" in identity["mla_attention"]   # states of the einsum prefill on CUDA differ
    assert family.refusals(config, Settings(context=4096)) == []


def test_refusals_name_the_flag_or_field() -> None:
    config = {"model_type": "glm5_next", **tiny_text()}

    def refusals(context: int = 4096, dtype: str = "auto", **changes: Any) -> list[str]:
        return list(plugin.family_refusals(config={**config, **changes},
                                           settings=Settings(context=context, dtype=dtype)))

    assert refusals() == [] and refusals(dtype="bfloat16") == [] and refusals(dtype="float32") == []
    served = dict(index_kpool_always_select_tail=False, n_group=2, topk_group=1, linear_lower_bound=None,
                  norm_topk_prob=False, num_nextn_predict_layers=1, indexer_types=None,
                  index_topk_pattern="FSFF")      # a KDA layer marked shared changes nothing
    assert refusals(**served) == []
    (too_long,) = refusals(context=8192)
    assert "--context 8192" in too_long and "max_position_embeddings 4096" in too_long
    (half,) = refusals(dtype="float16")
    assert "--dtype float16" in half
    shared_after_kda = dict(indexer_types=["full", "full", "full", "shared"])
    (sentence,) = refusals(**shared_after_kda)
    assert "indexer_types" in sentence and "layer 3" in sentence and "HF cannot run" in sentence
    expectations = {
        "qk_rope_head_dim": dict(qk_rope_head_dim=64),
        "hidden_act": dict(hidden_act="gelu"),
        "attention_bias": dict(attention_bias=True),
        "quantization_config": dict(quantization_config={"quant_method": "fp8"}),
        "n_shared_experts": dict(n_shared_experts=0),
        "num_key_value_heads": dict(num_key_value_heads=2),
        "index_topk": dict(index_topk=18),
        "layer_types": dict(layer_types=["linear_attention", "sliding_attention"] * 2),
        "mlp_layer_types": dict(mlp_layer_types=["dense", "sparse"]),
        "n_group": dict(n_group=3),
        "num_experts_per_tok": dict(num_experts_per_tok=9),
        "index_topk_pattern": dict(index_topk_pattern="FFXF", indexer_types=None),
        "linear_conv_kernel_dim": dict(linear_conv_kernel_dim=1),
    }
    for field, changes in expectations.items():
        (sentence,) = refusals(**changes)
        assert field in sentence, (field, sentence)
    assert refusals(hidden_size="wide")[0].startswith("the glm family cannot read config.json")
