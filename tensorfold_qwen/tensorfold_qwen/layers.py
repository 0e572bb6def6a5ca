"""The small pieces: zero-centred and gated RMSNorm, partial rotate-half RoPE.

Shapes in comments: T rows of this step, D head_dim, R rotary dims (R <= D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (layer, q/k and final norms): x̂·(1 + w), all in float32, then back to x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: plain w·x̂ (x̂ back in x's dtype first), then ·silu(z) in float32, back to x's dtype."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def inverse_frequencies(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE frequencies over the rotary part of a head: [R/2], float32."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
    return 1.0 / (theta ** (steps / rotary_dim))


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for absolute positions [T] -> two [T, 1, R] tables (angles in float32, then cast)."""
    angles = positions.float()[:, None] * inv_freq[None, :]          # [T, R/2]
    angles = torch.cat((angles, angles), dim=-1)                      # [T, R]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotate-half RoPE: the first R dims of each head rotate, the rest pass. x: [T, heads, D]."""
    rotary = cos.shape[-1]
    turning, passing = x[..., :rotary], x[..., rotary:]               # [T, heads, R], [T, heads, D-R]
    first, second = turning.chunk(2, dim=-1)                          # [T, heads, R/2] each
    turned = turning * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((turned, passing), dim=-1)                       # [T, heads, D]
