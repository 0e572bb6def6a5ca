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


@pytest.fixture(scope="module")
def interpreter_fixes():
    """Two triton 3.6 interpreter bugs, patched for a module that asks for this (pytestmark usefixtures): range()
    over a loaded scalar calls int() on a 1-element array, which numpy >= 2.4 refuses (triton#9171); tl.dot on bf16
    multiplies the raw uint16 bits."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    patch_tensor, create_dot = interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def as_f32(h):
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, as_f32(a), as_f32(b), d, input_precision, max_num_imprecise_acc)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patched_tensor)
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", patched_dot)
        yield
