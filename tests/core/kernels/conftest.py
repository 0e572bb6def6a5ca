"""Kernel tests run the Triton versions on the GPU when there is one, else in triton's interpreter on the CPU
(small shapes). The interpreter must be chosen before a kernel module is first imported."""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from tensorfold.testing import triton_interpreter

triton_interpreter.interpret_without_cuda()


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
    """Two triton 3.6 interpreter bugs patched, and tl.dot row by row, for a module that asks for this (pytestmark
    usefixtures): tensorfold.testing.triton_interpreter says which."""
    with triton_interpreter.interpreter_fixes():
        yield


@pytest.fixture
def fla_interpreted(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """A function that puts fla's kernels in triton's interpreter for one test of an fla adapter's glue on the CPU:
    `fla_interpreted(fla_backend, *modules)` skips unless this can run, imports `modules` (fla kernels the adapter
    imports only when called), and applies three shims, undone after the test, because fla targets the compiler:
    a size-1 scalar converts to int; autotuning takes the first config (it cannot time anything); a kernel's
    `range` over a runtime count yields tensors, as the compiler's does."""

    def interpret(backend: ModuleType, *modules: str) -> None:
        if torch.cuda.is_available():
            pytest.skip("the GPU tests run fla itself")
        if importlib.util.find_spec("fla") is None:
            pytest.skip("fla-core is not installed")
        import numpy as np
        import triton.language as tl
        import triton.runtime.interpreter as interpreter
        from triton.runtime import autotuner
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs triton's interpreter (TRITON_INTERPRET=1, set above without CUDA)")
        if not hasattr(interpreter, "_patch_lang_tensor") or not hasattr(interpreter, "TensorHandle"):
            pytest.skip("this triton's interpreter lacks the hooks the shims use")
        original_patch, original_run = interpreter._patch_lang_tensor, autotuner.Autotuner.run

        def patch_lang_tensor(tensor, scope):
            original_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        def first_config(self, *args, **kwargs):
            configs, self.configs = self.configs, self.configs[:1]
            try:
                return original_run(self, *args, **kwargs)
            finally:
                self.configs = configs

        def kernel_range(*bounds):
            if not any(hasattr(b, "handle") for b in bounds):
                yield from builtins.range(*bounds)
                return
            ints = [int(b.handle.data.reshape(-1)[0]) if hasattr(b, "handle") else int(b) for b in bounds]
            for i in builtins.range(*ints):
                yield tl.core.tensor(interpreter.TensorHandle(np.array(i, dtype=np.int32), tl.int32), tl.int32)

        monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        monkeypatch.setattr(autotuner.Autotuner, "run", first_config)
        if not backend.available():
            pytest.skip("fla-core does not import here")
        for module in modules:
            importlib.import_module(module)
        for name, module in list(sys.modules.items()):
            if name.startswith("fla.ops.") and not name.endswith(".naive"):
                monkeypatch.setattr(module, "range", kernel_range, raising=False)

    return interpret


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Each kernel test draws its inputs from the same global seed whatever ran before it: a low-precision
    comparison's margin depends on the draw, so unseeded draws made the suite's result depend on test order."""
    torch.manual_seed(0)
