"""RMSNorm in plain torch: the CPU path and the reference the Triton kernel is tested against.

Shapes: N rows, D features (H heads of D for the gated norm). Float32 math, one cast back to x's dtype, in the
same order as tensorfold_qwen's `layers.rms_norm` / `layers.gated_rms_norm`, so the bits match them on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centred: bool,
             residual: torch.Tensor | None = None, weight_after_cast: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x̂·(1 + w) (zero-centred) or x̂·w, float32 then back to x's dtype (weight_after_cast: w · x̂ rounded to x's
    dtype, the product rounded again). x [N, D], weight [D] -> [N, D]; with residual [N, D]: s = x + residual (in
    x's dtype) is normalised and (out, s) returned."""
    if residual is not None:
        x = x + residual                                                           # [N, D], rounded once
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)            # [N, D] float32
    if weight_after_cast:
        out = (weight.float() * normed.to(x.dtype).float()).to(x.dtype)
        return out if residual is None else (out, x)
    scale = 1.0 + weight.float() if zero_centred else weight.float()               # [D] float32
    out = (normed * scale).to(x.dtype)
    return out if residual is None else (out, x)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: w · x̂ (x̂ back in x's dtype first) · silu(z) in float32, back to x's dtype.
    x, z [N, H, D], weight [D] -> [N, H, D]."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)   # [N, H, D]
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def grouped_gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                           eps: float) -> torch.Tensor:
    """Mamba2's output norm (Nemotron-H's `norms.gated_rms_norm`, op for op): y·silu(z) in float32, RMS-normalised
    within each of `groups` groups of I/groups channels, to weight's dtype, then ·w (in weight's dtype).
    y, z [N, I], weight [I] -> [N, I] in weight's dtype."""
    gated = y.float() * F.silu(z.float())                                          # [N, I]
    grouped = gated.view(*gated.shape[:-1], groups, -1)                            # [N, G, I/G]
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.view(gated.shape).to(weight.dtype)
