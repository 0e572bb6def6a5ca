"""Kernel tests run the Triton versions on the GPU when there is one, else in triton's interpreter on the CPU
(small shapes). The interpreter must be chosen before a kernel module is first imported."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items):
    """Without triton installed, the kernel tests that need it are skipped (the naive ones still run)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="triton is not installed")
        for item in items:
            if "triton" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where kernel tests put their tensors."""
    return "cuda" if torch.cuda.is_available() else "cpu"
