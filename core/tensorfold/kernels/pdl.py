"""Programmatic dependent launch (PDL) for the decode step's small Triton kernels.

A decode step is hundreds of kernels of a few microseconds each, so the gap between one kernel's last program and
the next kernel's first is a real share of the step. With PDL (sm_90 and later) a kernel launched with
`launch_pdl=True` may be scheduled while the kernel before it in the stream is still running; each of our kernels
then waits for that kernel to finish (`griddepcontrol.wait`: its writes visible) before its first memory access, and
only after that lets the kernel behind it launch (`griddepcontrol.launch_dependents`), so at most one kernel waits
ahead. What a kernel computes, and in what order, is untouched: PDL changes when a program starts, never what it
reads or writes, so every bit is the same with it on or off. A kernel next to a library kernel (cuBLAS, torch's
own) simply waits for it as before. CUDA graphs keep the launches' PDL edges when they capture them.

`ENABLED` (a module constant, like the KDA step's `FLA_STEP_IN_PLACE`) turns it off for every kernel at once, for an
A/B on the device; triton's interpreter (the CPU tests) never takes it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True


@functools.cache
def _capable(index: int) -> bool:
    """The device can launch with PDL (sm_90 and later)."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def options(t: torch.Tensor) -> dict[str, bool]:
    """A launch's keyword arguments for a kernel whose tensors live with `t`: PDL on where it applies, else none."""
    if not (ENABLED and t.is_cuda):
        return {}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _capable(index) else {}


@triton.jit
def ordered(PDL: tl.constexpr):
    """A kernel's first statement: wait for the kernel before to finish, then let the kernel behind launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
