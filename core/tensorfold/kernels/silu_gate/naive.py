"""The elementwise gates in plain torch: the CPU path and the reference the Triton kernels are tested against.

Shapes: N rows, F features. Each op runs in the inputs' dtype as the model code writes it (F.silu / torch.sigmoid
round to that dtype, then the product rounds again), so the bits match tensorfold_qwen's mlp.py / attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """SwiGLU's middle: silu(gate) · up, [N, F] -> [N, F]; with limit L (GLM's swiglu_limit):
    silu(gate.clamp(max=L)) · up.clamp(-L, L)."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The output gate: x · sigmoid(gate). x [N, F], gate [N, F], [N, 1] (one gate per row) or [N, H, D] (heads,
    H·D = F) -> [N, F]."""
    return x * torch.sigmoid(gate.flatten(1) if gate.dim() == 3 else gate)
