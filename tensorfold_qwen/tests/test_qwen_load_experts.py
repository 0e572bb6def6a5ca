"""The two expert forms a MoE checkpoint may hold: per expert (`mlp.experts.{e}.*_proj.weight`, as HF writes to
disk) and fused (`mlp.experts.gate_up_proj` / `down_proj`, as HF holds them in memory) load to the same model,
bit for bit; fused tensors that already fit are used without a copy; mixed or missing experts are named."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from qwen_oracle import every_row, hf_checkpoint, hf_model, ours, prompt_tokens, store
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold_qwen import plugin
from tensorfold_qwen.load import load
from tensorfold_qwen.mlp import MoeWeights

FIELDS = dict(num_hidden_layers=2, full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=64)


@attrs.frozen
class InMemory:
    """The loader's view of a checkpoint whose tensors are already in memory (as the GPU benchmark builds it)."""

    config: dict
    held: dict[str, torch.Tensor]

    def names(self) -> list[str]:
        return sorted(self.held)

    def tensors(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.held.items()


def fused(per_expert: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Per-expert tensors rewritten in HF's fused names: gate_up = [gate; up] per expert, stacked."""
    out = {name: t for name, t in per_expert.items() if ".mlp.experts." not in name}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.mlp.experts."
        experts = range(config["num_experts"])
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([per_expert[f"{prefix}{e}.gate_proj.weight"],
                                                               per_expert[f"{prefix}{e}.up_proj.weight"]])
                                                    for e in experts])
        out[prefix + "down_proj"] = torch.stack([per_expert[f"{prefix}{e}.down_proj.weight"] for e in experts])
    return out


def tiny(tmp_path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The family's tiny MoE checkpoint (per expert): its config and tensors."""
    plugin.write_tiny(tmp_path, seed=0, moe=True)
    return Checkpoint(tmp_path).config, load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_5_moe"])
def test_hf_state_dict_with_fused_names_matches_per_expert_bitwise(tmp_path: Path, model_type: str) -> None:
    """HF writes per-expert names; its in-memory state dict has the fused ones. Both load to the same logits."""
    per_expert = hf_checkpoint(tmp_path / "per_expert", model_type, seed=3, **FIELDS)
    state = {name: t.contiguous() for name, t in hf_model(per_expert).state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    fused_dir = tmp_path / "fused"
    shutil.copytree(per_expert, fused_dir)
    save_file(state, str(fused_dir / "model.safetensors"), metadata={"format": "pt"})
    assert not any(".experts.0." in name for name in Checkpoint(fused_dir).names())

    tokens = prompt_tokens(seed=4, length=24)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = ours(per_expert, dtype), ours(fused_dir, dtype)
        assert torch.equal(a.weights.layers[0].ffn.gate_up, b.weights.layers[0].ffn.gate_up)
        assert torch.equal(a.weights.layers[1].ffn.down, b.weights.layers[1].ffn.down)
        assert torch.equal(every_row(a, store(per_expert, dtype), tokens, []),
                           every_row(b, store(fused_dir, dtype), tokens, []))


def test_fused_tensors_that_fit_are_used_without_a_copy(tmp_path: Path) -> None:
    config, tensors = tiny(tmp_path)
    held = fused(tensors, config)
    model = load(InMemory(config, held), torch.float32, torch.device("cpu"), progress=False)
    for i, layer in enumerate(model.weights.layers):
        assert isinstance(layer.ffn, MoeWeights)
        assert layer.ffn.gate_up.data_ptr() == held[f"model.layers.{i}.mlp.experts.gate_up_proj"].data_ptr()
        assert layer.ffn.down.data_ptr() == held[f"model.layers.{i}.mlp.experts.down_proj"].data_ptr()
    stacked = load(InMemory(config, tensors), torch.float32, torch.device("cpu"), progress=False)
    tokens = prompt_tokens(seed=2, length=12)
    assert torch.equal(every_row(model, store(tmp_path), tokens, []), every_row(stacked, store(tmp_path), tokens, []))


def test_per_expert_tensors_stack_gate_rows_then_up_rows(tmp_path: Path) -> None:
    config, tensors = tiny(tmp_path)
    moe = load(InMemory(config, tensors), torch.float32, torch.device("cpu"), progress=False).weights.layers[1].ffn
    F = config["moe_intermediate_size"]
    assert moe.gate_up.shape == (8, 2 * F, config["hidden_size"]) and moe.down.shape == (8, config["hidden_size"], F)
    assert torch.equal(moe.gate_up[5, :F], tensors["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(moe.gate_up[5, F:], tensors["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(moe.down[7], tensors["model.layers.1.mlp.experts.7.down_proj.weight"])


def test_mixed_forms_are_refused(tmp_path: Path) -> None:
    config, tensors = tiny(tmp_path)
    held = fused(tensors, config)
    for name in ("gate_up_proj", "down_proj"):                             # layer 1 back to per-expert names
        del held[f"model.layers.1.mlp.experts.{name}"]
    held.update({name: t for name, t in tensors.items() if name.startswith("model.layers.1.mlp.experts.")})
    with pytest.raises(ValueError, match=r"mixes the two expert forms: 6 fused tensors .* 24 per-expert tensors"):
        load(InMemory(config, held), torch.float32, torch.device("cpu"), progress=False)


def test_missing_and_misshapen_experts_are_named(tmp_path: Path) -> None:
    config, tensors = tiny(tmp_path)
    cpu = torch.device("cpu")

    held = fused(tensors, config)
    del held["model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.down_proj; experts are "
                                         r"read in the fused form"):
        load(InMemory(config, held), torch.float32, cpu, progress=False)

    held = fused(tensors, config)
    held["model.layers.0.mlp.experts.gate_up_proj"] = held["model.layers.0.mlp.experts.gate_up_proj"][:, :32]
    with pytest.raises(ValueError, match=r"gate_up_proj has shape \(8, 32, 64\), the config needs \(8, 64, 64\)"):
        load(InMemory(config, held), torch.float32, cpu, progress=False)

    per = dict(tensors)
    del per["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight; "
                                         r"experts are read in the per-expert form"):
        load(InMemory(config, per), torch.float32, cpu, progress=False)

    none = {name: t for name, t in tensors.items() if ".mlp.experts." not in name}
    with pytest.raises(ValueError, match=r"missing tensors: (model\.layers\.\d\.mlp\.experts\.[^,]*, ){20}\.\.\. "
                                         r"and 76 more"):    # 4 layers · 8 experts · 3
        load(InMemory(config, none), torch.float32, cpu, progress=False)
