"""Partial rotate-half RoPE at absolute positions (Qwen3.5's q/k after their norms).

Shapes: N rows (every stream's rows of a step), H heads, D head_dim, R = rotary_dim rotating dims (even, <= D).
    angle[n, i] = float32(positions[n]) · inv_freq[i]          i < R/2, float32
    out[..., :R] = x[..., :R]·cos + rotate_half(x[..., :R])·sin     cos, sin cast to x's dtype first
    out[..., R:] = x[..., R:]
"""

from __future__ import annotations

import torch

from tensorfold.kernels.backend import use_triton

__all__ = ["apply_rope"]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [N, H, D] float, positions [N] int (absolute), inv_freq [R/2] float, rotary_dim R -> new [N, H, D]."""
    if x.dim() != 3 or not x.dtype.is_floating_point:
        raise ValueError(f"apply_rope: x must be a floating [N, H, D] tensor, got {list(x.shape)} {x.dtype}")
    N, _, D = x.shape
    if not 0 <= rotary_dim <= D or rotary_dim % 2:
        raise ValueError(f"apply_rope: rotary_dim must be even and within [0, D={D}], got {rotary_dim}")
    if positions.shape != (N,) or positions.dtype.is_floating_point or positions.dtype == torch.bool \
            or positions.device != x.device:
        raise ValueError(f"apply_rope: positions must be an integer [N] = [{N}] on {x.device}, "
                         f"got {list(positions.shape)} {positions.dtype} on {positions.device}")
    if inv_freq.shape != (rotary_dim // 2,) or not inv_freq.dtype.is_floating_point or inv_freq.device != x.device:
        raise ValueError(f"apply_rope: inv_freq must be a floating [R/2] = [{rotary_dim // 2}] on {x.device}, "
                         f"got {list(inv_freq.shape)} {inv_freq.dtype} on {inv_freq.device}")
    if use_triton(x):
        from tensorfold.kernels.rope import triton_rope
        return triton_rope.apply_rope(x, positions, inv_freq, rotary_dim)
    from tensorfold.kernels.rope import naive
    return naive.apply_rope(x, positions, inv_freq, rotary_dim)
