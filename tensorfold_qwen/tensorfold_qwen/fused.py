"""Input projections stacked into one matrix per layer, so the GPU decode step runs one GEMM where the reference
runs four (GDN) or three (attention). The separate matrices become row views of the stacked one: nothing is
held twice, and the reference's products are the same bits (a row block of a contiguous matrix is itself a
contiguous matrix)."""

from __future__ import annotations

import attrs
import torch

from tensorfold_qwen.attention import AttentionWeights
from tensorfold_qwen.gdn import GdnWeights


def stacked(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The parts [Ri, E] stacked along rows into one new matrix, and each part as a view of it."""
    whole = torch.cat(parts)
    views, row = [], 0
    for part in parts:
        views.append(whole[row: row + part.shape[0]])
        row += part.shape[0]
    return whole, views


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
