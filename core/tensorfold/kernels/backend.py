"""Whether the Triton path can run for a tensor: on CUDA with triton installed. (CPU tests call an op's triton
module directly under triton's own interpreter, TRITON_INTERPRET=1, on small shapes.)"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_installed() -> bool:
    """Triton can be imported (it is optional: the `gpu` extra)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor) -> bool:
    """The fast path applies to this tensor."""
    return tensor.is_cuda and triton_installed()
