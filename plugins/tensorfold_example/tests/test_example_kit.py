"""The conformance kit on the example family, as every family's own tests run it."""

from __future__ import annotations

import pytest
import torch

from tensorfold.plugins import load_families
from tensorfold.testing import kit

PROMPT = [(i * 53 + 7) % 500 + 3 for i in range(96)]


@pytest.fixture(scope="module")
def family():
    return load_families(["example"])["example"]


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    directory = tmp_path_factory.mktemp("example-kit")
    family.make_tiny(directory, seed=1)
    return directory


def test_declarations(family, checkpoint):
    kit.check_declarations(family, checkpoint)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("at, chunk", [(32, 32), (64, 32), (40, 20)])
def test_resume_is_bitwise(family, checkpoint, dtype, at, chunk):
    subject = kit.load(family, checkpoint, dtype=dtype)
    kit.check_resume_bitwise(subject, PROMPT, at=at, chunk=chunk)


def test_chunked_vs_one_shot(family, checkpoint):
    subject = kit.load(family, checkpoint)
    worst = kit.check_chunked(subject, PROMPT, cuts=[1, 9, 33, 64, 90], tolerance=1e-4)
    print(f"example chunked vs one-shot max |Δlogit| {worst:.2e}")


def test_paged_equals_window(family, checkpoint):
    kit.check_paged(kit.load(family, checkpoint), PROMPT, page_rows=16, chunk=32)


def test_batch_invariance(family, checkpoint):
    kit.check_batch_invariance(kit.load(family, checkpoint), PROMPT)
