"""Masked attention in plain torch: the CPU path and the kernel's reference (float32 throughout, rounded once)."""

from __future__ import annotations

import torch


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Scores in float32 [H, T, S], masked, float32 softmax, times v in float32; empty rows 0: [T, H, DV]. (float64
    inputs stay float64: the tests' reference.)"""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("thd,shd->hts", q.to(wide), k.to(wide)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    probs = probs.masked_fill(~mask.any(-1)[None, :, None], 0.0)                # a row that selects nothing: 0
    return torch.einsum("hts,shd->thd", probs, v.to(wide)).to(q.dtype)
