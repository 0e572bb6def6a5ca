"""A dense MLP's stacked layout (fused.fuse_mlp): gate and up as row views of one [2F, E] matrix, built by the
loader for a Triton device only, so the GPU path runs one GEMM for both; on the CPU the layout keeps the
reference's values and the step's logits agree with the two-GEMM form to float32 rounding (the CPU's BLAS may
round a product by its operand's address); the identity names it."""

from __future__ import annotations

import pytest
import torch

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_qwen import decode, plugin
from tensorfold_qwen import load as loader
from tensorfold_qwen.fused import fuse_mlp
from tensorfold_qwen.mlp import MlpWeights, swiglu


def mlp(seed: int = 0) -> MlpWeights:
    g = torch.Generator().manual_seed(seed)
    return MlpWeights(*(torch.randn(*shape, generator=g) * shape[-1] ** -0.5
                        for shape in ((48, 32), (48, 32), (32, 48))))


def shares_storage(view: torch.Tensor, whole: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def test_the_stacked_layout_holds_gate_and_up_once():
    w = mlp()
    fused = fuse_mlp(w)
    assert fuse_mlp(fused) is fused
    assert fused.gate_up.shape == (96, 32)
    assert shares_storage(fused.gate_proj, fused.gate_up) and shares_storage(fused.up_proj, fused.gate_up)
    assert torch.equal(fused.gate_proj, w.gate_proj) and torch.equal(fused.up_proj, w.up_proj)
    assert torch.equal(fused.gate_up, torch.cat([w.gate_proj, w.up_proj]))
    assert fused.down_proj is w.down_proj


def test_the_stacked_ffn_is_the_two_gemm_ffn():
    """decode.ffn through the one GEMM equals the reference swiglu to float32 rounding."""
    w = mlp(1)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(decode.ffn(fuse_mlp(w), x), swiglu(w, x), rtol=1e-6, atol=1e-6)


def test_the_loader_stacks_for_a_triton_device_only(tmp_path):
    family = load_families(["qwen"])["qwen"]
    plugin.write_tiny(tmp_path, seed=4)
    plan = StepPlan((StreamStep(0, 0, tuple(range(3, 20))),))
    plain = kit.load(family, tmp_path)
    assert all(layer.ffn.gate_up is None for layer in plain.model.weights.layers)
    stacked = kit.load_as_for_triton(family, tmp_path, loader)
    for mine, theirs in zip(stacked.model.weights.layers, plain.model.weights.layers, strict=True):
        assert mine.ffn.gate_up is not None
        assert torch.equal(mine.ffn.gate_up, torch.cat([theirs.ffn.gate_proj, theirs.ffn.up_proj]))
    torch.testing.assert_close(stacked.model.forward(plan, stacked.store(1, 32)),
                               plain.model.forward(plan, plain.store(1, 32)), rtol=0.0, atol=1e-5)


@pytest.mark.parametrize("moe", [False, True])
def test_the_identity_names_the_stacked_mlp(moe):
    config = {**plugin.TINY_CONFIG, **(plugin.TINY_MOE_CHANGES if moe else {})}
    facts = plugin.family_identity(config, torch.bfloat16)
    assert ("mlp" in facts) != moe
    assert not moe or "experts" in facts


def test_the_identity_names_the_decode_projections(monkeypatch):
    """The input projections' one-launch GEMV changes a decode step's bits: a state kept under one form is not
    resumed under the other."""
    from tensorfold.kernels.linear_norm import ONE_SLICE_FROM
    from tensorfold_qwen import decode

    facts = {}
    for on in (False, True):
        monkeypatch.setattr(decode, "INPUT_GEMV", on)
        facts[on] = plugin.family_identity(plugin.TINY_CONFIG, torch.bfloat16)["projections"]
    assert f"one K slice from {ONE_SLICE_FROM} output features" in facts[True]
    assert "input projections a library GEMM" in facts[False]
