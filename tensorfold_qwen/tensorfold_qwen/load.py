"""HF checkpoint names -> the Qwen3.5 model's weights; every name is checked before a tensor is read.

Text-only checkpoints (`qwen3_5_text`, `qwen3_5_moe_text`) name the language model `model.layers.*`; the VL
container (`qwen3_5`, `qwen3_5_moe`, what Qwen publishes) nests it as `model.language_model.*` and adds a vision
tower `model.visual.*` and a multi-token-prediction head `mtp.*`. Both spellings are accepted; the vision tower and
the MTP head are skipped with one log line saying how many tensors that was. This file is the only place that
knows these names.

A MoE layer's experts come in either of two forms, one form for the whole checkpoint: per expert, as HF writes
them to disk (`mlp.experts.{e}.gate_proj.weight` / `up_proj` / `down_proj`, stacked here), or fused, as HF holds
them in memory (`mlp.experts.gate_up_proj` [N, 2F, E], `mlp.experts.down_proj` [N, E, F], used as they come).
"""

from __future__ import annotations

import logging
import re

import torch

from tensorfold.checkpoint import Checkpoint, check_tensor_names, expected_tensors
from tensorfold.kernels.backend import use_triton
from tensorfold.shard import SINGLE, Shard
from tensorfold_qwen.attention import AttentionWeights
from tensorfold_qwen.config import FULL, QwenConfig
from tensorfold_qwen.fused import can_fold, fuse_mlp, fuse_moe
from tensorfold_qwen.gdn import GdnWeights
from tensorfold_qwen.mlp import MlpWeights, MoeWeights
from tensorfold_qwen.model import LayerWeights, QwenModel, Weights

log = logging.getLogger(__name__)

NESTED = "model.language_model."
SKIPPED = ("model.visual.", "mtp.")          # the vision tower and the MTP head: not part of the text model
PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
FUSED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def attention_shapes(c: QwenConfig) -> dict[str, tuple[int, ...]]:
    """An attention layer's tensors, under `model.layers.{i}.`."""
    E, H, KV, D = c.hidden_size, c.heads, c.kv_heads, c.head_dim
    return {
        "self_attn.q_proj.weight": (H * 2 * D, E),
        "self_attn.k_proj.weight": (KV * D, E),
        "self_attn.v_proj.weight": (KV * D, E),
        "self_attn.o_proj.weight": (E, H * D),
        "self_attn.q_norm.weight": (D,),
        "self_attn.k_norm.weight": (D,),
    }


def gdn_shapes(c: QwenConfig) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors, under `model.layers.{i}.`."""
    E, NV, DV = c.hidden_size, c.v_heads, c.v_dim
    return {
        "linear_attn.in_proj_qkv.weight": (c.conv_dim, E),
        "linear_attn.in_proj_z.weight": (NV * DV, E),
        "linear_attn.in_proj_b.weight": (NV, E),
        "linear_attn.in_proj_a.weight": (NV, E),
        "linear_attn.conv1d.weight": (c.conv_dim, 1, c.conv_kernel),
        "linear_attn.A_log": (NV,),
        "linear_attn.dt_bias": (NV,),
        "linear_attn.norm.weight": (DV,),
        "linear_attn.out_proj.weight": (E, NV * DV),
    }


def mlp_shapes(c: QwenConfig, prefix: str, inner: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's tensors under `prefix`."""
    E = c.hidden_size
    return {f"{prefix}gate_proj.weight": (inner, E), f"{prefix}up_proj.weight": (inner, E),
            f"{prefix}down_proj.weight": (E, inner)}


def ffn_shapes(c: QwenConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """A layer's feed-forward tensors: the dense MLP, or the router, experts (per expert, or fused), shared expert
    and its gate."""
    if not c.moe:
        return mlp_shapes(c, "mlp.", c.intermediate_size)
    E, N, F = c.hidden_size, c.experts, c.moe_intermediate_size
    shapes = {"mlp.gate.weight": (N, E), "mlp.shared_expert_gate.weight": (1, E)}
    shapes.update(mlp_shapes(c, "mlp.shared_expert.", c.shared_intermediate_size))
    if fused:
        shapes.update({"mlp.experts.gate_up_proj": (N, 2 * F, E), "mlp.experts.down_proj": (N, E, F)})
    else:
        for e in range(N):
            shapes.update(mlp_shapes(c, f"mlp.experts.{e}.", F))
    return shapes


def expected_shapes(c: QwenConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold (plain `model.` spelling) and its shape; `fused`: the experts in
    HF's fused form."""
    E = c.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, E), "model.norm.weight": (E,)}
    for i, kind in enumerate(c.layer_types):
        layer = {"input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,)}
        layer.update(attention_shapes(c) if kind == FULL else gdn_shapes(c))
        layer.update(ffn_shapes(c, fused))
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, E)
    return shapes


def canonical(name: str) -> str:
    """A checkpoint name in the plain spelling: `model.language_model.x` -> `model.x`."""
    return "model." + name[len(NESTED):] if name.startswith(NESTED) else name


def skipped(name: str, config: QwenConfig) -> bool:
    """Tensors that are in the checkpoint but not the text model: vision, MTP, a tied lm_head."""
    return name.startswith(SKIPPED) or (name == "lm_head.weight" and config.tie_word_embeddings)


def fused_experts(names: list[str], config: QwenConfig) -> bool:
    """Whether the checkpoint holds its experts fused (`mlp.experts.gate_up_proj`, `down_proj`) rather than per
    expert; ValueError when it holds both forms."""
    kept = [canonical(name) for name in names if not skipped(canonical(name), config)]
    per = [name for name in kept if PER_EXPERT.search(name)]
    fused = [name for name in kept if FUSED.search(name)]
    if per and fused:
        raise ValueError(f"the checkpoint mixes the two expert forms: {len(fused)} fused tensors (e.g. {fused[0]}) "
                         f"and {len(per)} per-expert tensors (e.g. {per[0]}); every layer's experts must be either "
                         "mlp.experts.gate_up_proj + mlp.experts.down_proj or mlp.experts.{e}.{gate,up,down}_proj")
    return bool(fused)


def check_names(names: list[str], config: QwenConfig, fused: bool = False) -> int:
    """Raise ValueError naming every missing, unexpected or doubled tensor; return how many are skipped."""

    def expert_form(missing: list[str]) -> str | None:
        """Which expert form was read, when experts are missing: the other form's names would be unexpected."""
        if not any(".mlp.experts." in name for name in missing):
            return None
        return (f"experts are read in the {'fused' if fused else 'per-expert'} form this checkpoint uses: "
                + ("mlp.experts.gate_up_proj [N, 2F, E] and mlp.experts.down_proj [N, E, F] per layer"
                   if fused else "mlp.experts.{e}.{gate,up,down}_proj.weight for every e < num_experts"))

    return check_tensor_names(names, expected_shapes(config, fused), canonical, lambda key: skipped(key, config),
                              model=config.model_type, explain_missing=expert_form)


def load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, progress: bool = True,
         shard: Shard = SINGLE) -> QwenModel:
    """Read every weight once, shard by shard, into `dtype` on `device`, and build the model (this rank's part of
    it with a shard of world N: the checkpoint then yields the rank's slices, cut as parallel.py declares)."""
    config = QwenConfig.from_dict(checkpoint.config).on_rank(shard)
    names = checkpoint.names()
    fused = fused_experts(names, config)
    skips = check_names(names, config, fused)
    if skips:
        log.info("skipped %d tensors the text model does not use (vision tower model.visual.*, MTP head mtp.*, "
                 "tied lm_head)", skips)
    shapes = expected_shapes(config, fused)
    found = {key: tensor.to(device=device, dtype=dtype).contiguous()           # no copy when it already fits
             for key, tensor in expected_tensors(checkpoint, shapes, canonical, progress)}
    return QwenModel(config, build_weights(config, found), shard)


def build_weights(config: QwenConfig, found: dict[str, torch.Tensor]) -> Weights:
    """Arrange tensors named as in `expected_shapes` (either expert form) into the model's records (each taken
    out of `found` as it is used, so stacking per-expert tensors, or copying a layer's experts into the fused
    layout on a Triton device (fused.fuse_moe; a dense MLP's gate and up stacked, fused.fuse_mlp), holds at most one
    layer's experts twice)."""
    layers = []
    for i, kind in enumerate(config.layer_types):
        def get(name: str, i: int = i) -> torch.Tensor:
            return found.pop(f"model.layers.{i}.{name}")

        def has(name: str, i: int = i) -> bool:
            return f"model.layers.{i}.{name}" in found

        mixer = attention_weights(get) if kind == FULL else gdn_weights(get)
        layers.append(LayerWeights(input_norm=get("input_layernorm.weight"), mixer=mixer,
                                   post_norm=get("post_attention_layernorm.weight"),
                                   ffn=ffn_weights(config, get, has)))
    embed = found["model.embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else found["lm_head.weight"]
    return Weights(embed=embed, layers=tuple(layers), norm=found["model.norm.weight"], lm_head=lm_head)


def attention_weights(get) -> AttentionWeights:
    return AttentionWeights(**{field: get(f"self_attn.{field}.weight")
                               for field in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")})


def gdn_weights(get) -> GdnWeights:
    return GdnWeights(
        in_proj_qkv=get("linear_attn.in_proj_qkv.weight"), in_proj_z=get("linear_attn.in_proj_z.weight"),
        in_proj_b=get("linear_attn.in_proj_b.weight"), in_proj_a=get("linear_attn.in_proj_a.weight"),
        conv=get("linear_attn.conv1d.weight").squeeze(1).contiguous(), A_log=get("linear_attn.A_log"),
        dt_bias=get("linear_attn.dt_bias"), norm=get("linear_attn.norm.weight"),
        out_proj=get("linear_attn.out_proj.weight"))


def mlp_weights(get, prefix: str) -> MlpWeights:
    return MlpWeights(*(get(f"{prefix}{name}.weight") for name in ("gate_proj", "up_proj", "down_proj")))


def ffn_weights(config: QwenConfig, get, has) -> MlpWeights | MoeWeights:
    if not config.moe:
        dense = mlp_weights(get, "mlp.")
        return fuse_mlp(dense) if use_triton(dense.gate_proj) else dense   # the stacked layout: the Triton path
    if has("mlp.experts.gate_up_proj"):
        gate_up, down = get("mlp.experts.gate_up_proj"), get("mlp.experts.down_proj")
    else:
        gate_up, down = stacked_experts(config, get)
    moe = MoeWeights(router=get("mlp.gate.weight"), gate_up=gate_up, down=down,
                     shared=mlp_weights(get, "mlp.shared_expert."),
                     shared_gate=get("mlp.shared_expert_gate.weight"), top_k=config.top_k)
    if not use_triton(moe.router):                  # the fused layout serves the Triton path alone
        return moe
    return fuse_moe(moe, fold=can_fold(moe.shared, moe.down))


def stacked_experts(config: QwenConfig, get) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert tensors into the fused layout: gate_up [N, 2F, E] (gate rows, then up rows), down [N, E, F]."""
    F = config.moe_intermediate_size
    gate_up = down = None
    for e in range(config.experts):
        expert = mlp_weights(get, f"mlp.experts.{e}.")
        if gate_up is None:
            gate_up = expert.gate_proj.new_empty((config.experts, 2 * F, config.hidden_size))
            down = expert.down_proj.new_empty((config.experts, config.hidden_size, F))
        gate_up[e, :F], gate_up[e, F:], down[e] = expert.gate_proj, expert.up_proj, expert.down_proj
    return gate_up, down
