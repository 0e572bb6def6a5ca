"""Partial rotate-half RoPE in plain torch: the CPU path and the reference the Triton kernel is tested against.

Shapes: N rows, H heads, D head_dim, R rotary dims (even, R <= D). Angles in float32 from absolute positions,
cos and sin cast to x's dtype, then the rotation in x's dtype: the same ops as tensorfold_qwen's
`layers.rope_tables` + `layers.apply_rope`, so the bits match them on the CPU.
"""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """The first R dims of each head rotate by position · inv_freq; the rest pass. x [N, H, D] -> [N, H, D]."""
    angles = positions.float()[:, None] * inv_freq[None, :]                        # [N, R/2] float32
    angles = torch.cat((angles, angles), dim=-1)                                   # [N, R]
    cos = angles.cos().to(x.dtype)[:, None, :]                                     # [N, 1, R]
    sin = angles.sin().to(x.dtype)[:, None, :]                                     # [N, 1, R]
    turning, passing = x[..., :rotary_dim], x[..., rotary_dim:]                    # [N, H, R], [N, H, D-R]
    first, second = turning.chunk(2, dim=-1)                                       # [N, H, R/2] each
    turned = turning * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((turned, passing), dim=-1)                                    # [N, H, D]
