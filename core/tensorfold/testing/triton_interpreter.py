"""Triton's interpreter made fit for a kernel test on the CPU, shared by the kernel tests and a family's tests of
its Triton path (TRITON_INTERPRET=1 must be set before a kernel module is first imported).

Two triton 3.6 interpreter bugs are patched while `interpreter_fixes()` is entered: range() over a loaded scalar
calls int() on a 1-element array, which numpy >= 2.4 refuses (triton#9171); tl.dot on bf16 multiplies the raw
uint16 bits. And tl.dot is numpy's matmul, whose OpenBLAS kernels round a row differently by its place in the tile
(a GPU's dot does not): here each row is its own product, so a kernel's batch invariance is what a test sees.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

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
