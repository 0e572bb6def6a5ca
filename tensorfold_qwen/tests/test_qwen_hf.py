"""The qwen family against HF transformers (the oracle): every served model type, three configs or more each.

fp32 logits at every one of 64 prompt positions within 1e-4 (eager and sdpa attention), and 32 greedy tokens
identical to HF's generate. Run `pytest -s tensorfold_qwen` to see the measured differences.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qwen_oracle import compare_with_hf, every_row, hf_checkpoint, hf_model, ours, prompt_tokens, store

from tensorfold_qwen import plugin

GDN_SMALL = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
DENSE = dict(intermediate_size=128)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)

# What a Qwen3.5 family can get wrong: head counts (GQA, MQA, MHA; GDN value heads per key head 1, 2, 4), the
# layer schedule (interval 2, 3, 4, or explicit layer_types starting with attention), the rotary share (0.25, 0.5,
# 1), tied embeddings, the conv kernel, the experts (top-1 .. top-4).
SHAPES = {
    "gqa-int2-untied": dict(num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, **GDN_SMALL),
    "mqa-int4-rot05-tied": dict(num_hidden_layers=4, full_attention_interval=4, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.5, tie=True,
                                rope_theta=1_000_000.0, linear_num_key_heads=2, linear_num_value_heads=2,
                                linear_key_head_dim=8, linear_value_head_dim=16),
    "mha-types-rot1-conv3": dict(num_hidden_layers=5, layer_types=["full_attention", "linear_attention",
                                                                    "linear_attention", "full_attention",
                                                                    "linear_attention"],
                                 num_attention_heads=2, num_key_value_heads=2, head_dim=16, partial_rotary_factor=1.0,
                                 rope_theta=10_000_000.0, linear_num_key_heads=1, linear_num_value_heads=4,
                                 linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=3),
}
MOE_SHAPES = {
    "e4-top1-int3-tied": dict(num_hidden_layers=3, full_attention_interval=3, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, tie=True,
                              num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, **GDN_SMALL),
    "e16-top4-h8": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                          "linear_attention"],
                        num_attention_heads=8, num_key_value_heads=2, head_dim=8, partial_rotary_factor=1.0,
                        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
                        shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=8),
}


def cases() -> list[tuple[str, str, dict]]:
    """(model_type, label, fields): three dense shapes for the dense types, the MoE variants for the MoE types."""
    dense = {label: {**DENSE, **fields} for label, fields in SHAPES.items()}
    moe = {"e8-top2-" + label: {**MOE, **fields} for label, fields in SHAPES.items() if "conv3" not in label}
    moe.update(MOE_SHAPES)
    found = []
    for model_type in ("qwen3_5_text", "qwen3_5"):
        found += [(model_type, label, fields) for label, fields in dense.items()]
    for model_type in ("qwen3_5_moe_text", "qwen3_5_moe"):
        found += [(model_type, label, fields) for label, fields in moe.items()]
    return found


@pytest.mark.parametrize("model_type, label, fields", cases(), ids=[f"{t}-{label}" for t, label, _ in cases()])
def test_matches_hf(tmp_path: Path, model_type: str, label: str, fields: dict) -> None:
    seed = [(case[0], case[1]) for case in cases()].index((model_type, label))
    directory = hf_checkpoint(tmp_path / "ckpt", model_type, seed=seed, **fields)
    compare_with_hf(directory, f"{model_type} {label}")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_own_tiny_checkpoint_loads_in_hf_and_matches(tmp_path: Path, moe: bool) -> None:
    plugin.write_tiny(tmp_path, seed=0, moe=moe)
    compare_with_hf(tmp_path, f"write_tiny seed 0 ({'qwen3_5_moe_text' if moe else 'qwen3_5_text'})")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bf16_runs_finite_and_tracks_hf(tmp_path: Path, moe: bool) -> None:
    plugin.write_tiny(tmp_path, seed=0, moe=moe)
    tokens = prompt_tokens(seed=7)
    half = ours(tmp_path, torch.bfloat16)
    kv = store(tmp_path, torch.bfloat16)
    assert kv.layout.layers[0].fixed[0].dtype == "bfloat16" and kv.layout.layers[0].fixed[1].dtype == "float32"
    chunked = every_row(half, kv, tokens, cuts=[20, 41])
    assert chunked.dtype == torch.float32 and torch.isfinite(chunked).all()
    one_shot = every_row(half, store(tmp_path, torch.bfloat16), tokens, cuts=[])
    with torch.no_grad():
        hf_half = hf_model(tmp_path, torch.bfloat16)(torch.tensor([tokens])).logits[0].float()
        hf_full = hf_model(tmp_path)(torch.tensor([tokens])).logits[0].float()
    vs_hf, vs_fp32 = float((one_shot - hf_half).abs().max()), float((one_shot - hf_full).abs().max())
    print(f"\n[qwen bf16 {'moe' if moe else 'dense'}] vs HF bf16 (eager) {vs_hf:.2e}; vs HF fp32 {vs_fp32:.2e}; "
          f"chunked vs one-shot {float((chunked - one_shot).abs().max()):.2e}")
    assert vs_hf <= 0.25, "bf16 logits stray from HF's bf16"
    if not moe:   # in bf16 a router may pick other experts than in fp32, so only the dense model tracks fp32
        assert vs_fp32 <= 1.0, "bf16 logits stray from fp32"
