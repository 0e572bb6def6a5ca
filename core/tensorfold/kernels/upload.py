"""Host ints onto the device without a wait: `torch.tensor(values, device="cuda")` copies from pageable memory and
then blocks until the stream has drained, so every index a step builds that way leaves the GPU idle while the host
catches up; a copy from pinned memory is enqueued behind the work already there and costs no wait."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ints(values: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` as a 1-D `dtype` tensor on `device`, enqueued on the current stream (a pinned staging copy on CUDA,
    which torch's pinned allocator keeps until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
