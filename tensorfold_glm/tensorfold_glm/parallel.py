"""Tensor parallelism for GLM-5.3-Flash: which tensors each rank cuts, which states it holds a part of, and the
config a rank's model is built with (docs/families/glm.md, "Tensor parallelism").

    KDA        q/k/v, their convs, f_b, g_b, b_proj, A_log, dt_bias by head (column); f_a, g_a, o_norm whole;
               o_proj by input column (row), reduced. States: recurrent by head, the conv tail per [q | k | v] piece
    MLA        q_a, kv_a and their norms whole (the latent is whole on every rank); q_b, kv_b by head; o_proj row
    DSA        the indexer whole: its top-k ranks the pools by a sum over every index head, so each rank computes
               the same selection from the same bits; its pooled keys and pool tail are whole
    MLP / MoE  gate/up by column, down by row, for the dense MLP, every routed expert (its intermediate dim split,
               every rank holding every expert) and the shared experts; the router whole
    the rest   mHC, norms, the embedding and lm_head whole

Every row-parallel output is reduced once per block (model.py); the MoE's routed and shared parts share it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from tensorfold.shard import Shard, Split, StateSplit, TensorParallel
from tensorfold_glm.config import CONV, DENSE, INDEXED, KDA_KIND, LINEAR, RECURRENT, SPARSE, GlmConfig

FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


# what must divide the world (as refusals name it), the config field, and whether a config has layers that use it
SHARES: tuple[tuple[str, str, Callable[[GlmConfig], bool]], ...] = (
    ("KDA heads (linear_num_heads)", "linear_num_heads", lambda c: LINEAR in c.layer_types),
    ("MLA attention heads (num_attention_heads)", "num_attention_heads", lambda c: INDEXED in c.layer_types),
    ("dense MLP columns (intermediate_size)", "intermediate_size", lambda c: DENSE in c.mlp_layer_types),
    ("columns of each routed and shared expert (moe_intermediate_size)", "moe_intermediate_size",
     lambda c: SPARSE in c.mlp_layer_types),
)


def divides(c: GlmConfig) -> dict[str, int]:
    """The counts each rank takes a share of, for the parts this config's layers have."""
    return {what: getattr(c, field) for what, field, has in SHARES if has(c)}


def tensor_parallel(c: GlmConfig) -> TensorParallel:
    """The cuts of the module docstring, as rules over the checkpoint's names (both forms, every spelling)."""
    width = c.linear_num_heads * c.linear_head_dim
    column = ["*.self_attn.[qkv]_proj.weight", "*.self_attn.[qkv]_conv1d.weight", "*.f_b_proj.weight", "*.A_log",
              "*.dt_bias", "*.self_attn.b_proj.weight", "*.self_attn.g_b_proj.weight",           # KDA
              "*.self_attn.q_b_proj.weight", "*.self_attn.kv_b_proj.weight",                     # MLA
              "*.mlp.*gate_proj.weight", "*.mlp.*up_proj.weight"]                                 # MLPs, experts
    row = ["*.self_attn.o_proj.weight", "*.mlp.*down_proj.weight"]
    return TensorParallel(
        divides=divides(c),
        params=[Split("model.visual.*", "replicated"),                    # the vision tower: read, never used
                *(Split(pattern, "column") for pattern in column),
                Split("*.self_attn.conv1d.weight", "column", parts=(width,) * 3),   # one conv over [q | k | v]
                *(Split(pattern, "row") for pattern in row),
                Split("*", "replicated")],
        states=[StateSplit(RECURRENT, 0, kind=KDA_KIND), StateSplit(CONV, 0, kind=KDA_KIND, parts=(width,) * 3)])


def on_rank(c: GlmConfig, shard: Shard) -> GlmConfig:
    """This rank's config: its share of the KDA heads, the MLA heads and the MLPs' and experts' columns."""
    if shard.world == 1:
        return c
    return attrs.evolve(c, **{field: shard.split(getattr(c, field), what) for what, field, has in SHARES if has(c)})


def check_form(names: Iterable[str], shard: Shard) -> None:
    """ValueError for the fused experts of HF's in-memory form above TP=1: their down_proj [N, E, F] has its
    intermediate dim last, which no Split cuts (a Split cuts dim 0 or 1)."""
    fused = sorted(name for name in names if name.endswith(FUSED_EXPERTS))
    if shard.world > 1 and fused:
        raise ValueError(f"the glm family serves fused experts ({fused[0]}, HF's in-memory form) at "
                         "--tensor-parallel-size 1 only: their down_proj [N, E, F] would be cut along its last dim; "
                         "save the checkpoint in the on-disk form (save_pretrained: mlp.experts.{e}.*_proj.weight)")
