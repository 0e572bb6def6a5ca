"""The feed-forward half of a layer: a dense SwiGLU MLP (qwen3_5) or a routed MoE with a gated shared expert
(qwen3_5_moe).

Shapes in comments: T rows, E hidden size, F intermediate size, N experts, k experts per token.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.moe import routed_experts


@attrs.frozen
class MlpWeights:
    """A SwiGLU MLP (HF names under `mlp.` or `mlp.shared_expert.`)."""

    gate_proj: torch.Tensor             # [F, E]
    up_proj: torch.Tensor               # [F, E]
    down_proj: torch.Tensor             # [E, F]


@attrs.frozen
class MoeWeights:
    """A routed MoE layer, experts in HF's fused layout (`mlp.experts.gate_up_proj` / `down_proj`), which the
    grouped-GEMM kernel reads as they are; per-expert checkpoints are stacked into it at load."""

    router: torch.Tensor                # [N, E]       mlp.gate.weight
    gate_up: torch.Tensor               # [N, 2F, E]   gate rows, then up rows: mlp.experts.gate_up_proj
    down: torch.Tensor                  # [N, E, F]    mlp.experts.down_proj
    shared: MlpWeights                  #              mlp.shared_expert.*
    shared_gate: torch.Tensor           # [1, E]       mlp.shared_expert_gate.weight
    top_k: int


def swiglu(w: MlpWeights, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) · up(x)): [T, E] -> [T, F] -> [T, E]."""
    return F.linear(F.silu(F.linear(x, w.gate_proj)) * F.linear(x, w.up_proj), w.down_proj)


def route(w: MoeWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router over all experts (float32) -> top-k -> renormalised weights in x's dtype: (weights, chosen),
    both [T, k]."""
    probs = torch.softmax(F.linear(x, w.router).float(), dim=-1)        # [T, N] float32
    weights, chosen = probs.topk(w.top_k, dim=-1)                       # [T, k], [T, k]
    return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), chosen   # renormalise (norm_topk_prob)


def shared_expert(w: MoeWeights, x: torch.Tensor) -> torch.Tensor:
    """The shared expert times sigmoid(shared_gate(x)): [T, E] -> [T, E]."""
    return swiglu(w.shared, x) * torch.sigmoid(F.linear(x, w.shared_gate))


def moe(w: MoeWeights, x: torch.Tensor) -> torch.Tensor:
    """The reference: routed, then each chosen expert's SwiGLU on its rows, weighted and summed (a loop over the
    chosen experts, read back to the host); plus the shared expert."""
    weights, chosen = route(w, x)
    out = torch.zeros_like(x)                                           # [T, E]
    for expert in chosen.unique().tolist():
        rows, rank = (chosen == expert).nonzero(as_tuple=True)          # which rows chose it, at which rank
        picked = x[rows]                                                # [t, E]
        gate, up = w.gate_up[expert].chunk(2)                           # [F, E] each
        hidden = F.silu(F.linear(picked, gate)) * F.linear(picked, up)
        out.index_add_(0, rows, F.linear(hidden, w.down[expert]) * weights[rows, rank, None])
    return out + shared_expert(w, x)


def moe_routed(w: MoeWeights, x: torch.Tensor, kind: str = "decode") -> torch.Tensor:
    """`moe` through the kernels' `routed_experts` (a sync-free grouped GEMM on the GPU, capturable in a CUDA
    graph; the same loop as `moe` on the CPU, bit for bit), plus the shared expert. `kind` picks the experts' tiles:
    "decode" for one row per stream, "prefill" for a prefill chunk's rows."""
    weights, chosen = route(w, x)
    return routed_experts(x, chosen, weights, w.gate_up, w.down, kind=kind) + shared_expert(w, x)
