"""Nemotron-H's two RMSNorms, in HF's order of roundings.

Shapes in comments: T rows, E hidden, I the Mamba2 inner width, G groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The block and final norm: w·x̂ with the product in float32, then back to x's dtype (not zero-centred)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """The Mamba2 output norm: y·silu(z) in float32, RMS-normalised within each of G groups of I/G channels, back
    to the model's dtype, then ·w. y, z [T, I] -> [T, I] in weight's dtype."""
    gated = y.float() * F.silu(z.float())                                          # [T, I]
    grouped = gated.view(*gated.shape[:-1], groups, -1)                            # [T, G, I/G]
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.view(gated.shape).to(weight.dtype)
