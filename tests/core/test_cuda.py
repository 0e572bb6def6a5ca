"""The template family and the engine on a CUDA device: the same contracts as on the CPU.

Skipped without CUDA; run in device sessions (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.boot import boot
from tensorfold.settings import read_settings
from tensorfold.testing import kit

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPT = [(i * 41 + 13) % 500 + 3 for i in range(96)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resume_is_bitwise_on_cuda(example, tiny_dir, dtype):
    subject = kit.load(example, tiny_dir, dtype=dtype, device="cuda")
    kit.check_resume_bitwise(subject, PROMPT, at=64, chunk=32)


def test_chunked_matches_one_shot_on_cuda(example, tiny_dir):
    subject = kit.load(example, tiny_dir, device="cuda")
    worst = kit.check_chunked(subject, PROMPT, cuts=[7, 32, 64, 80], tolerance=1e-4)
    print(f"cuda fp32 chunked vs one-shot max |Δlogit| {worst:.2e}")


def test_cuda_fp32_matches_the_cpu_reference(example, tiny_dir):
    cpu = kit.load(example, tiny_dir)
    gpu = kit.load(example, tiny_dir, device="cuda")
    ours = kit.prefill(gpu, gpu.store(1, 128), 0, PROMPT, 0, len(PROMPT), 32).cpu()
    reference = kit.prefill(cpu, cpu.store(1, 128), 0, PROMPT, 0, len(PROMPT), 32)
    worst = float((ours - reference).abs().max())
    print(f"cuda fp32 vs cpu fp32 max |Δlogit| {worst:.2e}")
    assert worst < 1e-4


def test_auto_serves_bfloat16_on_cuda(example, tiny_dir):
    settings = read_settings({}, [("TF_EXAMPLE_REQUEST_STARTS", True)], family="example", model=tiny_dir, context=128)
    loaded = boot(settings, example)
    assert loaded.device.type == "cuda" and loaded.dtype == torch.bfloat16
