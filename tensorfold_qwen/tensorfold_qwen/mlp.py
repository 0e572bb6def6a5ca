"""The feed-forward half of a layer: a dense SwiGLU MLP (qwen3_5) or a routed MoE with a gated shared expert
(qwen3_5_moe).

Shapes in comments: T rows, E hidden size, F intermediate size, Fs the shared expert's, N experts, k experts per
token.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.moe import routed_experts, routed_experts_norm, router_top_k, softmax_top_k
from tensorfold.kernels.silu_gate import sigmoid_mul, silu_mul


@attrs.frozen
class MlpWeights:
    """A SwiGLU MLP (HF names under `mlp.` or `mlp.shared_expert.`)."""

    gate_proj: torch.Tensor             # [F, E]
    up_proj: torch.Tensor               # [F, E]
    down_proj: torch.Tensor             # [E, F]
    # The GPU path's stacked layout (fused.fuse_mlp, at load; None: the two GEMMs): gate_proj and up_proj are
    # row views of it, so nothing is held twice.
    gate_up: torch.Tensor | None = None  # [2F, E]


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
    # The GPU path's fused layout (fused.fuse_moe, at load; None: the unfused path). The fields above are views of
    # these, so nothing is held twice.
    inputs: torch.Tensor | None = None           # [N + 1 (+ 2·Fs), E]: router, shared_gate (then shared gate_proj,
                                                 # up_proj unless folded): every product over x in one GEMM
    experts_gate_up: torch.Tensor | None = None  # [N + 1, 2F, E]: gate_up, then the shared expert as expert N
                                                 # (folded: Fs == F); None when not folded
    experts_down: torch.Tensor | None = None     # [N + 1, E, F]: down, then the shared expert's down_proj


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
    "decode" for one row per stream, "prefill" for a prefill chunk's rows. On the Triton path a layer loaded with
    the fused layout runs `moe_fused`."""
    if w.inputs is not None and use_triton(x):
        return moe_fused(w, x, kind)
    weights, chosen = route(w, x)
    return routed_experts(x, chosen, weights, w.gate_up, w.down, kind=kind) + shared_expert(w, x)


def folded_pairs(w: MoeWeights, x: torch.Tensor, kind: str = "decode") -> tuple[torch.Tensor, torch.Tensor]:
    """The folded layout's routing: the router and the shared gate (inputs [N + 1, E]) projected, then routed:
    (weights, chosen) [T, k + 1], the shared expert's pair (N, sigmoid(gate)) last. A decode call (one row per
    stream) through kernels.moe.router_top_k (at most 16 rows: our GEMV and the routing kernel on its parts), a
    prefill chunk's rows one GEMM then the routing kernel."""
    if kind == "decode":
        return router_top_k(x, w.inputs, w.top_k, shared=True)
    N = w.router.shape[0]
    proj = F.linear(x, w.inputs)                                        # [T, N + 1]
    return softmax_top_k(proj[:, :N], w.top_k, proj[:, N:N + 1])


def moe_then_norm(w: MoeWeights, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  kind: str = "decode") -> tuple[torch.Tensor, torch.Tensor] | None:
    """A MoE layer on the folded fused path ending in the next norm, (that norm's output, residual + the layer's
    output) as `rms_norm(moe_fused(w, x, kind), norm_weight, eps, zero_centred=True, residual=residual)` gives
    them, the experts' sum, the add and the norm in one launch (kernels.moe.routed_experts_norm; the same bits);
    None where that path does not apply (not Triton, not folded)."""
    if w.inputs is None or w.experts_gate_up is None or not use_triton(x):
        return None
    weights, chosen = folded_pairs(w, x, kind)
    return routed_experts_norm(x, chosen, weights, w.experts_gate_up, w.experts_down, residual, norm_weight, eps,
                               zero_centred=True, kind=kind, ordered=True)


def moe_fused(w: MoeWeights, x: torch.Tensor, kind: str = "decode") -> torch.Tensor:
    """`moe` in a few launches, from the fused layout: one GEMM for the router and the shared expert's gate (and
    its gate/up when not folded), one routing kernel (softmax, top-k, renormalise: `route`'s arithmetic, ties to
    the lowest index), then the grouped experts; folded, the shared expert is their expert N with weight
    sigmoid(shared_gate·x), the last pair of every row, so it is summed after the routed experts as `moe` adds it.
    Within the bf16/fp32 tolerances of `moe` (docs/families/qwen.md), not bitwise: other dot orders."""
    if w.experts_gate_up is not None:
        weights, chosen = folded_pairs(w, x, kind)
        return routed_experts(x, chosen, weights, w.experts_gate_up, w.experts_down, kind=kind, ordered=True)
    N = w.router.shape[0]
    proj = F.linear(x, w.inputs)                                        # [T, N + 1 + 2·Fs]
    gate = proj[:, N:N + 1]                                             # [T, 1] the shared expert's gate logit
    weights, chosen = softmax_top_k(proj[:, :N], w.top_k)               # [T, k]
    Fs = w.shared.gate_proj.shape[0]
    hidden = silu_mul(proj[:, N + 1:N + 1 + Fs], proj[:, N + 1 + Fs:])  # [T, Fs]
    shared = sigmoid_mul(F.linear(hidden, w.shared.down_proj), gate)
    return routed_experts(x, chosen, weights, w.gate_up, w.down, kind=kind, ordered=True) + shared
