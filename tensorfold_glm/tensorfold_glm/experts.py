"""The routed experts with the rows grouped by expert: one GEMM pair per expert that any row chose, instead of one
per (row, expert) pair; the GPU's path (mlp.moe picks it on CUDA).

    pairs sorted by expert (stable: each expert's rows in row order); counts read once (one host sync)
    per expert e, ascending:  h = swiglu_e(x[rows]) in x's dtype;  total[rows] += h · weight   (float32)
    out = total in x's dtype

Every row's sum adds its experts in ascending order from zero, as mlp.routed_experts does, so the two differ only by
what a GEMM over several rows rounds differently from one over a single row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorfold_glm.mlp import MoeWeights, clamped_glu


def grouped_experts(w: MoeWeights, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                    limit: float | None) -> torch.Tensor:
    """Σ_j weights[t, j] · expert_{chosen[t, j]}(x[t]) for every row t: x [T, E], weights [T, k] float32, chosen
    [T, k] (each row's experts distinct) -> [T, E] in x's dtype."""
    T, k = chosen.shape
    flat = chosen.reshape(-1)                                                        # [T·k]
    order = torch.argsort(flat, stable=True)                                         # pairs by expert
    rows = order // k                                                                # [T·k] the pair's row
    pair_weights = weights.reshape(-1)[order]                                        # [T·k] float32
    counts = torch.bincount(flat, minlength=w.gate_up.shape[0]).tolist()
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)              # [T, E]
    first = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        picked = rows[first: first + count]                                          # [n]
        gate, up = F.linear(x[picked], w.gate_up[expert]).chunk(2, dim=-1)          # [n, F] each
        hidden = F.linear(clamped_glu(gate, up, limit), w.down[expert])             # [n, E] x's dtype
        total.index_add_(0, picked, hidden.float() * pair_weights[first: first + count, None])
        first += count
    return total.to(x.dtype)
