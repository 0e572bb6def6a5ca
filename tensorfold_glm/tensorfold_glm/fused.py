"""Layouts for the Triton path: a MoE layer's shared expert folded in as expert N of the routed experts' stacked
weights, so the grouped call runs it as one more pair of every row (tensorfold_qwen's `fuse_moe` does the same for
Qwen), and a KDA layer's six projections over x stacked into one matrix (`fuse_kda`). The old fields become views
of the new storage: nothing is held twice, and the reference's products read the same values."""

from __future__ import annotations

import attrs
import torch

from tensorfold.weights import stacked
from tensorfold_glm.kda import KdaWeights
from tensorfold_glm.mlp import MlpWeights, MoeWeights

KDA_INPUTS = ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj")   # fuse_kda's order of rows


def fuse_kda(w: KdaWeights) -> KdaWeights:
    """The layer with `inputs` [3·H·D + D + H + D, E] (KDA_INPUTS' rows in order) and those fields views of it;
    unchanged when already stacked."""
    if w.inputs is not None:
        return w
    whole, views = stacked([getattr(w, name) for name in KDA_INPUTS])
    return attrs.evolve(w, inputs=whole, **dict(zip(KDA_INPUTS, views, strict=True)))


def can_fold(w: MoeWeights) -> bool:
    """The shared expert has a routed expert's shape (n_shared_experts = 1: moe_intermediate_size wide)."""
    return tuple(w.shared_experts.down_proj.shape) == tuple(w.down.shape[1:])


def fuse_moe(w: MoeWeights) -> MoeWeights:
    """The layer with experts_gate_up [N + 1, 2F, E] and experts_down [N + 1, E, F] (the experts copied once, then
    the shared expert) and every old expert field a view of them; unchanged when already folded. The copy is one
    layer's experts: a loader that drops the old tensors as it goes grows its peak by one layer's experts."""
    if w.experts_gate_up is not None:
        return w
    if not can_fold(w):
        raise ValueError(f"fuse_moe: the shared expert's down_proj {list(w.shared_experts.down_proj.shape)} does not "
                         f"fit experts {list(w.down.shape)}: its width differs (n_shared_experts > 1), so it cannot "
                         "fold")
    N, F = w.down.shape[0], w.down.shape[2]
    shared = w.shared_experts
    gate_up = torch.cat([w.gate_up, torch.cat([shared.gate_proj, shared.up_proj])[None]])   # [N + 1, 2F, E]
    down = torch.cat([w.down, shared.down_proj[None]])                                       # [N + 1, E, F]
    return attrs.evolve(w, gate_up=gate_up[:N], down=down[:N],
                        shared_experts=MlpWeights(gate_proj=gate_up[N, :F], up_proj=gate_up[N, F:],
                                                  down_proj=down[N]),
                        experts_gate_up=gate_up, experts_down=down)
