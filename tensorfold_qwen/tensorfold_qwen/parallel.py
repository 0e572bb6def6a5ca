"""How a Qwen3.5 model is cut across tensor-parallel ranks (`family_tensor_parallel`, docs/families/qwen.md).

    gated attention   q_proj by head (each head's D query rows and D gate rows stay together), k/v_proj by KV
                      head: column; o_proj: row; q_norm, k_norm (per head dim): whole
    Gated DeltaNet    in_proj_qkv and the depthwise conv by channel, each of the q, k and v pieces cut on its own
                      (a rank holds its key heads of q and k and its value heads of v); in_proj_z/b/a, A_log,
                      dt_bias by value head: column; out_proj: row; the gated norm (per value head dim): whole
    MLP               gate/up: column; down: row
    MoE               every expert's gate/up: column, down: row (each rank holds a slice of every expert's
                      columns), the shared expert the same; the router and the shared expert's gate: whole
    embed, lm_head, norms, the vision tower and MTP head (skipped at load): whole

Each layer's mixer and feed-forward end in one row-parallel product, so a layer costs two reductions
(model.py). Every cut is on whole heads of the rank's own range, so a rank's value heads use its own key heads
(value head j reads key head j // (NV / NK)), and a rank's query heads its own KV heads.
"""

from __future__ import annotations

from tensorfold.shard import Split, StateSplit, TensorParallel
from tensorfold_qwen.config import QwenConfig
from tensorfold_qwen.model import CONV, KEYS, RECURRENT, VALUES


def conv_parts(c: QwenConfig) -> tuple[int, int, int]:
    """The GDN conv channels' pieces, side by side: q (NK·DK), k (NK·DK), v (NV·DV)."""
    return (c.k_heads * c.k_dim, c.k_heads * c.k_dim, c.v_heads * c.v_dim)


def mlp_splits(prefix: str) -> list[Split]:
    """A SwiGLU MLP under `prefix`: gate and up by column, down by row."""
    return [Split(f"{prefix}gate_proj.weight", "column"), Split(f"{prefix}up_proj.weight", "column"),
            Split(f"{prefix}down_proj.weight", "row")]


def tensor_parallel(c: QwenConfig) -> TensorParallel:
    """The cuts of every tensor the checkpoint holds and of every state split by head; the counts that must
    divide the world."""
    qkv = conv_parts(c)
    F = c.moe_intermediate_size
    params = [
        Split("model.visual.*", "replicated"), Split("mtp.*", "replicated"),       # not read: never cut
        Split("*.self_attn.[qkv]_proj.weight", "column"), Split("*.self_attn.o_proj.weight", "row"),
        Split("*.linear_attn.in_proj_qkv.weight", "column", parts=qkv),
        Split("*.linear_attn.conv1d.weight", "column", parts=qkv),
        Split("*.linear_attn.in_proj_[zba].weight", "column"),
        Split("*.linear_attn.A_log", "column"), Split("*.linear_attn.dt_bias", "column"),
        Split("*.linear_attn.out_proj.weight", "row"),
        *mlp_splits("*.mlp."), *mlp_splits("*.mlp.shared_expert."), *mlp_splits("*.mlp.experts.*."),
        Split("*.mlp.experts.gate_up_proj", "column", parts=(F, F), axis=1),      # [N, 2F, E], fused form
        Split("*.mlp.experts.down_proj", "row", axis=-1),                           # [N, E, F]
        Split("*.mlp.gate.weight", "replicated"), Split("*.mlp.shared_expert_gate.weight", "replicated"),
        Split("*", "replicated"),
    ]
    states = [StateSplit(KEYS, 0, kind="attention"), StateSplit(VALUES, 0, kind="attention"),
              StateSplit(RECURRENT, 0, kind="gdn"), StateSplit(CONV, 0, kind="gdn", parts=qkv)]
    return TensorParallel(divides={what: count for _, what, count in c.rank_counts()}, params=params, states=states)
