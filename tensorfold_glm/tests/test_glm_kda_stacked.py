"""A KDA layer's stacked layout (fused.fuse_kda): q, k, v, f_a, b, g_a as row views of one matrix, built by the
loader for a Triton device only, so the decode step runs one GEMM over x where it ran six; on the CPU the decode
step through it equals the six GEMMs to float32 rounding (the CPU's BLAS may round a product by its operand's
address), and the layout holds the weights once."""

from __future__ import annotations

import torch
from glm_decode_cases import load_subjects, prefill

from tensorfold.plan import StepPlan, StreamStep
from tensorfold_glm import load as loader
from tensorfold_glm.fused import KDA_INPUTS, fuse_kda
from tensorfold_glm.kda import KdaWeights


def kda_layers(subject) -> list[KdaWeights]:
    return [layer.mixer for layer in subject.model.weights.layers if isinstance(layer.mixer, KdaWeights)]


def test_the_stacked_layout_holds_the_projections_once(tmp_path):
    subject = load_subjects(tmp_path, ["tiny"], [torch.float32])[("tiny", torch.float32)]
    w = kda_layers(subject)[0]
    assert w.inputs is None                                            # the CPU loads the six matrices
    fused = fuse_kda(w)
    assert fuse_kda(fused) is fused
    assert torch.equal(fused.inputs, torch.cat([getattr(w, name) for name in KDA_INPUTS]))
    for name in KDA_INPUTS:
        part = getattr(fused, name)
        assert torch.equal(part, getattr(w, name))
        assert part.untyped_storage().data_ptr() == fused.inputs.untyped_storage().data_ptr()


def test_the_loader_stacks_for_a_triton_device_and_decode_keeps_its_tokens(tmp_path, monkeypatch):
    """Decode rows through the stacked GEMM give the six GEMMs' logits to float32 rounding, step after step."""
    plain = load_subjects(tmp_path / "plain", ["tiny"], [torch.float32])[("tiny", torch.float32)]
    with monkeypatch.context() as mp:
        mp.setattr(loader, "use_triton", lambda tensor: True)
        stacked = load_subjects(tmp_path / "stacked", ["tiny"], [torch.float32])[("tiny", torch.float32)]
    assert kda_layers(stacked) and all(w.inputs is not None for w in kda_layers(stacked))
    logits = []
    for subject in (plain, stacked):
        store = subject.store(1, 64)
        token = prefill(subject, store, {0: 20})[0]
        rows = []
        for position in range(20, 26):
            out = subject.model.forward(StepPlan((StreamStep(0, position, (token,)),)), store)
            rows.append(out)
            token = int(out[-1].argmax())
        logits.append(torch.cat(rows))
    torch.testing.assert_close(logits[1], logits[0], rtol=0.0, atol=1e-5)
