"""The GPU tests' two checks on a call a decode step captures: it never waits on the host, and it replays from a CUDA
graph (captured as torch asks: after a warm run on a side stream)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def without_host_sync(call: Callable[[], T]) -> T:
    """`call`'s result, run with every host sync raising (warm it first: a first call compiles)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return call()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def captured(call: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """`call` captured in a CUDA graph, and the outputs the capture wrote (each replay writes them again)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out
