"""Whether the Triton path can run for a tensor: on CUDA with triton installed. (CPU tests call an op's triton
module directly under triton's own interpreter, TRITON_INTERPRET=1, on small shapes.)"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch


@functools.cache
def triton_installed() -> bool:
    """Triton can be imported (it is optional: the `gpu` extra)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor) -> bool:
    """The fast path applies to this tensor."""
    return tensor.is_cuda and triton_installed()


def pick_chunk(device: torch.device | str, fla_available: Callable[[], bool]) -> str:
    """The prefill backend an op with an fla form picks by device: fla on CUDA when it imports, else naive."""
    return "fla" if torch.device(device).type == "cuda" and fla_available() else "naive"


def pick_step(device: torch.device | str, fla_available: Callable[[], bool]) -> str:
    """The decode-step backend such an op picks: naive off CUDA; on CUDA ours (Triton), else fla, else naive."""
    if torch.device(device).type != "cuda":
        return "naive"
    if triton_installed():
        return "triton"
    return "fla" if fla_available() else "naive"
