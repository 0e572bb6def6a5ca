"""Input projections stacked into one matrix per layer, so the GPU decode step runs one GEMM where the reference
runs four (GDN) or three (attention) or two (a dense MLP's gate and up), and a MoE layer's fused layout
(`fuse_moe`). The separate matrices become
row views of the stacked one: nothing is held twice, and the reference's products are the same bits (a row block
of a contiguous matrix is itself a contiguous matrix)."""

from __future__ import annotations

import attrs
import torch

from tensorfold.weights import stacked
from tensorfold_qwen.attention import AttentionWeights
from tensorfold_qwen.gdn import GdnWeights
from tensorfold_qwen.mlp import MlpWeights, MoeWeights


def fuse_mixer(mixer: GdnWeights | AttentionWeights) -> GdnWeights | AttentionWeights:
    """One layer's mixer with its input projections stacked (unchanged when they already are)."""
    if isinstance(mixer, GdnWeights):
        if mixer.in_proj is not None:
            return mixer
        whole, (qkv, z, b, a) = stacked([mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a])
        return attrs.evolve(mixer, in_proj=whole, in_proj_qkv=qkv, in_proj_z=z, in_proj_b=b, in_proj_a=a)
    if mixer.qkv is not None:
        return mixer
    whole, (q, k, v) = stacked([mixer.q_proj, mixer.k_proj, mixer.v_proj])
    return attrs.evolve(mixer, qkv=whole, q_proj=q, k_proj=k, v_proj=v)


def fuse_mlp(w: MlpWeights) -> MlpWeights:
    """A dense MLP with gate_proj and up_proj stacked into `gate_up` (unchanged when they already are)."""
    if w.gate_up is not None:
        return w
    whole, (gate, up) = stacked([w.gate_proj, w.up_proj])
    return attrs.evolve(w, gate_proj=gate, up_proj=up, gate_up=whole)


def can_fold(shared: MlpWeights, down: torch.Tensor) -> bool:
    """The shared expert has the routed experts' shape (shared F == F), so it can be one more of them."""
    return tuple(shared.down_proj.shape) == tuple(down.shape[1:])


def fuse_moe(w: MoeWeights, fold: bool) -> MoeWeights:
    """A MoE layer in the layout `mlp.moe_fused` reads: router and shared_gate (and the shared expert's gate/up
    unless folded) stacked in `inputs`; with `fold` (can_fold must hold) the experts copied once into N + 1 slots,
    the shared expert the last. Every old field becomes a view of the new storage, so once the caller drops the
    old tensors nothing is held twice (at load, layer by layer: the peak grows by one layer's experts)."""
    if w.inputs is not None:
        return w
    if not fold:
        inputs, (router, shared_gate, gate, up) = stacked([w.router, w.shared_gate, w.shared.gate_proj,
                                                           w.shared.up_proj])
        return attrs.evolve(w, router=router, shared_gate=shared_gate, inputs=inputs,
                            shared=MlpWeights(gate_proj=gate, up_proj=up, down_proj=w.shared.down_proj))
    if not can_fold(w.shared, w.down):
        raise ValueError(f"fuse_moe: the shared expert's down_proj {list(w.shared.down_proj.shape)} does not fit "
                         f"experts {list(w.down.shape)}: its intermediate size differs, so it cannot fold")
    N, F = w.down.shape[0], w.down.shape[2]
    gate_up = torch.cat([w.gate_up, torch.cat([w.shared.gate_proj, w.shared.up_proj])[None]])   # [N + 1, 2F, E]
    down = torch.cat([w.down, w.shared.down_proj[None]])                                        # [N + 1, E, F]
    inputs, (router, shared_gate) = stacked([w.router, w.shared_gate])
    return attrs.evolve(w, router=router, shared_gate=shared_gate, gate_up=gate_up[:N], down=down[:N],
                        shared=MlpWeights(gate_proj=gate_up[N, :F], up_proj=gate_up[N, F:], down_proj=down[N]),
                        inputs=inputs, experts_gate_up=gate_up, experts_down=down)
