"""A decode step's projections of a few rows, and a projection fused with the residual add and the next RMSNorm.

`linear(x, weight)` is `F.linear(x, weight)`: on a Triton device, for at most ROWS_UP_TO rows, a split-K GEMV
(triton_linear_norm: a partial-sums launch and a sum launch, each with programmatic dependent launch), else torch's.
`linear_then_norm(x, weight, residual, norm_weight, eps, zero_centred=)` is
`rms_norm(linear(x, weight), norm_weight, eps, zero_centred=, residual=residual)`, bit for bit, in two launches
where the Triton GEMV applies (the norm reads the partial sums itself) instead of the library GEMM's one or two
and the norm's. A family uses both in its decode step so that a row's bits do not depend on whether the norm came
fused: the GEMV where the norm is apart (a batched step's one-row streams), the fused form where it follows.

`ENABLED` (a module constant) turns the Triton GEMV off everywhere at once, for an A/B on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.rmsnorm import rms_norm

__all__ = ["ENABLED", "ROWS_UP_TO", "applies", "linear", "linear_then_norm"]

ENABLED = True
ROWS_UP_TO = 16     # one 16-row dot tile in the GEMV: a decode step's rows up to 16 streams


def applies(x: torch.Tensor) -> bool:
    """The Triton GEMV runs for x: a Triton device, at most ROWS_UP_TO rows, switched on."""
    return ENABLED and use_triton(x) and x.dim() == 2 and x.shape[0] <= ROWS_UP_TO


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"linear_norm: x [M, K] and weight [N, K] of one dtype, got {list(x.shape)} {x.dtype} "
                         f"and {list(weight.shape)} {weight.dtype}")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [N, K] -> x @ weightᵀ [M, N]."""
    _check(x, weight)
    if applies(x):
        from tensorfold.kernels.linear_norm import triton_linear_norm
        return triton_linear_norm.linear(x, weight)
    return F.linear(x, weight)


def linear_then_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, *, zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [D, K], residual [M, D] -> (norm(s), s = residual + x @ weightᵀ), as rms_norm returns."""
    _check(x, weight)
    if tuple(residual.shape) != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype:
        raise ValueError(f"linear_norm: residual must be [{x.shape[0]}, {weight.shape[0]}] {x.dtype}, got "
                         f"{list(residual.shape)} {residual.dtype}")
    if tuple(norm_weight.shape) != (weight.shape[0],):
        raise ValueError(f"linear_norm: norm_weight must be [{weight.shape[0]}], got {list(norm_weight.shape)}")
    if applies(x):
        from tensorfold.kernels.linear_norm import triton_linear_norm
        return triton_linear_norm.linear_then_norm(x, weight, residual, norm_weight, eps, zero_centred)
    return rms_norm(F.linear(x, weight), norm_weight, eps, zero_centred=zero_centred, residual=residual)
