"""The nemotron family on a CUDA device: fp32 logits on the GPU (naive SSD on the absolute grid, Triton conv and
decode step, grouped experts) against the CPU reference; in bf16 (fla's chunked SSD when fla-core imports) through
the kit: resumed == fresh, paged == contiguous and batch invariance, bit for bit. Skipped without CUDA; run in
device sessions (`pytest -m gpu`)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tensorfold.plan import StepPlan, StreamStep
from tensorfold.plugins import load_families
from tensorfold.testing import kit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPT = [(i * 53 + 7) % 500 + 3 for i in range(100)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nemotron-cuda")
    load_families(["nemotron"])["nemotron"].make_tiny(directory, seed=9)
    return directory


def subject(checkpoint, dtype: torch.dtype, device: str):
    return kit.load(load_families(["nemotron"])["nemotron"], checkpoint, dtype=dtype, device=device)


def every_row(subject, tokens, cuts=()) -> torch.Tensor:
    kv = subject.store(1, len(tokens) + 1)
    points = [0, *cuts, len(tokens)]
    return torch.cat([subject.model.forward_all(StepPlan((StreamStep(0, a, tuple(tokens[a:b])),)), kv).cpu()
                      for a, b in itertools.pairwise(points)])


def test_fp32_on_the_gpu_matches_the_cpu_reference(checkpoint):
    cpu, cuda = subject(checkpoint, torch.float32, "cpu"), subject(checkpoint, torch.float32, "cuda")
    reference = every_row(cpu, PROMPT)
    for cuts in ((), (1, 2, 3, 40, 64, 65)):
        diff = (reference - every_row(cuda, PROMPT, cuts)).abs().max().item()
        print(f"nemotron fp32 GPU (cuts {cuts}) vs CPU, {len(PROMPT)} rows: max |Δlogit| {diff:.3e}")
        assert diff < 1e-3


@pytest.mark.parametrize("at", [13, 40, 64, 70])
def test_resumed_equals_fresh_bitwise_in_bf16(checkpoint, at):
    assert kit.check_resume_bitwise(subject(checkpoint, torch.bfloat16, "cuda"), PROMPT, at, chunk=32) > 0


def test_paged_equals_contiguous_and_batch_invariant_in_bf16(checkpoint):
    cuda = subject(checkpoint, torch.bfloat16, "cuda")
    kit.check_paged(cuda, PROMPT, page_rows=16, chunk=32)
    kit.check_batch_invariance(cuda, PROMPT)
