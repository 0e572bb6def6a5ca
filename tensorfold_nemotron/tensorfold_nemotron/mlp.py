"""Nemotron-H's feed-forward mixers: the relu² MLP (`-` layers) and the routed MoE (`E` layers).

    mlp(x) = down(relu(up(x))²)                       no gate
    moe(x) = out_latent(Σ_k w_k · expert_k(in_latent(x))) + mlp_shared(x)
        router: s = sigmoid(x W_r) in float32; experts picked by s + correction bias, inside the topk_group groups
                whose top-2 sums are largest; w = s of the picked (renormalised with norm_topk_prob) · routed_scaling
        latent: with moe_latent_size the experts read and write a latent of L (fc1/fc2_latent_proj); else E
    experts: tensorfold.kernels.moe.routed_experts(activation="relu2"), the weights rounded to the model's dtype

Shapes in comments: T rows, E hidden, F intermediate, NE experts, k experts per row, W what experts read (L or E).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from tensorfold.kernels.moe import routed_experts
from tensorfold_nemotron.config import NemotronConfig


@attrs.frozen
class MlpWeights:
    """A relu² MLP (HF names `up_proj`, `down_proj`)."""

    up_proj: torch.Tensor               # [F, E]
    down_proj: torch.Tensor             # [E, F]


@attrs.frozen
class MoeWeights:
    """A routed MoE layer's tensors (HF names under `mixer.`)."""

    router: torch.Tensor                # [NE, E] float32 in every model dtype   gate.weight
    correction: torch.Tensor            # [NE] float32                           gate.e_score_correction_bias
    up: torch.Tensor                    # [NE, FE, W]                            experts.up_proj
    down: torch.Tensor                  # [NE, W, FE]                            experts.down_proj
    shared: MlpWeights                  # shared_experts.*
    latent_in: torch.Tensor | None = None    # [L, E]                            fc1_latent_proj.weight
    latent_out: torch.Tensor | None = None   # [E, L]                            fc2_latent_proj.weight


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU."""
    return torch.relu(x).square()


def mlp(w: MlpWeights, x: torch.Tensor) -> torch.Tensor:
    """down(relu(up(x))²): [T, E] -> [T, E]."""
    return F.linear(relu2(F.linear(x, w.up_proj)), w.down_proj)


def route(w: MoeWeights, c: NemotronConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped top-k router, in float32: routing weights [T, k] float32 and chosen experts [T, k] long."""
    T, NE, groups = x.shape[0], c.experts, c.n_group
    scores = torch.sigmoid(F.linear(x.float(), w.router.float()))                  # [T, NE]
    choice = scores + w.correction.float()                                         # the bias picks, never weighs
    group_scores = choice.view(T, groups, NE // groups).topk(2, dim=-1).values.sum(-1)          # [T, groups]
    kept = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False).indices               # [T, topk_group]
    in_kept = torch.zeros_like(group_scores).scatter_(1, kept, 1.0).bool()                      # [T, groups]
    in_kept = in_kept[:, :, None].expand(T, groups, NE // groups).reshape(T, NE)
    chosen = torch.topk(choice.masked_fill(~in_kept, float("-inf")), k=c.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, chosen)                                             # [T, k]
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * c.routed_scaling_factor, chosen


def moe(w: MoeWeights, c: NemotronConfig, x: torch.Tensor, kind: str = "decode") -> torch.Tensor:
    """The routed experts (through the latent when there is one) plus the shared expert: [T, E] -> [T, E]. `kind`
    ("decode" or "prefill") picks the experts' GPU tiles (kernels.moe)."""
    weights, chosen = route(w, c, x)
    h = F.linear(x, w.latent_in) if w.latent_in is not None else x                 # [T, W]
    out = routed_experts(h, chosen, weights.to(h.dtype), w.up, w.down, activation="relu2", kind=kind)   # [T, W]
    if w.latent_out is not None:
        out = F.linear(out, w.latent_out)                                          # [T, E]
    return out + mlp(w.shared, x)
