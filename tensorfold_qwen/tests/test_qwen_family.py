"""The qwen family against itself: the GDN's two forms, chunked prefill, streams, loading, declarations, refusals."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from qwen_oracle import PROMPT, VOCAB, every_row, ours, prompt_tokens, store
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold.plan import StepPlan, StreamStep
from tensorfold.settings import Settings
from tensorfold_qwen import gdn, plugin
from tensorfold_qwen.config import QwenConfig

TOLERANCE = 1e-4
MiB = 2**20


# ---------------------------------------------------------------- the Gated DeltaNet's two forms

def delta_rule_inputs(rows: int, seed: int, heads: int = 3, k_dim: int = 8, v_dim: int = 5):
    generator = torch.Generator().manual_seed(seed)
    q, k = (gdn.l2norm(torch.randn(rows, heads, k_dim, generator=generator)) for _ in range(2))
    v = torch.randn(rows, heads, v_dim, generator=generator)
    g = -torch.rand(rows, heads, generator=generator) * 2          # log decay in (-2, 0]
    beta = torch.rand(rows, heads, generator=generator)
    return q * k_dim ** -0.5, k, v, g, beta


@pytest.mark.parametrize("start, rows", [(0, 2), (0, 64), (5, 70), (63, 2), (64, 130), (100, 40)])
def test_chunked_delta_rule_equals_the_recurrence(start: int, rows: int) -> None:
    """The chunked form on the absolute grid (zero rows padded in front and behind) is the token-by-token
    recurrence: outputs and the final state, from a non-zero state."""
    q, k, v, g, beta = delta_rule_inputs(rows, seed=start + rows)
    initial = torch.randn(3, 8, 5, generator=torch.Generator().manual_seed(9))
    chunked_state, stepped_state = initial.clone(), initial.clone()
    chunked = gdn.chunked(q, k, v, g, beta, chunked_state, start)
    stepped = torch.stack([gdn.recurrent_step(q[t], k[t], v[t], g[t], beta[t], stepped_state) for t in range(rows)])
    assert chunked.shape == stepped.shape == (rows, 3, 5)
    assert float((chunked - stepped).abs().max()) < 1e-5
    assert float((chunked_state - stepped_state).abs().max()) < 1e-5


def test_conv_tail_is_the_last_inputs() -> None:
    """The causal conv over [tail | x] keeps the last K-1 input columns, whatever the step length."""
    weight = torch.randn(6, 4)
    x = torch.randn(10, 6)
    whole_tail, tail = torch.zeros(6, 3), torch.zeros(6, 3)
    whole = gdn.causal_conv(x, weight, whole_tail)
    pieces = torch.cat([gdn.causal_conv(x[a:b], weight, tail) for a, b in ((0, 1), (1, 3), (3, 10))])
    assert torch.allclose(whole, pieces, atol=1e-6)
    assert torch.equal(whole_tail, x[-3:].T) and torch.equal(tail, x[-3:].T)


# ---------------------------------------------------------------- the model against itself

@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_chunked_prefill_matches_one_shot(tmp_path: Path, moe: bool) -> None:
    plugin.write_tiny(tmp_path, seed=0, moe=moe)
    model = ours(tmp_path)
    tokens = prompt_tokens(seed=2, length=PROMPT + 40)
    one_shot = every_row(model, store(tmp_path, capacity=len(tokens)), tokens, cuts=[])
    worst = 0.0
    for cuts in ([1], [1, 8, 24, 27], [13, 14, 15, 50, 63, 65, 100], [40, 90], list(range(1, len(tokens)))):
        chunked = every_row(model, store(tmp_path, capacity=len(tokens)), tokens, cuts=cuts)
        worst = max(worst, float((chunked - one_shot).abs().max()))
    label = "moe" if moe else "dense"
    print(f"\n[qwen {label}] chunked vs one-shot prefill ({len(tokens)} rows): max diff {worst:.2e}")
    assert worst <= TOLERANCE


def test_make_tiny_is_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        plugin.family_make_tiny(directory=tmp_path / name, seed=3)
    for file in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    (tmp_path / "c").mkdir()
    plugin.family_make_tiny(directory=tmp_path / "c", seed=4)
    assert (tmp_path / "a/model.safetensors").read_bytes() != (tmp_path / "c/model.safetensors").read_bytes()
    assert Checkpoint(tmp_path / "a").model_type == "qwen3_5_text"


def test_streams_do_not_touch_each_other(tmp_path: Path) -> None:
    """Two streams in one plan give bit-identical logits to each run alone; forward returns sampled rows in order."""
    plugin.write_tiny(tmp_path, seed=0, moe=True)
    model = ours(tmp_path)
    a, b = prompt_tokens(seed=5, length=40), prompt_tokens(seed=6, length=23)
    alone_a = model.forward(StepPlan([StreamStep(0, 0, a)]), store(tmp_path))
    alone_b = model.forward(StepPlan([StreamStep(1, 0, b)]), store(tmp_path))
    kv = store(tmp_path)
    both = model.forward(StepPlan([StreamStep(1, 0, b), StreamStep(0, 0, a)]), kv)
    assert both.shape == (2, VOCAB) and both.dtype == torch.float32
    assert torch.equal(both[0], alone_b[0]) and torch.equal(both[1], alone_a[0])
    quiet = model.forward(StepPlan([StreamStep(0, 40, [7], sample=False), StreamStep(1, 23, [9])]), kv)
    assert quiet.shape == (1, VOCAB)
    none = model.forward(StepPlan([StreamStep(0, 41, [8], sample=False)]), kv)
    assert none.shape == (0, VOCAB)


def test_a_new_stream_ignores_what_its_slot_held(tmp_path: Path) -> None:
    """At start 0 the GDN states are taken as zero, so a reused slot never leaks its last stream."""
    plugin.write_tiny(tmp_path, seed=0)
    model = ours(tmp_path)
    tokens = prompt_tokens(seed=3, length=20)
    kv = store(tmp_path)
    model.forward(StepPlan([StreamStep(0, 0, prompt_tokens(seed=4, length=30))]), kv)
    reused = model.forward(StepPlan([StreamStep(0, 0, tokens)]), kv)
    fresh = model.forward(StepPlan([StreamStep(0, 0, tokens)]), store(tmp_path))
    assert torch.equal(reused, fresh)


# ---------------------------------------------------------------- loading

def as_container(directory: Path) -> None:
    """Rewrite a text-only tiny checkpoint as the VL container: config under text_config, weights under
    model.language_model.*, plus a vision tower and an MTP head to skip."""
    config = json.loads((directory / "config.json").read_text())
    container = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                 "tie_word_embeddings": config["tie_word_embeddings"], "text_config": config,
                 "vision_config": {"depth": 1}}
    (directory / "config.json").write_text(json.dumps(container))
    weights = load_file(directory / "model.safetensors")
    nested = {name.replace("model.", "model.language_model.", 1): t for name, t in weights.items()}
    nested.update({"model.visual.patch_embed.proj.weight": torch.zeros(8, 3, 2, 4, 4),
                   "model.visual.merger.norm.weight": torch.ones(8), "mtp.fc.weight": torch.zeros(64, 128),
                   "mtp.layers.0.input_layernorm.weight": torch.zeros(64), "mtp.norm.weight": torch.zeros(64)})
    save_file(nested, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_container_names_are_read_and_vision_and_mtp_skipped(tmp_path: Path, caplog) -> None:
    plain, container = tmp_path / "plain", tmp_path / "container"
    for directory in (plain, container):
        directory.mkdir()
        plugin.write_tiny(directory, seed=0)
    as_container(container)
    tokens = prompt_tokens(seed=8, length=16)
    with caplog.at_level(logging.INFO, logger="tensorfold_qwen.load"):
        nested_model = ours(container)
    skips = [r.getMessage() for r in caplog.records if r.name == "tensorfold_qwen.load"]
    assert len(skips) == 1 and skips[0].startswith("skipped 5 tensors"), skips
    assert torch.equal(every_row(ours(plain), store(plain), tokens, []),
                       every_row(nested_model, store(container), tokens, []))


def test_tied_head_is_the_embedding(tmp_path: Path) -> None:
    plugin.write_tiny(tmp_path, seed=0)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tied = ours(tmp_path)                     # lm_head.weight is present but ignored
    assert tied.weights.lm_head is tied.weights.embed


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    plugin.write_tiny(tmp_path, seed=0)
    path = tmp_path / "model.safetensors"
    weights = load_file(path)

    del weights["model.layers.2.linear_attn.A_log"]
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.linear_attn\.A_log"):
        ours(tmp_path)

    weights["model.layers.2.linear_attn.A_log"] = torch.zeros(4)
    weights["model.layers.1.linear_attn.A_log"] = torch.zeros(4)          # layer 1 is an attention layer
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensors.*model\.layers\.1\.linear_attn\.A_log"):
        ours(tmp_path)

    del weights["model.layers.1.linear_attn.A_log"]
    weights["model.layers.0.linear_attn.conv1d.weight"] = torch.zeros(128, 1, 3)
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"conv1d\.weight has shape \(128, 1, 3\), the config needs \(128, 1, 4\)"):
        ours(tmp_path)


# ---------------------------------------------------------------- declarations

def test_loads_through_entry_point(tmp_path: Path) -> None:
    from tensorfold.plugins import installed_names, load_families

    assert "qwen" in installed_names(), "pip install -e tensorfold_qwen first"
    family = load_families(["qwen"])["qwen"]
    assert set(family.model_types) == {"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"}
    assert family.request_starts_switch == "TF_QWEN_REQUEST_STARTS"
    family.make_tiny(tmp_path, seed=0)
    checkpoint = Checkpoint(tmp_path)
    found = family.declare(checkpoint.config, torch.bfloat16)
    assert [layer.kind for layer in found.layout.layers] == ["gdn", "attention", "gdn", "attention"]
    assert found.layout.bytes_per_token == 2 * 2 * (2 * 16 * 2)            # attention layers · (k, v) · KV·D · bf16
    assert found.layout.fixed_bytes == 2 * (4 * 16 * 16 * 4 + 128 * 3 * 2)  # GDN layers · (state fp32 + conv tail)
    assert found.image.name == "qwen3_5-hybrid" and len(found.image.own) == 4 and len(found.image.rows) == 4
    assert found.identity["schedule"] == "GAGA" and found.identity["dtype"] == "bfloat16"
    model = family.load(checkpoint, torch.float32, torch.device("cpu"))
    assert model.vocab_size == VOCAB
    assert family.refusals(checkpoint.config, Settings(context=4096)) == []


def default_layout(moe: bool):
    transformers = pytest.importorskip("transformers")
    config = (transformers.Qwen3_5MoeTextConfig() if moe else transformers.Qwen3_5TextConfig()).to_dict()
    return plugin.family_kv_layout(config=config, dtype=torch.bfloat16)


def test_layout_arithmetic_of_the_default_configs() -> None:
    """Qwen3_5TextConfig(): 8 attention layers · (k, v) · 4 kv heads · 256 · 2 B = 32,768 B per token; 24 GDN
    layers · (32·128·128 · 4 B state + 8192 · 3 · 2 B conv tail) ≈ 49.1 MiB per stream.
    Qwen3_5MoeTextConfig(): 10 · 2 · 2 · 256 · 2 = 20,480 B per token; 30 GDN layers ≈ 61.4 MiB."""
    dense, moe = default_layout(moe=False), default_layout(moe=True)
    gdn_layer = 32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2
    assert gdn_layer == 2 * MiB + 49152
    assert dense.by_kind()["gdn"]["layers"] == 24 and dense.by_kind()["attention"]["layers"] == 8
    assert dense.bytes_per_token == 32768 and dense.fixed_bytes == 24 * gdn_layer == 51_511_296
    assert moe.bytes_per_token == 20480 and moe.fixed_bytes == 30 * gdn_layer
    print(f"\n[qwen] Qwen3_5TextConfig(): {dense.bytes_per_token:.0f} B/token, {dense.fixed_bytes / MiB:.2f} MiB "
          f"fixed; Qwen3_5MoeTextConfig(): {moe.bytes_per_token:.0f} B/token, {moe.fixed_bytes / MiB:.2f} MiB fixed")


def test_schedule_from_interval_or_layer_types() -> None:
    base = json.loads(json.dumps(plugin.TINY_CONFIG))
    del base["layer_types"]
    assert QwenConfig.from_dict({**base, "num_hidden_layers": 8}).schedule == "GGGAGGGA"    # interval 4 by default
    assert QwenConfig.from_dict({**base, "full_attention_interval": 3, "num_hidden_layers": 6}).schedule == "GGAGGA"
    explicit = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    assert QwenConfig.from_dict({**base, "layer_types": explicit}).schedule == "AGAA"
    nested = {"model_type": "qwen3_5", "text_config": {**base, "layer_types": explicit}}
    assert QwenConfig.from_dict(nested).schedule == "AGAA"


def test_refusals_name_the_flag_or_field() -> None:
    config = json.loads(json.dumps(plugin.TINY_CONFIG))

    def refusals(context: int = 4096, dtype: str = "auto", **changes: object) -> list[str]:
        return list(plugin.family_refusals(config={**config, **changes}, settings=Settings(context=context,
                                                                                             dtype=dtype)))

    assert refusals() == [] and refusals(dtype="bfloat16") == [] and refusals(dtype="float32") == []
    assert refusals(attn_output_gate=True, mamba_ssm_dtype="float32", mtp_num_hidden_layers=1) == []
    (too_long,) = refusals(context=8192)
    assert "--context 8192" in too_long and "max_position_embeddings 4096" in too_long
    (half,) = refusals(dtype="float16")
    assert "--dtype float16" in half
    expectations = {
        "rope_type": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
        "layer_types": dict(layer_types=["linear_attention", "sliding_attention"] * 2),
        "hidden_act": dict(hidden_act="gelu"),
        "attention_bias": dict(attention_bias=True),
        "attn_output_gate": dict(attn_output_gate=False),
        "mamba_ssm_dtype": dict(mamba_ssm_dtype="bfloat16"),
        "quantization_config": dict(quantization_config={"quant_method": "fp8"}),
        "num_attention_heads": dict(num_attention_heads=None),
        "linear_num_value_heads": dict(linear_num_value_heads=3),
        "partial_rotary_factor": dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.1}),
    }
    for field, changes in expectations.items():
        (sentence,) = refusals(**changes)
        assert field in sentence, (field, sentence)
