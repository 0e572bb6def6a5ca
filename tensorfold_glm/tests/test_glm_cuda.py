"""The glm family on a CUDA device: fp32 logits on the GPU (grouped experts, blocked attention) against the CPU
reference; in bf16 through the kit, resumed == fresh and paged == contiguous, bit for bit. Skipped without CUDA;
run in device sessions (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPT = [(i * 53 + 7) % 500 + 3 for i in range(100)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("glm-cuda")
    load_families(["glm"])["glm"].make_tiny(directory, seed=9)
    return directory


def every_row(subject, tokens) -> torch.Tensor:
    kv = subject.store(1, len(tokens) + 1)
    return subject.model.forward_all(StepPlan((StreamStep(0, 0, tuple(tokens)),)), kv).cpu()


def test_fp32_on_the_gpu_matches_the_cpu_reference(checkpoint):
    family = load_families(["glm"])["glm"]
    cpu = kit.load(family, checkpoint, dtype=torch.float32, device="cpu")
    cuda = kit.load(family, checkpoint, dtype=torch.float32, device="cuda")
    diff = (every_row(cpu, PROMPT) - every_row(cuda, PROMPT)).abs().max().item()
    print(f"glm fp32 GPU vs CPU, {len(PROMPT)} rows: max |Δlogit| {diff:.3e}")
    assert diff < 1e-3


@pytest.mark.parametrize("at", [13, 16, 64, 70])
def test_resumed_equals_fresh_bitwise_in_bf16(checkpoint, at):
    subject = kit.load(load_families(["glm"])["glm"], checkpoint, dtype=torch.bfloat16, device="cuda")
    assert kit.check_resume_bitwise(subject, PROMPT, at, chunk=32) > 0


def test_paged_equals_contiguous_in_bf16(checkpoint):
    subject = kit.load(load_families(["glm"])["glm"], checkpoint, dtype=torch.bfloat16, device="cuda")
    kit.check_paged(subject, PROMPT, page_rows=16, chunk=32)
