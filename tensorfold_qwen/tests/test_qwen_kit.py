"""The conformance kit on the qwen family: the dense tiny checkpoint (the embedded default) and its MoE twin.

Resume points include ones inside a GDN chunk of 64 (32, 40, 80) and a prefill chunk that crosses one (80).
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.plugins import load_families
from tensorfold.testing import kit
from tensorfold_qwen import plugin

PROMPT = [(i * 53 + 7) % 500 + 3 for i in range(96)]
VARIANTS = ["dense", "moe"]


@pytest.fixture(scope="module")
def family():
    return load_families(["qwen"])["qwen"]


@pytest.fixture(scope="module")
def checkpoints(family, tmp_path_factory):
    found = {}
    for variant in VARIANTS:
        directory = tmp_path_factory.mktemp(f"qwen-kit-{variant}")
        if variant == "dense":
            family.make_tiny(directory, seed=1)
        else:
            plugin.write_tiny(directory, seed=1, moe=True)
        found[variant] = directory
    return found


@pytest.fixture(scope="module")
def subjects(family, checkpoints):
    return {(variant, dtype): kit.load(family, checkpoints[variant], dtype=dtype)
            for variant in VARIANTS for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_declarations(family, checkpoints, variant):
    kit.check_declarations(family, checkpoints[variant])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("at, chunk", [(32, 16), (40, 20), (64, 32), (80, 80)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_is_bitwise(subjects, variant, dtype, at, chunk):
    kit.check_resume_bitwise(subjects[variant, dtype], PROMPT, at=at, chunk=chunk)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_vs_one_shot(subjects, variant):
    worst = kit.check_chunked(subjects[variant, torch.float32], PROMPT, cuts=[1, 9, 33, 64, 65, 90], tolerance=1e-4)
    print(f"\n[qwen kit {variant}] chunked vs one-shot max |Δlogit| {worst:.2e}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_equals_window(subjects, variant):
    kit.check_paged(subjects[variant, torch.float32], PROMPT, page_rows=16, chunk=32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_invariance(subjects, variant):
    kit.check_batch_invariance(subjects[variant, torch.float32], PROMPT)
