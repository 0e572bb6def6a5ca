"""The feed-forward half of a GLM-5.3-Flash layer: a dense clamped SwiGLU (the first layers, `mlp_layer_types`
"dense") or a sigmoid-routed MoE with a shared expert ("sparse").

    swiglu(x) = down(silu(min(gate(x), L)) · clamp(up(x), -L, L))                      L = swiglu_limit
    scores    = sigmoid(x @ routerᵀ)                                                     float32 [N]
    chosen    = top-k of scores + e_score_correction_bias (within the topk_group best groups if n_group > 1)
    weights   = scores[chosen] / (Σ scores[chosen] + 1e-20) · routed_scaling           (unbiased scores)
    moe(x)    = Σ_j weights_j · swiglu_{chosen_j}(x) + shared_swiglu(x)

The clamp applies to the dense MLP, the shared expert and every routed expert alike. Ties in the top-k go to the
lower index (torch.topk leaves tie order unspecified; on untied inputs both choose the same set). The routed sum
follows HF's default `grouped_mm` experts path: each expert's output in the model dtype times its float32 weight,
summed in float32 (here in ascending expert order), rounded once to the model dtype. The decode step's `moe_routed`
runs the same routing and sum with the experts' GEMMs in the kernels' sync-free `routed_experts`. On a Triton device
(CUDA) both run `moe_fused`: the routing in one kernel, the experts and their float32 sum in the grouped kernels,
the shared expert folded in as expert N when its width is the experts' (fused.fuse_moe).

Shapes in comments: T rows, E hidden size, F intermediate size, N experts, k experts per token, G groups.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.backend import use_triton
from tensorfold.kernels.moe import routed_experts as kernel_experts
from tensorfold.kernels.moe import sigmoid_bias_top_k

PAIR_WEIGHT_BYTES = 1 << 25   # the expert weights one batch of pairs gathers (rows are batched up to it)


@attrs.frozen
class MlpWeights:
    """A clamped SwiGLU MLP (HF names under `mlp.` for a dense layer, `mlp.shared_experts.` for the shared one)."""

    gate_proj: torch.Tensor             # [F, E]
    up_proj: torch.Tensor               # [F, E]
    down_proj: torch.Tensor             # [E, F]


@attrs.frozen
class MoeWeights:
    """A routed MoE layer, experts in HF's fused layout (per-expert checkpoint tensors `mlp.experts.{e}.*_proj`
    stacked at load: gate rows then up rows). router and e_score_correction_bias stay float32 at a bf16 load. On a
    Triton device the loader folds the shared expert in (fused.fuse_moe): experts_gate_up / experts_down hold the
    N experts and the shared one as expert N, and gate_up, down and shared_experts are views of them."""

    router: torch.Tensor                    # [N, E]       mlp.gate.weight (float32)
    e_score_correction_bias: torch.Tensor   # [N]          mlp.gate.e_score_correction_bias (float32)
    gate_up: torch.Tensor                   # [N, 2F, E]   mlp.experts.{e}.gate_proj, then .up_proj
    down: torch.Tensor                      # [N, E, F]    mlp.experts.{e}.down_proj
    shared_experts: MlpWeights              #              mlp.shared_experts.* (F·n_shared_experts wide)
    experts_gate_up: torch.Tensor | None = None   # [N + 1, 2F, E]  folded: the experts, then the shared expert
    experts_down: torch.Tensor | None = None      # [N + 1, E, F]


def clamped(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate clamped above at limit, up clamped to ±limit); both as given if limit is None."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate clamped above at limit) · (up clamped to ±limit), in the inputs' dtype; no clamp if limit is None."""
    gate, up = clamped(gate, up, limit)
    return F.silu(gate) * up


def swiglu(w: MlpWeights, x: torch.Tensor, limit: float | None) -> torch.Tensor:
    """The dense MLP or shared expert: [T, E] -> [T, F] -> [T, E], in x's dtype."""
    return F.linear(clamped_glu(F.linear(x, w.gate_proj), F.linear(x, w.up_proj), limit), w.down_proj)


def router_logits(w: MoeWeights, x: torch.Tensor) -> torch.Tensor:
    """x @ routerᵀ in float32 (HF casts x up): [T, E] -> [T, N]."""
    return F.linear(x.float(), w.router.float())


def router_scores(w: MoeWeights, x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x @ routerᵀ) in float32: [T, E] -> [T, N]."""
    return torch.sigmoid(router_logits(w, x))


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest along the last dim, ties to the lower index (a stable descending sort): [..., n] -> [..., k]."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def choose(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """The chosen experts of each row, ascending: [T, N] float32 -> [T, k] long.

    Chosen by scores + bias; with n_group > 1 only within the topk_group groups whose two best biased scores sum
    highest (HF's group-limited routing; its n_group = 1 default makes this a plain top-k)."""
    biased = scores + bias.float()                                                   # [T, N]
    if n_group > 1:
        T, N = biased.shape
        grouped = biased.reshape(T, n_group, N // n_group)                           # [T, G, N/G]
        group_scores = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)   # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, top_indices(group_scores, topk_group), True)
        biased = biased.masked_fill(~keep.repeat_interleave(N // n_group, dim=1), float("-inf"))
    return top_indices(biased, top_k).sort(dim=-1).values


def route(w: MoeWeights, x: torch.Tensor, top_k: int, routed_scaling: float, norm_topk_prob: bool,
          n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, chosen [T, k] long, experts ascending): the unbiased scores of the chosen experts,
    normalised to sum 1 (if norm_topk_prob), times routed_scaling."""
    scores = router_scores(w, x)                                                     # [T, N] float32
    chosen = choose(scores, w.e_score_correction_bias, top_k, n_group, topk_group)
    weights = scores.gather(1, chosen)                                               # [T, k] float32
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling, chosen


def routed_experts(w: MoeWeights, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                   limit: float | None) -> torch.Tensor:
    """Σ_j weights[t, j] · expert_{chosen[t, j]}(x[t]) per row, summed in float32 in the order of `chosen`, cast to
    x's dtype. Each (row, expert) pair is its own GEMM of one row (a batched matmul over gathered expert weights)
    and its SiLU its own call on that pair's F values, so a row's result never depends on the other rows."""
    T, k = chosen.shape
    E, per_pair = x.shape[1], (w.gate_up[0].numel() + w.down[0].numel()) * w.gate_up.element_size()
    step = max(1, PAIR_WEIGHT_BYTES // per_pair // k)                                # rows a batch
    out = torch.empty_like(x)                                                        # [T, E]
    for start in range(0, T, step):
        rows = slice(start, min(T, start + step))
        ids = chosen[rows].reshape(-1)                                               # [P] P = rows · k
        pairs = x[rows].repeat_interleave(k, dim=0)[:, None]                         # [P, 1, E]
        gate, up = clamped(*torch.bmm(pairs, w.gate_up[ids].transpose(1, 2)).chunk(2, dim=-1), limit)  # [P, 1, F]
        act = torch.stack([F.silu(pair) for pair in gate.unbind(0)])                 # [P, 1, F] a call a pair
        hidden = torch.bmm(act * up, w.down[ids].transpose(1, 2)).view(-1, k, E)    # [rows, k, E] x's dtype
        out[rows] = weighted_sum(hidden, weights[rows])
    return out


def weighted_sum(hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_j weights[:, j] · hidden[:, j] in float32 (as HF promotes), in j's order, rounded once to hidden's dtype:
    hidden [T, k, E], weights [T, k] float32 -> [T, E]."""
    total = torch.zeros(hidden.shape[0], hidden.shape[2], dtype=torch.float32, device=hidden.device)
    for j in range(hidden.shape[1]):
        total = total + hidden[:, j].float() * weights[:, j, None]
    return total.to(hidden.dtype)


def moe(w: MoeWeights, x: torch.Tensor, top_k: int, routed_scaling: float, norm_topk_prob: bool, n_group: int,
        topk_group: int, limit: float | None) -> torch.Tensor:
    """The sparse layer: routed experts plus the shared expert, [T, E] -> [T, E] in x's dtype. On a Triton device
    `moe_fused` with the kernels' prefill tiles; on CUDA without Triton the routed experts run as `pair_experts`
    with the prefill tiles; on the CPU `routed_experts` (the reference: each row's bits its own)."""
    if use_triton(x):
        return moe_fused(w, x, top_k, routed_scaling, norm_topk_prob, n_group, topk_group, limit, kind="prefill")
    weights, chosen = route(w, x, top_k, routed_scaling, norm_topk_prob, n_group, topk_group)
    if x.device.type == "cuda":
        routed = pair_experts(w, x, weights, chosen, limit, kind="prefill")
    else:
        routed = routed_experts(w, x, weights, chosen, limit)
    return routed + swiglu(w.shared_experts, x, limit)


def pair_experts(w: MoeWeights, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                 limit: float | None, kind: str) -> torch.Tensor:
    """`routed_experts` through the kernels: each (row, expert) pair through the kernels' `routed_experts` as its own
    row of weight 1 (the clamped SwiGLU; a grouped GEMM on the GPU, capturable in a CUDA graph), so each pair's
    output is the expert's in x's dtype, and the float32 weighted sum in ascending expert order stays this
    module's (the kernel's default sum would weight and sum in x's dtype). `kind` picks the kernel's tiles ("decode"
    or "prefill"); a row's bits are the same in any call of one kind. Off the Triton path only: there `moe_fused`
    runs the kernel's own float32 sum."""
    T, k = chosen.shape
    pairs = x[:, None].expand(T, k, x.shape[1]).reshape(T * k, x.shape[1])         # [T·k, E]
    ones = torch.ones(T * k, 1, dtype=x.dtype, device=x.device)
    hidden = kernel_experts(pairs, chosen.reshape(T * k, 1), ones, w.gate_up, w.down, kind=kind,
                            limit=limit).view(T, k, x.shape[1])                     # [T, k, E] x's dtype
    return weighted_sum(hidden, weights)


def moe_routed(w: MoeWeights, x: torch.Tensor, top_k: int, routed_scaling: float, norm_topk_prob: bool,
               n_group: int, topk_group: int, limit: float | None) -> torch.Tensor:
    """`moe` for the decode step on every device: on a Triton device `moe_fused` with the decode tiles; elsewhere
    the routing as above (tensor ops) and `pair_experts` with the decode tiles."""
    if use_triton(x):
        return moe_fused(w, x, top_k, routed_scaling, norm_topk_prob, n_group, topk_group, limit, kind="decode")
    weights, chosen = route(w, x, top_k, routed_scaling, norm_topk_prob, n_group, topk_group)   # [T, k] each
    return pair_experts(w, x, weights, chosen, limit, kind="decode") + swiglu(w.shared_experts, x, limit)


def moe_fused(w: MoeWeights, x: torch.Tensor, top_k: int, routed_scaling: float, norm_topk_prob: bool,
              n_group: int, topk_group: int, limit: float | None, kind: str) -> torch.Tensor:
    """`moe` on the Triton path in a few launches: the float32 router GEMM, one routing kernel (`route`'s
    arithmetic, ties as `choose` breaks them, ids ascending), then the grouped experts with the float32 weighted
    sum in ascending expert order, rounded once. Folded (fused.fuse_moe), the shared expert is their last pair
    (expert N, weight 1), added after that rounding as `moe` adds it; apart, its SwiGLU runs in torch. Within
    the kernels' tolerances of `moe`, not bitwise (other dot orders; docs/families/glm.md)."""
    folded = w.experts_gate_up is not None
    weights, chosen = sigmoid_bias_top_k(router_logits(w, x), w.e_score_correction_bias.float(), top_k, n_group,
                                         topk_group, norm_topk_prob, routed_scaling, shared=folded)   # [T, k (+1)]
    if folded:
        return kernel_experts(x, chosen, weights, w.experts_gate_up, w.experts_down, kind=kind, limit=limit,
                              ordered=True, float32_sum=True, shared_last=True)
    routed = kernel_experts(x, chosen, weights, w.gate_up, w.down, kind=kind, limit=limit, ordered=True,
                            float32_sum=True)
    return routed + swiglu(w.shared_experts, x, limit)
