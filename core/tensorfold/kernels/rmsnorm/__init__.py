"""RMSNorm: plain (x̂·w) or zero-centred (x̂·(1 + w), Qwen3.5's layer and q/k norms), optionally fused with the
residual add; the gated norm of the GDN output (w·x̂·silu(z)); and Mamba2's grouped gated norm (Nemotron-H:
w·norm_groups(y·silu(z))).

Shapes: N rows (every stream's rows of a step, or rows × heads), H heads, D features.
Math in float32 with one cast back to x's dtype, in tensorfold_qwen's `layers` order.
"""

from __future__ import annotations

import torch

from tensorfold.kernels.backend import use_triton

__all__ = ["gated_rms_norm", "grouped_gated_rms_norm", "rms_norm"]


def _check(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor,
           same_dtype: bool = True) -> None:
    """t has the given shape, is floating and sits on x's device (and has x's dtype when same_dtype)."""
    if tuple(t.shape) != shape or not t.dtype.is_floating_point or t.device != x.device \
            or (same_dtype and t.dtype != x.dtype):
        want = f"{x.dtype} " if same_dtype else "floating "
        raise ValueError(f"{op}: {name} must be {list(shape)} {want}on {x.device}, "
                         f"got {list(t.shape)} {t.dtype} on {t.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centred: bool,
             residual: torch.Tensor | None = None, weight_after_cast: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [N, D], weight [D] -> out [N, D] in x's dtype. With residual [N, D] (x's dtype): out = norm(x + residual)
    and returns (out, x + residual), the sum rounded to x's dtype as an unfused `x + residual` is.
    weight_after_cast (plain weights only): w · (x̂ rounded to x's dtype), the product rounded again, the order of
    HF's Llama-style norm (`weight * hidden.to(dtype)`, GLM-5's) for a weight in x's dtype or float32."""
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"rms_norm: x must be a floating [N, D] tensor, got {list(x.shape)} {x.dtype}")
    if weight_after_cast and zero_centred:
        raise ValueError("rms_norm: weight_after_cast takes a plain weight, not a zero-centred one")
    _check("rms_norm", "weight", weight, (x.shape[1],), x, same_dtype=False)
    if residual is not None:
        _check("rms_norm", "residual", residual, tuple(x.shape), x)
    if use_triton(x):
        from tensorfold.kernels.rmsnorm import triton_rmsnorm
        return triton_rmsnorm.rms_norm(x, weight, eps, zero_centred=zero_centred, residual=residual,
                                       weight_after_cast=weight_after_cast)
    from tensorfold.kernels.rmsnorm import naive
    return naive.rms_norm(x, weight, eps, zero_centred=zero_centred, residual=residual,
                          weight_after_cast=weight_after_cast)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H, D], z [N, H, D] (any float dtype), weight [D] (plain, not zero-centred) -> [N, H, D] in x's dtype:
    w · x̂ · silu(z), x̂ rounded to x's dtype first as the reference does."""
    if x.dim() != 3 or not x.dtype.is_floating_point:
        raise ValueError(f"gated_rms_norm: x must be a floating [N, H, D] tensor, got {list(x.shape)} {x.dtype}")
    _check("gated_rms_norm", "z", z, tuple(x.shape), x, same_dtype=False)
    _check("gated_rms_norm", "weight", weight, (x.shape[2],), x, same_dtype=False)
    if use_triton(x):
        from tensorfold.kernels.rmsnorm import triton_rmsnorm
        return triton_rmsnorm.gated_rms_norm(x, z, weight, eps)
    from tensorfold.kernels.rmsnorm import naive
    return naive.gated_rms_norm(x, z, weight, eps)


def grouped_gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                           eps: float) -> torch.Tensor:
    """Mamba2's output norm, in Nemotron-H's `norms.gated_rms_norm` order. y [N, I] (any float dtype, read as
    float32), z [N, I] (any float dtype), weight [I] -> [N, I] in weight's dtype: g = y·silu(z) in float32,
    normalised within each of `groups` groups of I/groups channels, rounded to weight's dtype, then ·w (a product in
    weight's dtype)."""
    if y.dim() != 2 or not y.dtype.is_floating_point:
        raise ValueError(f"grouped_gated_rms_norm: y must be a floating [N, I] tensor, got {list(y.shape)} {y.dtype}")
    _check("grouped_gated_rms_norm", "z", z, tuple(y.shape), y, same_dtype=False)
    _check("grouped_gated_rms_norm", "weight", weight, (y.shape[1],), y, same_dtype=False)
    if groups <= 0 or y.shape[1] % groups:
        raise ValueError(f"grouped_gated_rms_norm: I ({y.shape[1]}) must be a positive multiple of groups ({groups})")
    if use_triton(y):
        from tensorfold.kernels.rmsnorm import triton_rmsnorm
        return triton_rmsnorm.grouped_gated_rms_norm(y, z, weight, groups, eps)
    from tensorfold.kernels.rmsnorm import naive
    return naive.grouped_gated_rms_norm(y, z, weight, groups, eps)
