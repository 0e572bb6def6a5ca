"""Nemotron-H's tensor-parallel cuts (`family_tensor_parallel`): Megatron's, by head, by group and by column.

    Mamba2       in_proj [z | x | B | C | dt] column, piece by piece: z, x and dt by head, B and C by group;
                 conv1d weight and bias over [x | B | C] the same way; A_log, D, dt_bias by head; the gated norm's
                 weight by group (a rank holds whole groups, so the grouped norm is exact); out_proj row
    attention    q column by head, k and v by KV head; o_proj row
    MLP          up column, down row
    MoE          every expert's intermediate dim split (up column, down row), the shared expert as the MLP; the
                 router (float32), its correction bias and the latent projections replicated
    the rest     embeddings, block norms, norm_f and lm_head replicated

Every mixer's output is a partial sum on each rank, reduced once per layer (model.py). A rank's heads read their
own B/C groups: rank r holds heads [r·MH/N, (r+1)·MH/N) and groups [r·G/N, (r+1)·G/N), and head h reads group
h // (MH/G). States: the SSM state by head, the conv tail's channels piece by piece ([x | B | C]), keys and values by
KV head. The experts are split by their intermediate dim, not spread over ranks: every rank does the same work for
every row whatever the router picks (no rank waits on a busier one), the router and the expert kernels run
unchanged on smaller experts, and one reduction per layer covers routed and shared experts alike.

The stacked expert form (HF's in-memory `mixer.experts.up_proj` [NE, FE, W], `down_proj` [NE, W, FE]) is cut on
dims 1 and 2, which a column or row rule does not name: it is read whole and load.py keeps this rank's columns.
"""

from __future__ import annotations

from tensorfold.shard import Split, StateSplit, TensorParallel
from tensorfold_nemotron.config import ATTENTION, MAMBA, MLP, MOE, NemotronConfig
from tensorfold_nemotron.plugin import CONV, KEYS, KIND, SSM, VALUES

STACKED = {"up_proj": 1, "down_proj": 2}      # the stacked experts' FE dim, which load.py cuts itself


def tensor_parallel(c: NemotronConfig) -> TensorParallel:
    """The cuts of the module docstring for this config's layer kinds, and the counts that must divide."""
    kinds = set(c.layer_types)
    divides: dict[str, int] = {}
    params = [Split("mtp.*", "replicated")]               # the MTP head: skipped by load.py, never cut
    states = []
    if MAMBA in kinds:
        inner, GN = c.mamba_inner, c.n_groups * c.state_size
        divides.update({"Mamba2 heads (mamba_num_heads)": c.mamba_heads, "Mamba2 B/C groups (n_groups)": c.n_groups})
        params += [Split("*.mixer.in_proj.weight", "column", parts=(inner, inner, GN, GN, c.mamba_heads)),
                   Split("*.mixer.conv1d.*", "column", parts=(inner, GN, GN)),
                   Split("*.mixer.dt_bias", "column"), Split("*.mixer.A_log", "column"), Split("*.mixer.D", "column"),
                   Split("*.mixer.norm.weight", "column"), Split("*.mixer.out_proj.weight", "row")]
        states += [StateSplit(CONV, 0, kind=KIND[MAMBA], parts=(inner, GN, GN)), StateSplit(SSM, 0, kind=KIND[MAMBA])]
    if ATTENTION in kinds:
        divides.update({"attention heads (num_attention_heads)": c.heads,
                        "KV heads (num_key_value_heads)": c.kv_heads})
        params += [Split("*.mixer.[qkv]_proj.weight", "column"), Split("*.mixer.o_proj.weight", "row")]
        states += [StateSplit(KEYS, 0, kind=KIND[ATTENTION]), StateSplit(VALUES, 0, kind=KIND[ATTENTION])]
    if MOE in kinds:
        divides.update({"expert columns (moe_intermediate_size)": c.moe_intermediate_size,
                        "shared expert columns (moe_shared_expert_intermediate_size)": c.shared_intermediate_size})
        params += [Split("*.mixer.gate.*", "replicated"), Split("*.mixer.fc[12]_latent_proj.weight", "replicated"),
                   *(Split(f"*.mixer.experts.{name}", "replicated") for name in STACKED),
                   Split("*.mixer.experts.*.up_proj.weight", "column"),
                   Split("*.mixer.experts.*.down_proj.weight", "row"),
                   Split("*.mixer.shared_experts.up_proj.weight", "column"),
                   Split("*.mixer.shared_experts.down_proj.weight", "row")]
    if MLP in kinds:
        divides["MLP columns (intermediate_size)"] = c.intermediate_size
        params += [Split("*.mixer.up_proj.weight", "column"), Split("*.mixer.down_proj.weight", "row")]
    params += [Split("*.embeddings.weight", "replicated"), Split("*.layers.*.norm.weight", "replicated"),
               Split("*.norm_f.weight", "replicated"), Split("lm_head.weight", "replicated")]
    return TensorParallel(divides=divides, params=params, states=states)
