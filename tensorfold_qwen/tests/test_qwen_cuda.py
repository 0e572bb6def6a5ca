"""Qwen3.5 on a CUDA device: the kit's contracts hold there too, and fp32 matches the CPU reference.

Skipped without CUDA; run in device sessions (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_qwen import plugin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPT = [(i * 53 + 7) % 500 + 3 for i in range(96)]


@pytest.fixture(scope="module", params=["dense", "moe", "moe-folded"])
def checkpoint(request, tmp_path_factory):
    """"moe-folded": the shared expert runs as one more expert of the grouped call on the GPU (mlp.moe_fused)."""
    directory = tmp_path_factory.mktemp(f"qwen-cuda-{request.param}")
    plugin.write_tiny(directory, seed=1, moe=request.param == "moe", folded=request.param == "moe-folded")
    return directory


@pytest.fixture(scope="module")
def family():
    return load_families(["qwen"])["qwen"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resume_paged_and_batch_invariance_on_cuda(family, checkpoint, dtype):
    subject = kit.load(family, checkpoint, dtype=dtype, device="cuda")
    kit.check_resume_bitwise(subject, PROMPT, at=40, chunk=20)
    kit.check_paged(subject, PROMPT, page_rows=16, chunk=32)
    if dtype == torch.bfloat16:
        kit.check_batch_invariance(subject, PROMPT)


def test_batch_dependence_in_fp32_is_bounded(family, checkpoint):
    """In fp32 a row's GEMMs depend on the batch on the GPU (kernel choice by N): measured and bounded."""
    subject = kit.load(family, checkpoint, dtype=torch.float32, device="cuda")
    try:
        kit.check_batch_invariance(subject, PROMPT)
        print("qwen cuda fp32 batch invariance: bitwise")
    except AssertionError as err:
        worst = float(str(err).rsplit(" ", 1)[-1])
        print(f"qwen cuda fp32 batch dependence: {err}")
        assert worst < 1e-4


def test_cuda_fp32_matches_the_cpu_reference(family, checkpoint):
    cpu = kit.load(family, checkpoint)
    gpu = kit.load(family, checkpoint, device="cuda")
    ours = kit.prefill(gpu, gpu.store(1, 128), 0, PROMPT, 0, len(PROMPT), 32).cpu()
    reference = kit.prefill(cpu, cpu.store(1, 128), 0, PROMPT, 0, len(PROMPT), 32)
    worst = float((ours - reference).abs().max())
    print(f"qwen cuda fp32 vs cpu fp32 max |Δlogit| {worst:.2e}")
    assert worst < 1e-4
