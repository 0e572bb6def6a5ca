"""A MoE router's last step, from logits to (weight, expert) pairs, in one launch on the GPU. Two scorings:

    softmax_top_k(logits [T, N], k, shared [T, 1] | None) -> weights [T, k'] (logits' dtype), chosen [T, k'] long
    sigmoid_bias_top_k(logits [T, N], bias [N], k, n_group, topk_group, norm, scale, shared: bool)
        -> weights [T, k'] float32, chosen [T, k'] long

Each row's chosen ids come in ascending order (the order the grouped experts sum in), so `routed_experts(...,
ordered=True)` skips its sort. With a shared expert, k' = k + 1: a last pair names it as expert N of an extended
weight set, so the grouped experts run it with the routed ones.

router_top_k(x [T, E], weight [N (+1), E], k, shared) is a decode step's whole router: the projection, then
softmax_top_k on it; at up to 16 rows on a Triton device as linear_norm's split-K GEMV and the routing kernel's body
on the slices' sum (triton_router; the pairs bit for bit softmax_top_k's on those logits).

softmax_top_k (Qwen3.5-MoE): per row a float32 softmax over the N experts' logits, the k largest, renormalised
(norm_topk_prob), cast to the logits' dtype; the shared pair is (N, sigmoid(shared)). Ties: the k largest logits
are taken (softmax is monotonic: the k largest probabilities), equal logits in ascending index order, so the
lowest index wins a tie at the k-th place. torch.topk (HF's router) leaves its tie order unspecified (on the CPU it
does not pick the lowest index); rows without a tie at the k-th place choose the same set. Rounding (both paths):
probabilities p = e / Σe, e = exp(logit - max), in float32; weights p / Σ_chosen p in float32, rounded once to the
logits' dtype; the shared gate round(sigmoid(s)). The Triton kernel sums in another order than torch: float32
weights agree with `naive` (and with tensorfold_qwen's torch `route`) within a few float32 ulps, bfloat16 weights
are equal or one bf16 ulp apart (tests/core/kernels/test_moe_routing.py).

sigmoid_bias_top_k (GLM-5, DeepSeek-V3's scoring): scores s = sigmoid(logit) in float32; the experts chosen by
s + bias, with n_group > 1 only within the topk_group groups (N / n_group consecutive experts each) whose two best
biased scores sum highest; weights the unbiased s of the chosen, divided by (Σ_chosen s + 1e-20) if norm, times
scale, kept in float32; the shared pair is (N, 1.0). Ties go to the lower index, among groups as among experts
(a stable descending sort: tensorfold_glm's `mlp.choose`). `sigmoid_naive` is its torch twin; the kernel's sigmoid
is torch's formula with CUDA's expf and IEEE division (kernels/triton_ieee.py) and its Σ_chosen s another order
of the same k float32 terms: weights within a few float32 ulps of the twin, the same ids
(tests/core/kernels/test_moe_routing_sigmoid.py).

Both scorings count a NaN logit (or biased score) as -inf, so every row names k distinct experts in [0, N).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.linear_norm import ROWS_UP_TO

__all__ = ["FUSED_ROUTER", "ROUTER_SPLITS", "check", "check_sigmoid", "naive", "router_applies", "router_top_k",
           "sigmoid_bias_top_k", "sigmoid_naive", "softmax_top_k"]

FUSED_ROUTER = True   # router_top_k's launches of ours where they apply; False: the GEMM and softmax_top_k (an A/B)
ROUTER_SPLITS = 8     # its GEMV's K slices (a family's identity names them: they decide the logits' bits)


def check(logits: torch.Tensor, k: int, shared: torch.Tensor | None) -> None:
    """Raise ValueError naming the first argument that does not fit (no device reads)."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"softmax_top_k: logits must be a floating [T, N] tensor, got {list(logits.shape)} "
                         f"{logits.dtype}")
    T, N = logits.shape
    if not 1 <= k <= N:
        raise ValueError(f"softmax_top_k: k must be between 1 and N = {N}, got {k}")
    if shared is not None and (tuple(shared.shape) != (T, 1) or shared.dtype != logits.dtype
                               or shared.device != logits.device):
        raise ValueError(f"softmax_top_k: shared must be [{T}, 1] {logits.dtype} on {logits.device}, "
                         f"got {list(shared.shape)} {shared.dtype} on {shared.device}")


def softmax_top_k(logits: torch.Tensor, k: int, shared: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, N] (rows may be strided, e.g. a slice of a wider GEMM's output) -> (weights, chosen) [T, k'] each,
    ids ascending per row; `shared` [T, 1] adds the pair (N, sigmoid(shared)) last (module docstring)."""
    check(logits, k, shared)
    if use_triton(logits):
        from tensorfold.kernels.moe import triton_routing
        return triton_routing.softmax_top_k(logits, k, shared)
    return naive(logits, k, shared)


def router_applies(x: torch.Tensor) -> bool:
    """router_top_k runs its own launches for x: a Triton device, at most ROWS_UP_TO rows, FUSED_ROUTER on."""
    return FUSED_ROUTER and use_triton(x) and x.dim() == 2 and x.shape[0] <= ROWS_UP_TO


def router_top_k(x: torch.Tensor, weight: torch.Tensor, k: int, shared: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, E], weight [N (+1: the shared gate's row, last, with `shared`), E] -> softmax_top_k of the router's
    logits x @ weight[:N]ᵀ (and the shared pair from x @ weight[N]ᵀ): a decode step's router, where
    `router_applies` linear_norm's split-K GEMV (ROUTER_SPLITS slices) and the routing kernel's body on the slices'
    sum (triton_router), else the GEMM then softmax_top_k."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"router_top_k: x [T, E] and weight [N, E] of one dtype, got {list(x.shape)} {x.dtype} "
                         f"and {list(weight.shape)} {weight.dtype}")
    N = weight.shape[0] - shared
    if not 1 <= k <= N:
        raise ValueError(f"router_top_k: k must be between 1 and N = {N}, got {k}")
    if router_applies(x):
        from tensorfold.kernels.moe import triton_router
        return triton_router.router_top_k(x, weight, k, shared)
    logits = F.linear(x, weight)
    return softmax_top_k(logits[:, :N], k, logits[:, N:] if shared else None)


def naive(logits: torch.Tensor, k: int, shared: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin in torch ops (the CPU path and the kernel's reference): a stable descending sort of the logits picks
    the k largest, lowest index first among equals."""
    T, N = logits.shape
    scores = logits.float()
    scores = torch.where(torch.isnan(scores), float("-inf"), scores)
    probs = torch.softmax(scores, dim=-1)                                   # [T, N] float32
    chosen = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = chosen.sort(dim=-1).values                                     # ascending ids
    top = probs.gather(1, chosen)
    weights = (top / top.sum(-1, keepdim=True)).to(logits.dtype)
    if shared is None:
        return weights, chosen
    extra = torch.full((T, 1), N, dtype=torch.long, device=logits.device)
    return torch.cat([weights, torch.sigmoid(shared)], dim=1), torch.cat([chosen, extra], dim=1)


def check_sigmoid(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int) -> None:
    """Raise ValueError naming the first argument of sigmoid_bias_top_k that does not fit (no device reads)."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"sigmoid_bias_top_k: logits must be a floating [T, N] tensor, got {list(logits.shape)} "
                         f"{logits.dtype}")
    N = logits.shape[1]
    if tuple(bias.shape) != (N,) or bias.dtype != torch.float32 or bias.device != logits.device:
        raise ValueError(f"sigmoid_bias_top_k: bias must be [{N}] float32 on {logits.device}, "
                         f"got {list(bias.shape)} {bias.dtype} on {bias.device}")
    if n_group < 1 or N % n_group or (n_group > 1 and N // n_group < 2):
        raise ValueError(f"sigmoid_bias_top_k: n_group must divide N = {N} into groups of at least 2, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"sigmoid_bias_top_k: topk_group must be between 1 and n_group = {n_group}, "
                         f"got {topk_group}")
    if not 1 <= k <= N:
        raise ValueError(f"sigmoid_bias_top_k: k must be between 1 and N = {N}, got {k}")


def sigmoid_bias_top_k(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1,
                       norm: bool = True, scale: float = 1.0, shared: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, N] (rows may be strided), bias [N] float32 -> (weights float32, chosen long) [T, k'] each, ids
    ascending per row; `shared` adds the pair (N, 1.0) last (module docstring)."""
    check_sigmoid(logits, bias, k, n_group, topk_group)
    if use_triton(logits):
        from tensorfold.kernels.moe import triton_routing
        return triton_routing.sigmoid_bias_top_k(logits, bias, k, n_group, topk_group, norm, scale, shared)
    return sigmoid_naive(logits, bias, k, n_group, topk_group, norm, scale, shared)


def sigmoid_naive(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1,
                  norm: bool = True, scale: float = 1.0, shared: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin in torch ops (the CPU path and the kernel's reference): stable descending sorts pick the groups
    and the experts, lowest index first among equals."""
    T, N = logits.shape
    scores = torch.sigmoid(logits.float())                                  # [T, N] float32
    biased = scores + bias
    biased = torch.where(torch.isnan(biased), float("-inf"), biased)
    if n_group > 1:
        grouped = biased.reshape(T, n_group, N // n_group)                  # [T, G, N/G]
        group_scores = grouped.sort(dim=-1, descending=True).values[..., :2].sum(-1)        # [T, G]
        kept = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        biased = biased.masked_fill(~keep.repeat_interleave(N // n_group, dim=1), float("-inf"))
    chosen = biased.sort(dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=-1).values
    weights = scores.gather(1, chosen)                                      # [T, k] float32
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scale
    if not shared:
        return weights, chosen
    extra = torch.full((T, 1), N, dtype=torch.long, device=logits.device)
    return torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1), torch.cat([chosen, extra], dim=1)
