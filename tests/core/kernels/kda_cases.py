"""Inputs, kept states and comparisons the Kimi Delta Attention tests share (CPU and GPU files)."""

from __future__ import annotations

import importlib.util

import torch

HAS_FLA = importlib.util.find_spec("fla") is not None
CUDA = torch.cuda.is_available()


def rows(T: int, H: int, DK: int, DV: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
         seed: int = 0, bound: float = -5.0) -> tuple[torch.Tensor, ...]:
    """Raw unit-scale q, k, v [T, H, D] in `dtype`; g = bound·sigmoid(2·N(0,1)) [T, H, DK] float32 (GLM's safe gate:
    with its bound -5, per-step decays down to -5; a mild bound lets a kept state matter); beta = sigmoid(N(0,1))
    in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, DK, generator=gen)
    k = torch.randn(T, H, DK, generator=gen)
    v = torch.randn(T, H, DV, generator=gen)
    g = bound * torch.sigmoid(2.0 * torch.randn(T, H, DK, generator=gen))
    beta = torch.sigmoid(torch.randn(T, H, generator=gen))
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), g.to(device), beta.to(device, dtype))


def kept_state(N: int, H: int, DK: int, DV: int, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    """States such as streams keep after some tokens: modest entries, float32 [N, H, DK, DV]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(N, H, DK, DV, generator=gen) * 0.2).to(device)


def l2(DK: int) -> dict:
    """Raw q, k: l2-normalised in the op, q scaled by 1/sqrt(DK) (HF's scale to the bit, which GLM passes)."""
    return {"scale": 1 / DK ** 0.5, "qk_l2norm": True}


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64 (0 for empty tensors: an empty stream's rows)."""
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: closeness independent of the output's scale."""
    return worst(a, b) / max(float(b.double().abs().max()) if b.numel() else 0.0, 1e-30)
