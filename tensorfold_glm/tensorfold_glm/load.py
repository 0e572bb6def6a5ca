"""HF checkpoint names -> the GLM-5.3-Flash model's weights; every name is checked before a tensor is read.

names.py knows the names and their spellings; this file arranges them into the model's records. Two forms are
read, one per checkpoint: the on-disk form HF's save_pretrained writes (names.py), and the form HF holds in memory
(a state_dict: `self_attn.conv1d.weight` [3·H·D, 1, K] for the three convs, `self_attn.forget_gate.*`,
`{attn,ffn}_hc.{fn,base,scale}`, and fused experts `mlp.experts.gate_up_proj` [N, 2F, E] and `down_proj`
[N, E, F]), which `memory_names` maps onto the first. Tensors HF keeps
in float32 at a bf16 load stay float32 here too (the KDA convs, A_log, dt_bias, the mHC base and scale, the router
and its correction bias), so a bf16 model computes with the numbers HF computes with. The vision tower, MTP layers
and `shared_head` tensors are skipped with one log line. On a Triton device each MoE layer whose shared expert has
a routed expert's width gets the folded layout `mlp.moe_fused` reads (fused.fuse_moe), layer by layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tensorfold.checkpoint import Checkpoint, check_tensor_names, expected_tensors
from tensorfold.kernels.backend import use_triton
from tensorfold.shard import SINGLE, Shard
from tensorfold_glm.config import LINEAR, SPARSE, GlmConfig
from tensorfold_glm.fused import can_fold, fuse_kda, fuse_moe
from tensorfold_glm.hc import HcWeights
from tensorfold_glm.indexer import IndexerWeights
from tensorfold_glm.kda import KdaWeights
from tensorfold_glm.mla import MlaWeights
from tensorfold_glm.mlp import MlpWeights, MoeWeights
from tensorfold_glm.model import GlmModel, LayerWeights, Weights
from tensorfold_glm.names import TEXT, canonical, expected_shapes, is_ignored
from tensorfold_glm.parallel import check_form, on_rank

log = logging.getLogger(__name__)

KEPT_FLOAT32 = ("_conv1d.weight", ".conv1d.weight", ".A_log", ".dt_bias", "_base", "_scale", "mlp.gate.weight",
                "mlp.gate.e_score_correction_bias")

Get = Callable[[str], torch.Tensor]

MEMORY_RENAMES = (("self_attn.forget_gate.", "self_attn."), ("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_"))
FUSED_CONV = "self_attn.conv1d.weight"
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def memory_name(name: str) -> str:
    """A name of HF's in-memory form in the on-disk spelling, where the two differ by name only."""
    for memory, disk in MEMORY_RENAMES:
        if f".{memory}" in name:
            return name.replace(f".{memory}", f".{disk}", 1)
    return name


def key(name: str) -> str:
    """The name `expected_shapes` knows a checkpoint tensor by."""
    return canonical(memory_name(name))


def form_shapes(config: GlmConfig, names: list[str]) -> dict[str, tuple[int, ...]]:
    """expected_shapes in this checkpoint's form: fused convs and fused experts where it holds them."""
    shapes = expected_shapes(config)
    fused_conv = any(name.endswith(FUSED_CONV) for name in names)
    fused_experts = any(name.endswith(FUSED_EXPERTS) for name in names)
    H, D, K = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    N, F, E = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    for i, kind in enumerate(config.layer_types):
        prefix = f"{TEXT}layers.{i}."
        if fused_conv and kind == LINEAR:
            for part in ("q", "k", "v"):
                del shapes[f"{prefix}self_attn.{part}_conv1d.weight"]
            shapes[f"{prefix}{FUSED_CONV}"] = (3 * H * D, 1, K)
        if fused_experts and config.mlp_layer_types[i] == SPARSE:
            for name in [n for n in shapes if n.startswith(f"{prefix}mlp.experts.")]:
                del shapes[name]
            shapes[f"{prefix}mlp.experts.gate_up_proj"] = (N, 2 * F, E)
            shapes[f"{prefix}mlp.experts.down_proj"] = (N, E, F)
    return shapes


def check_names(names: list[str], config: GlmConfig) -> int:
    """Raise ValueError naming every missing, unexpected or doubled tensor; return how many are skipped."""
    return check_tensor_names(names, form_shapes(config, names), key, lambda known: is_ignored(known, config),
                              model=config.model_type)


def target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is held in: float32 for those HF keeps in float32, `dtype` for the rest."""
    return torch.float32 if name.endswith(KEPT_FLOAT32) else dtype


def load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, progress: bool = True,
         shard: Shard = SINGLE) -> GlmModel:
    """Read every weight once, shard by shard, into its dtype on `device`, and build the model (this rank's part
    of it: the checkpoint a rank reads yields its slices, follow/sharded.py; parallel.py names the cuts)."""
    config = on_rank(GlmConfig.from_dict(checkpoint.config), shard)
    names = checkpoint.names()
    check_form(names, shard)
    skips = check_names(names, config)
    if skips:
        log.info("skipped %d tensors the text model does not use (vision tower model.visual.*, MTP layers, "
                 "shared_head, tied lm_head)", skips)
    shapes = form_shapes(config, names)
    found = {known: tensor.to(device=device, dtype=target_dtype(known, dtype)).contiguous()
             for known, tensor in expected_tensors(checkpoint, shapes, key, progress)}
    return GlmModel(config, build_weights(config, found), shard)


def build_weights(config: GlmConfig, found: dict[str, torch.Tensor]) -> Weights:
    """Arrange tensors named as in `expected_shapes` into the model's records (taken out of `found` as used)."""
    layers = []
    for i, kind in enumerate(config.layer_types):
        def get(name: str, i: int = i) -> torch.Tensor:
            return found.pop(f"{TEXT}layers.{i}.{name}")

        def has(name: str, i: int = i) -> bool:
            return f"{TEXT}layers.{i}.{name}" in found

        mixer = kda_weights(get, has) if kind == LINEAR else mla_weights(get, config.indexer(i) == "full")
        ffn = moe_weights(config, get, has) if config.mlp_layer_types[i] == SPARSE else mlp_weights(get, "mlp.")
        layers.append(LayerWeights(attn_hc=hc_weights(get, "attn"), input_norm=get("input_layernorm.weight"),
                                   mixer=mixer, ffn_hc=hc_weights(get, "ffn"),
                                   post_norm=get("post_attention_layernorm.weight"), ffn=ffn))
    embed = found[f"{TEXT}embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else found["lm_head.weight"]
    return Weights(embed=embed, layers=tuple(layers), norm=found[f"{TEXT}norm.weight"], lm_head=lm_head)


def hc_weights(get: Get, block: str) -> HcWeights:
    return HcWeights(fn=get(f"hc_{block}_fn"), base=get(f"hc_{block}_base"), scale=get(f"hc_{block}_scale"))


def kda_weights(get: Get, has: Callable[[str], bool]) -> KdaWeights:
    if has(FUSED_CONV):
        conv = get(FUSED_CONV).squeeze(1)
    else:
        conv = torch.cat([get(f"self_attn.{part}_conv1d.weight").squeeze(1) for part in ("q", "k", "v")])
    projections = {name: get(f"self_attn.{name}.weight") for name in
                   ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
                    "o_proj")}
    w = KdaWeights(**projections, conv=conv.contiguous(), A_log=get("self_attn.A_log"),
                   dt_bias=get("self_attn.dt_bias"), o_norm=get("self_attn.o_norm.weight"))
    return fuse_kda(w) if use_triton(w.q_proj) else w             # the decode step's one GEMM: the Triton path


def mla_weights(get: Get, full_indexer: bool) -> MlaWeights:
    indexer = None
    if full_indexer:
        indexer = IndexerWeights(
            wq_b=get("self_attn.indexer.wq_b.weight"), wk=get("self_attn.indexer.wk.weight"),
            k_norm=get("self_attn.indexer.k_norm.weight"), k_norm_bias=get("self_attn.indexer.k_norm.bias"),
            weights_proj=get("self_attn.indexer.weights_proj.weight"),
            index_kpool_compress_ape=get("self_attn.indexer.index_kpool_compress_ape"),
            index_kpool_compress_gate=get("self_attn.indexer.index_kpool_compress_gate"))
    return MlaWeights(**{name: get(f"self_attn.{name}.weight") for name in
                         ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                          "kv_b_proj", "o_proj")}, indexer=indexer)


def mlp_weights(get: Get, prefix: str) -> MlpWeights:
    return MlpWeights(*(get(f"{prefix}{name}.weight") for name in ("gate_proj", "up_proj", "down_proj")))


def moe_weights(config: GlmConfig, get: Get, has: Callable[[str], bool]) -> MoeWeights:
    """The experts as gate_up [N, 2F, E] (gate rows, then up rows) and down [N, E, F]: fused as they come, or
    per-expert tensors stacked; on a Triton device with the shared expert folded in where it fits."""
    F, N, E = config.moe_intermediate_size, config.n_routed_experts, config.hidden_size
    gate_up = down = None
    if has(FUSED_EXPERTS[0]):
        gate_up, down = get(FUSED_EXPERTS[0]), get(FUSED_EXPERTS[1])
    for e in range(N if gate_up is None else 0):
        expert = mlp_weights(get, f"mlp.experts.{e}.")
        if gate_up is None:
            gate_up = expert.gate_proj.new_empty((N, 2 * F, E))
            down = expert.down_proj.new_empty((N, E, F))
        gate_up[e, :F], gate_up[e, F:], down[e] = expert.gate_proj, expert.up_proj, expert.down_proj
    w = MoeWeights(router=get("mlp.gate.weight"), e_score_correction_bias=get("mlp.gate.e_score_correction_bias"),
                   gate_up=gate_up, down=down, shared_experts=mlp_weights(get, "mlp.shared_experts."))
    return fuse_moe(w) if use_triton(w.router) and can_fold(w) else w
