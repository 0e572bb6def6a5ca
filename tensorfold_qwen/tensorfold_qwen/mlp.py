"""The feed-forward half of a layer: a dense SwiGLU MLP (qwen3_5) or a routed MoE with a gated shared expert
(qwen3_5_moe).

Shapes in comments: T rows, E hidden size, F intermediate size, N experts, k experts per token.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F


@attrs.frozen
class MlpWeights:
    """A SwiGLU MLP (HF names under `mlp.` or `mlp.shared_expert.`)."""

    gate_proj: torch.Tensor             # [F, E]
    up_proj: torch.Tensor               # [F, E]
    down_proj: torch.Tensor             # [E, F]


@attrs.frozen
class MoeWeights:
    """A routed MoE layer; the experts' matrices are stacked from `mlp.experts.{e}.*` at load."""

    router: torch.Tensor                # [N, E]       mlp.gate.weight
    gate_proj: torch.Tensor             # [N, F, E]    mlp.experts.{e}.gate_proj.weight
    up_proj: torch.Tensor               # [N, F, E]    mlp.experts.{e}.up_proj.weight
    down_proj: torch.Tensor             # [N, E, F]    mlp.experts.{e}.down_proj.weight
    shared: MlpWeights                  #              mlp.shared_expert.*
    shared_gate: torch.Tensor           # [1, E]       mlp.shared_expert_gate.weight
    top_k: int


def swiglu(w: MlpWeights, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) · up(x)): [T, E] -> [T, F] -> [T, E]."""
    return F.linear(F.silu(F.linear(x, w.gate_proj)) * F.linear(x, w.up_proj), w.down_proj)


def moe(w: MoeWeights, x: torch.Tensor) -> torch.Tensor:
    """Softmax router over all experts (float32) -> top-k -> renormalised weights in x's dtype; each chosen
    expert's SwiGLU on its rows, weighted and summed; plus the shared expert times sigmoid(shared_gate(x))."""
    probs = torch.softmax(F.linear(x, w.router).float(), dim=-1)        # [T, N] float32
    weights, chosen = probs.topk(w.top_k, dim=-1)                       # [T, k], [T, k]
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)     # renormalise (norm_topk_prob)
    out = torch.zeros_like(x)                                           # [T, E]
    for expert in chosen.unique().tolist():
        rows, rank = (chosen == expert).nonzero(as_tuple=True)          # which rows chose it, at which rank
        picked = x[rows]                                                # [t, E]
        hidden = F.silu(F.linear(picked, w.gate_proj[expert])) * F.linear(picked, w.up_proj[expert])
        out.index_add_(0, rows, F.linear(hidden, w.down_proj[expert]) * weights[rows, rank, None])
    shared = swiglu(w.shared, x) * torch.sigmoid(F.linear(x, w.shared_gate))   # [T, E]
    return out + shared
