"""Depthwise causal conv + SiLU in plain torch: the CPU path and the reference the Triton kernels are tested against.

Shapes: T rows of one stream, B streams of one row each, S slots, C channels, K kernel width.
The same arithmetic as tensorfold_qwen's `gdn.causal_conv` (F.conv1d in the input dtype, then F.silu), so the
bits match it on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """One stream's chunk over [tail | x]; the tail becomes the last K-1 input columns.

    x [T, C], weight [C, K], tail [C, K-1] (x's dtype, updated in place), bias [C] | None -> [T, C].
    """
    C, K = weight.shape
    if x.shape[0] == 0:                                                            # nothing read, nothing shifts
        return x.new_empty(0, C)
    window = torch.cat((tail, x.transpose(0, 1)), dim=1)                           # [C, K-1+T]
    tail.copy_(window[:, window.shape[1] - (K - 1):])
    out = F.conv1d(window[None], weight[:, None, :], bias, groups=C)[0]            # [C, T]
    return F.silu(out).transpose(0, 1)                                             # [T, C]


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor, slots: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """One new row for each of B streams; their tails sit at tails[slots] and shift by one in place.

    x [B, C], weight [C, K], tails [S, C, K-1], slots [B] (distinct; negative: a padded row, no tail touched,
    output zeros), bias [C] | None -> [B, C].
    """
    C, K = weight.shape
    live = (slots >= 0).nonzero()[:, 0]                                            # rows with a stream
    slots = slots[live]
    window = torch.cat((tails[slots], x[live, :, None]), dim=2)                    # [b, C, K]
    tails[slots] = window[:, :, 1:]
    out = x.new_zeros(x.shape)
    out[live] = F.silu(F.conv1d(window, weight[:, None, :], bias, groups=C)[:, :, 0])   # [b, C]
    return out
