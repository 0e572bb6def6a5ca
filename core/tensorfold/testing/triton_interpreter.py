"""Triton's interpreter made fit for a kernel test on the CPU, shared by the kernel tests and a family's tests of
its Triton path (TRITON_INTERPRET=1 must be set before a kernel module is first imported).

Two triton 3.6 interpreter bugs are patched while `interpreter_fixes()` is entered: range() over a loaded scalar
calls int() on a 1-element array, which numpy >= 2.4 refuses (triton#9171); tl.dot on bf16 multiplies the raw
uint16 bits. And tl.dot is numpy's matmul, whose OpenBLAS kernels round a row differently by its place in the tile
(a GPU's dot does not): here each row is its own product, so a kernel's batch invariance is what a test sees.

`quick_device_calls()`, installed for the whole process, stops the interpreter re-patching triton.language on every
call of a @triton.jit helper inside a kernel (a walk over the language's members each time, most of a helper-heavy
kernel's interpreted time): the launch has patched those modules already and restores them when it ends.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tensorfold.testing.extras import need

pytest = need("pytest", __name__)


def interpreted() -> bool:
    """Triton kernels run in the interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextmanager
def interpreter_fixes() -> Iterator[None]:
    """The patches above, undone on exit; nothing when the interpreter is off or triton is missing."""
    if not interpreted():
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
        a, b = as_f32(a), as_f32(b)
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [np.matmul(row[None, :], b.data, dtype=d.data.dtype) for row in a.data]
        return interpreter.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patched_tensor)
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", patched_dot)
        yield


def interpret_without_cuda() -> None:
    """Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1 unless already set) with
    quick_device_calls; for a conftest, before any kernel module is first imported."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        quick_device_calls()


def quick_device_calls() -> bool:
    """Patch triton's interpreter, once per process, so a helper called inside a launch reuses the language modules
    the launch patched; a helper with modules the launch did not patch, or a call outside a launch, patches as
    before. Returns whether the patch is in place (False without triton or with an interpreter this does not know)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if getattr(original, "quick", False):
        return True
    if original is None or executor is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    grid_call = executor.__call__
    launches: list[set[int]] = []      # per launch in progress: the language modules patched since it began
    known: dict[Callable[..., Any], frozenset[int]] = {}

    def langs(fn: Callable[..., Any]) -> frozenset[int]:
        if fn not in known:
            known[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                  if inspect.ismodule(value) and (value is tl or value is tl.core))
        return known[fn]

    def patch_lang(fn: Callable[..., Any]) -> Any:
        mine = langs(fn)
        if launches and launches[-1] and mine <= launches[-1]:
            return interpreter._LangPatchScope()        # a helper's scope is dropped unrestored: nothing to undo
        scope = original(fn)
        if launches:
            launches[-1].update(mine)    # the launch's own scope, or a helper's that stays patched till the end
        return scope

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang.quick = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch
    return True
