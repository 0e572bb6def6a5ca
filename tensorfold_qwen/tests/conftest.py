"""Fixtures every qwen family test uses: its own working directory and one torch thread (tensorfold.testing).
Without CUDA, triton kernels (the MoE's fused path) run in triton's interpreter, chosen before a kernel module is
first imported."""

from __future__ import annotations

from tensorfold.testing import triton_interpreter
from tensorfold.testing.fixtures import one_thread, own_cwd  # noqa: F401  (imported fixtures are active)

triton_interpreter.interpret_without_cuda()
