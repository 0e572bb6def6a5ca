"""A decode step's projections of a few rows, and a projection fused with the residual add and the next RMSNorm.

`linear(x, weight)` is `F.linear(x, weight)`: on a Triton device, for at most ROWS_UP_TO rows, a split-K GEMV
(triton_linear_norm: a partial-sums launch and a sum launch, each with programmatic dependent launch), else torch's.
`linear_then_norm(x, weight, residual, norm_weight, eps, zero_centred=)` is
`rms_norm(linear(x, weight), norm_weight, eps, zero_centred=, residual=residual)`, bit for bit, in two launches
where the Triton GEMV applies (the norm reads the partial sums itself) instead of the library GEMM's one or two
and the norm's. A family uses both in its decode step so that a row's bits do not depend on whether the norm came
fused: the GEMV where the norm is apart (a batched step's one-row streams), the fused form where it follows.

A projection at least ONE_SLICE_FROM features wide (a mixer's stacked input projection) has N blocks enough for
the SMs: its GEMV is one K slice, rounded and stored by the partial-sums launch itself, one launch in all
(`one_launch`); narrower ones (an output projection) split K in two.

`ENABLED` (a module constant) turns the Triton GEMV off everywhere at once, for an A/B on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.rmsnorm import rms_norm

__all__ = ["ENABLED", "ONE_SLICE_FROM", "ROWS_UP_TO", "SPLIT_K", "applies", "linear", "linear_then_norm",
           "one_launch"]

ENABLED = True
ROWS_UP_TO = 16     # one 16-row dot tile in the GEMV: a decode step's rows up to 16 streams
ONE_SLICE_FROM = 8192   # output features from which the GEMV is one K slice in one launch
SPLIT_K = 2         # K slices of a narrower projection's GEMV, each its own program (partial sums in float32)


def applies(x: torch.Tensor) -> bool:
    """The Triton GEMV runs for x: a Triton device, at most ROWS_UP_TO rows, switched on."""
    return ENABLED and use_triton(x) and x.dim() == 2 and x.shape[0] <= ROWS_UP_TO


def one_launch(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """linear(x, weight) is the Triton GEMV in one launch: it applies and the weight is ONE_SLICE_FROM rows or more."""
    return applies(x) and weight.shape[0] >= ONE_SLICE_FROM


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
