"""Depthwise causal conv1d + SiLU with per-stream tails (the GDN / Mamba short conv).

Shapes: T rows of one stream, B streams of one row each, S slots, C channels, K kernel width.
A stream's tail [C, K-1] holds its last K-1 conv inputs (in x's dtype); a fresh stream's tail is zeros.
    prefill: y = silu(conv([tail | x])) over one stream's T rows; tail <- last K-1 columns of [tail | x]
    update:  the same for one row of each of B streams, tails[slots] shifted in place (the decode step)
"""

from __future__ import annotations

import torch

from tensorfold.kernels.backend import use_triton

__all__ = ["causal_conv1d_prefill", "causal_conv1d_update"]


def _check_weights(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Shared checks on x [*, C], weight [C, K] and bias [C]; returns K."""
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [rows, C], got shape {tuple(x.shape)}")
    C = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"{op}: weight must be [C, K] = [{C}, K>=1], got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"{op}: weight must match x's dtype and device ({x.dtype}, {x.device}), "
                         f"got {weight.dtype}, {weight.device}")
    if bias is not None and (bias.shape != (C,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"{op}: bias must be [{C}] in {x.dtype} on {x.device}, "
                         f"got shape {tuple(bias.shape)}, {bias.dtype}, {bias.device}")
    return weight.shape[1]


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor,
                          bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """One stream's T rows: x [T, C], weight [C, K], tail [C, K-1] (x's dtype, updated in place),
    bias [C] | None -> y [T, C] in x's dtype. On the GPU, K > 4 takes the torch path (F.conv1d).

    out [T, C] (x's dtype and device, unit stride on C), when given, receives y and is returned: a packed step
    writes each stream's rows into its slice of one buffer instead of concatenating copies."""
    K = _check_weights("causal_conv1d_prefill", x, weight, bias)
    C = x.shape[1]
    if tail.shape != (C, K - 1) or tail.dtype != x.dtype or tail.device != x.device:
        raise ValueError(f"causal_conv1d_prefill: tail must be [C, K-1] = [{C}, {K - 1}] in {x.dtype} on "
                         f"{x.device}, got shape {tuple(tail.shape)}, {tail.dtype}, {tail.device}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device
                            or (C > 1 and out.stride(1) != 1)):
        raise ValueError(f"causal_conv1d_prefill: out must be [{x.shape[0]}, {C}] in {x.dtype} on {x.device} "
                         f"with a unit stride on C, got shape {tuple(out.shape)}, {out.dtype}, {out.device}, "
                         f"strides {out.stride()}")
    if use_triton(x) and K <= 4:                   # the Triton prefill keeps <= 3 rows of history (K <= 4)
        from tensorfold.kernels.causal_conv1d import triton_conv
        return triton_conv.causal_conv1d_prefill(x, weight, tail, bias, out=out)
    from tensorfold.kernels.causal_conv1d import naive
    y = naive.causal_conv1d_prefill(x, weight, tail, bias)
    return y if out is None else out.copy_(y)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor, slots: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """One row each of B streams: x [B, C], weight [C, K], tails [S, C, K-1] (x's dtype; tails[slots] updated
    in place), slots [B] distinct ints, bias [C] | None -> y [B, C] in x's dtype. A negative slot marks a padded
    row (a captured batch larger than the streams in it): no tail is read or written and its y is zero."""
    K = _check_weights("causal_conv1d_update", x, weight, bias)
    B, C = x.shape
    if tails.dim() != 3 or tails.shape[1:] != (C, K - 1) or tails.dtype != x.dtype or tails.device != x.device:
        raise ValueError(f"causal_conv1d_update: tails must be [S, C, K-1] = [S, {C}, {K - 1}] in {x.dtype} on "
                         f"{x.device}, got shape {tuple(tails.shape)}, {tails.dtype}, {tails.device}")
    if slots.shape != (B,) or slots.dtype.is_floating_point or slots.dtype == torch.bool \
            or slots.device != x.device:
        raise ValueError(f"causal_conv1d_update: slots must be an integer [B] = [{B}] on {x.device}, "
                         f"got shape {tuple(slots.shape)}, {slots.dtype}, {slots.device}")
    if use_triton(x):
        from tensorfold.kernels.causal_conv1d import triton_conv
        return triton_conv.causal_conv1d_update(x, weight, tails, slots, bias)
    from tensorfold.kernels.causal_conv1d import naive
    return naive.causal_conv1d_update(x, weight, tails, slots, bias)
