"""A MoE router's last step, from logits to (weight, expert) pairs, in one launch on the GPU: per row a float32
softmax over the N experts' logits, the k largest, renormalised (norm_topk_prob), cast to the logits' dtype.

    softmax_top_k(logits [T, N], k, shared [T, 1] | None) -> weights [T, k'] (logits' dtype), chosen [T, k'] long

Each row's chosen ids come in ascending order (the order the grouped experts sum in), so `routed_experts(...,
ordered=True)` skips its sort. With `shared` (a shared expert's gate logit), k' = k + 1: a last pair
(N, sigmoid(shared)) names the shared expert as expert N of an extended weight set, so the grouped experts run it
with the routed ones.

Ties: the k largest logits are taken (softmax is monotonic: the k largest probabilities), equal logits in
ascending index order, so the lowest index wins a tie at the k-th place. torch.topk (HF's router) leaves its tie
order unspecified (on the CPU it does not pick the lowest index); rows without a tie at the k-th place choose the
same set. A NaN logit counts as -inf, so every row names k distinct experts in [0, N).

Rounding (both paths): probabilities p = e / Σe, e = exp(logit - max), in float32; weights p / Σ_chosen p in
float32, rounded once to the logits' dtype; the shared gate round(sigmoid(s)). The Triton kernel sums in another
order than torch: float32 weights agree with `naive` (and with tensorfold_qwen's torch `route`) within a few
float32 ulps, bfloat16 weights are equal or one bf16 ulp apart (tests/core/kernels/test_moe_routing.py).
"""

from __future__ import annotations

import torch

from tensorfold.kernels.backend import use_triton

__all__ = ["check", "naive", "softmax_top_k"]


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
