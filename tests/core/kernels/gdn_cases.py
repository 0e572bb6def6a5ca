"""Shapes, kept states and comparisons the gated delta rule tests share (CPU and GPU files)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

HAS_FLA = importlib.util.find_spec("fla") is not None
CUDA = torch.cuda.is_available()


def report(**record: object) -> None:
    """Print a measurement (run with -s to see it) and append it to $OUT/gdn-tests.jsonl when OUT is set."""
    line = json.dumps(record)
    print("GDN " + line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "gdn-tests.jsonl", "a") as handle:
            handle.write(line + "\n")


def rows(T: int, NK: int, NV: int, DK: int, DV: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
         seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs shaped like Qwen3.5's GDN: q, k [T, NK, DK], v [T, NV, DV] in `dtype`; g = -exp(A_log)·softplus(a +
    dt_bias) [T, NV] float32 with A in [1, 16] and dt in [1e-3, 1e-1] (Mamba's init); beta = sigmoid [T, NV]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, NK, DK, generator=gen)
    k = torch.randn(T, NK, DK, generator=gen)
    v = torch.randn(T, NV, DV, generator=gen)
    A = torch.empty(NV).uniform_(1, 16, generator=gen)
    dt = torch.exp(torch.empty(NV).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))                                    # softplus⁻¹(dt)
    g = -A * F.softplus(torch.randn(T, NV, generator=gen) + dt_bias)
    beta = torch.sigmoid(torch.randn(T, NV, generator=gen))
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), g.to(device),
            beta.to(device, dtype))


def kept_state(N: int, NV: int, DK: int, DV: int, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    """A state such as a stream keeps after some hundred tokens: modest entries, float32."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(N, NV, DK, DV, generator=gen) * 0.05).to(device)


def qwen_prepared(q, k, NV, scale):
    """q, k as tensorfold_qwen.gdn prepares them: repeated to the value heads, float32, l2-normalised, q scaled."""
    from tensorfold_qwen import gdn
    group = NV // q.shape[-2]
    q = gdn.l2norm(q.repeat_interleave(group, dim=-2).float()) * scale
    k = gdn.l2norm(k.repeat_interleave(group, dim=-2).float())
    return q, k


def l2(DK: int) -> dict:
    """Raw q, k: l2-normalised in the op, q scaled by DK^-0.5 (what the family does before calling)."""
    return dict(qk_l2norm=True, scale=DK ** -0.5)


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return worst(a, b) / max(float(b.double().abs().max()), 1e-30)


