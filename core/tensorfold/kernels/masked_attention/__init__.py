"""Attention under an arbitrary boolean mask (GLM's DSA selection): every query row attends to the keys its mask
row selects. Triton on CUDA, plain torch (`naive`) elsewhere; both take the same arguments.

Shapes: T query rows, S keys, H heads (each query head reads its own key/value head), DQ query/key dim, DV value
dim. q [T, H, DQ], k [S, H, DQ], v [S, H, DV] (any strides: k and v may be views split from one [S, H, DQ + DV]
tensor), mask bool [T, S] (True = attend), shared by every head. Softmax runs in float32; the output has q's dtype;
a row that selects nothing gives exactly 0.

The Triton path's contract: a row's output bits depend only on its q, its mask row and the keys/values up to its
last selected key, not on T, the other rows of the call, or S past its keys (triton_prefill.py says how).
"""

from __future__ import annotations

import math

import torch

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.masked_attention import naive

__all__ = ["masked_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    """q [T, H, DQ], k [S, H, DQ], v [S, H, DV], mask bool [T, S], one dtype (mask aside) and one device."""
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [rows, heads, head_dim]; got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of float16, bfloat16, float32")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [keys, heads, dim]; got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if t.shape[1] != q.shape[1]:
            raise ValueError(f"{name} has {t.shape[1]} heads; q has {q.shape[1]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k head dim {k.shape[2]} differs from q's {q.shape[2]}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k has {k.shape[0]} keys, v {v.shape[0]}")
    if q.shape[2] == 0 or v.shape[2] == 0:
        raise ValueError(f"head dims must be positive; got {q.shape[2]}/{v.shape[2]}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool; got {mask.dtype}")
    if mask.shape != (q.shape[0], k.shape[0]):
        raise ValueError(f"mask {tuple(mask.shape)} is not [rows {q.shape[0]}, keys {k.shape[0]}]")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device}, q on {q.device}")


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale, masked) v per head: q [T, H, DQ] -> [T, H, DV]; scale defaults to DQ ** -0.5."""
    _check(q, k, v, mask)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number; got {scale!r}")
    if use_triton(q):
        from tensorfold.kernels.masked_attention import triton_prefill
        return triton_prefill.masked_attention(q, k, v, mask, scale)
    return naive.masked_attention(q, k, v, mask, scale)
