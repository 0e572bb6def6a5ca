"""The loader reads HF's in-memory form (a state_dict: one conv per KDA layer, forget_gate.*, {attn,ffn}_hc.*, fused
experts) as it reads the on-disk form, into the same weights; a mixed or incomplete one is refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorfold.checkpoint import Checkpoint
from tensorfold_glm import plugin
from tensorfold_glm.load import load


def in_memory_form(disk: Path, target: Path) -> None:
    """The on-disk checkpoint rewritten in HF's in-memory names, by HF itself (load, then save its state_dict)."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    hf = transformers.Glm5NextForConditionalGeneration.from_pretrained(disk, dtype=torch.float32)
    shutil.copytree(disk, target)
    (target / "model.safetensors").unlink()
    state = {name: tensor.contiguous() for name, tensor in hf.state_dict().items() if "visual" not in name}
    save_file(state, str(target / "model.safetensors"))


def test_the_in_memory_form_loads_into_the_same_weights(tmp_path):
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    plugin.write_tiny(disk, seed=4)
    in_memory_form(disk, memory)
    names = set(load_file(str(memory / "model.safetensors")))
    assert any(n.endswith("self_attn.conv1d.weight") for n in names)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert any(".attn_hc.fn" in n for n in names) and any(".forget_gate.A_log" in n for n in names)
    a = load(Checkpoint(disk), torch.bfloat16, torch.device("cpu"), progress=False)
    b = load(Checkpoint(memory), torch.bfloat16, torch.device("cpu"), progress=False)
    for left, right in zip(a.weights.layers, b.weights.layers, strict=True):
        for field in ("mixer", "ffn", "attn_hc", "ffn_hc"):
            one, two = getattr(left, field), getattr(right, field)
            for name in type(one).__attrs_attrs__:
                x, y = getattr(one, name.name), getattr(two, name.name)
                if isinstance(x, torch.Tensor):
                    assert x.dtype == y.dtype and torch.equal(x, y), f"{field}.{name.name}"
    assert b.weights.layers[0].mixer.conv.dtype == torch.float32      # HF keeps the convs in float32


def test_a_checkpoint_missing_a_fused_tensor_is_refused_by_name(tmp_path):
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    plugin.write_tiny(disk, seed=4)
    in_memory_form(disk, memory)
    state = load_file(str(memory / "model.safetensors"))
    gone = next(n for n in state if n.endswith("mlp.experts.down_proj"))
    del state[gone]
    save_file(state, str(memory / "model.safetensors"))
    with pytest.raises(ValueError, match=f"missing tensors: {gone}"):
        load(Checkpoint(memory), torch.float32, torch.device("cpu"), progress=False)
