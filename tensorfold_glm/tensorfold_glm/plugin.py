"""The glm family's hook implementations: everything the core asks of a family, answered once at startup.

Registered by the entry point `glm = "tensorfold_glm.plugin"` in group `tensorfold` (pyproject.toml). The model
itself (`load.py`) is imported only when `family_load` is called, so listing families and planning memory never
import the forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tensorfold.chat.api import ChatFormat
from tensorfold.chat.tools import tool_parser
from tensorfold.hookspecs import hookimpl
from tensorfold.image import ImageFormat
from tensorfold.kernels.gated_delta.naive import CHUNK
from tensorfold.kernels.moe import TILES
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState, dtype_name
from tensorfold.shard import Shard, TensorParallel
from tensorfold.testing.tiny_checkpoint import write_tiny_config, write_tiny_weights
from tensorfold_glm.config import (
    CONV,
    FULL_INDEXER,
    KDA_KIND,
    LATENT,
    LINEAR,
    MLA_KIND,
    MODEL_TYPES,
    POOL_TAIL,
    POOLED_KEY,
    RECURRENT,
    SELECT_BYTES,
    SERVED_DTYPES,
    GlmConfig,
    unsupported,
)
from tensorfold_glm.names import expected_shapes
from tensorfold_glm.parallel import tensor_parallel

if TYPE_CHECKING:
    from tensorfold.checkpoint import Checkpoint
    from tensorfold.family import FamilyModel
    from tensorfold.settings import Settings

IMAGE_FORMAT = "glm5_next-hybrid"
IMAGE_VERSION = 1          # bump when the meaning of a kept state changes (e.g. latents stored before their norm)

TINY_CONFIG: dict[str, Any] = {
    "model_type": "glm5_next",
    "architectures": ["Glm5NextForConditionalGeneration"],
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "indexer_types": ["full", "full", "full", "full"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 10.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    # KDA
    "linear_num_heads": 2,
    "linear_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    # MLA (NoPE)
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 0,
    "v_head_dim": 16,
    "attention_bias": False,
    "attention_dropout": 0.0,
    # DSA indexer: pools of 4, 4 pools kept, so selection starts beyond 16 tokens
    "index_topk": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "index_kpool": 4,
    "index_kpool_always_select_tail": True,
    # MLP and MoE
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    # mHC
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    # a tiny vision tower's config, so the checkpoint also loads in transformers without building the default
    # 24-block tower (its weights are not written: the family never reads them)
    "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                      "out_hidden_size": 64, "projection_intermediate_size": 64},
    "dtype": "float32",
}


# ---------------------------------------------------------------- what the family serves

@hookimpl
def family_model_types() -> Sequence[str]:
    return list(MODEL_TYPES)


@hookimpl
def family_request_starts_switch() -> str:
    return "TF_GLM_REQUEST_STARTS"


# ---------------------------------------------------------------- checkpoints and the model

@hookimpl
def family_load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, shard: Shard) -> FamilyModel:
    from tensorfold_glm import load as loader

    return loader.load(checkpoint, dtype, device, shard=shard)


@hookimpl
def family_tensor_parallel(config: Mapping[str, Any]) -> TensorParallel:
    return tensor_parallel(GlmConfig.from_dict(config))


@hookimpl
def family_make_tiny(directory: Path, seed: int) -> None:
    write_tiny(Path(directory), seed)


def write_tiny(directory: Path, seed: int, **changes: Any) -> None:
    """A tiny deterministic flat `glm5_next` checkpoint, written without transformers; `changes` replace
    TINY_CONFIG fields (None drops one), e.g. index_topk_pattern or tie_word_embeddings, for tests."""
    config = write_tiny_config(directory, TINY_CONFIG, **changes)
    write_tiny_weights(directory, expected_shapes(GlmConfig.from_dict(config)), draw, seed)


def draw(name: str, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """One deterministic float32 weight, drawn so activations stay at unit scale and logits are far from flat:

    matrices (and the convs, the experts, hc_*_fn) N(0, 1/fan_in) with fan_in the last dim; norms (all plain
    w·x̂ here) 1 + 0.1·N(0, 1), the indexer's LayerNorm bias 0.1·N(0, 1); A_log = log U(0.5, 1.5) and
    dt_bias = -2 + 0.5·N(0, 1), so with the lower bound -5 a channel's log decay is mostly between -2.5 and -0.1;
    the pool position bias (compress_ape) 0.5·N(0, 1); the router's correction bias 0.1·N(0, 1); hc base
    0.5·N(0, 1) and hc scale 1 + 0.1·N(0, 1), so pre, post and comb differ per stream.
    """
    shape = tuple(shape)
    if name.endswith("A_log"):
        return (0.5 + torch.rand(shape, generator=generator)).log()
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("dt_bias"):
        return -2.0 + 0.5 * noise
    if name.endswith(("index_kpool_compress_ape", "_base")):
        return 0.5 * noise
    if name.endswith("_scale"):
        return 1.0 + 0.1 * noise
    if len(shape) >= 2:
        return noise * shape[-1] ** -0.5
    if name.endswith("norm.weight"):                  # layer, final, q_a/kv_a, o_norm, indexer k_norm
        return 1.0 + 0.1 * noise
    return 0.1 * noise                                # k_norm.bias, e_score_correction_bias


# ---------------------------------------------------------------- memory and kept states

def kv_layout(c: GlmConfig, act: str) -> Layout:
    """Every layer's states: see docs/families/glm.md for what each holds."""
    H, D, K = c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    kda = LayerLayout(kind=KDA_KIND, fixed=[FixedState(CONV, (c.kda_conv_dim, K - 1), act),        # conv inputs
                                            FixedState(RECURRENT, (H, D, D), "float32")])
    layers = []
    for i, kind in enumerate(c.layer_types):
        if kind == LINEAR:
            layers.append(kda)
            continue
        rows = [RowState(LATENT, (c.kv_lora_rank,), act)]                        # post kv_a_layernorm
        fixed = []
        if c.indexer(i) == FULL_INDEXER:
            rows.append(RowState(POOLED_KEY, (c.index_head_dim,), act, every=c.index_kpool))
            if c.index_kpool > 1:                                                # raw keys and gates of the tail
                fixed.append(FixedState(POOL_TAIL, (c.index_kpool - 1, 2, c.index_head_dim), act))
        layers.append(LayerLayout(kind=MLA_KIND, rows=rows, fixed=fixed))
    return Layout(layers)


@hookimpl
def family_kv_layout(config: Mapping[str, Any], dtype: torch.dtype) -> Layout:
    return kv_layout(GlmConfig.from_dict(config), dtype_name(dtype))


@hookimpl
def family_state_image(config: Mapping[str, Any], layout: Layout) -> ImageFormat:
    return ImageFormat.of_layout(IMAGE_FORMAT, IMAGE_VERSION, layout)


@hookimpl
def family_identity(config: Mapping[str, Any], dtype: torch.dtype) -> Mapping[str, str]:
    c = GlmConfig.from_dict(config)
    act = dtype_name(dtype)
    bound = "softplus (no lower bound)" if c.linear_lower_bound is None else f"lower_bound={c.linear_lower_bound!r}"
    return {
        "format": f"{IMAGE_FORMAT}/{IMAGE_VERSION}",
        "dtype": act,
        "schedule": c.schedule,
        "mlp_schedule": c.mlp_schedule,
        "mla": (f"heads={c.num_attention_heads} q_lora={c.q_lora_rank} kv_lora={c.kv_lora_rank} "
                f"qk_nope={c.qk_nope_head_dim} qk_rope={c.qk_rope_head_dim} v_head={c.v_head_dim} NoPE"),
        "latent": f"post kv_a_layernorm (eps={c.rms_norm_eps!r}), {act}",
        "mla_attention": ("prefill on CUDA: the masked_attention kernel (online float32 softmax, the selection as its "
                          "bit mask, key blocks on the absolute grid); on the CPU: einsum scores in the model dtype, "
                          "float32 softmax, probabilities cast back; a row that selects nothing gives 0; decode: "
                          "kv_b absorbed over the picked latents"),
        "indexer": (f"heads={c.index_n_heads} head_dim={c.index_head_dim} topk={c.index_topk} "
                    f"kpool={c.index_kpool} always_select_tail={c.index_kpool_always_select_tail}; "
                    "ties: lower pool wins; a prefill step scores its rows in blocks of at most "
                    f"{SELECT_BYTES} bytes of float32 [rows, heads, pools]"),
        "pooled_key": (f"one per complete pool of {c.index_kpool} anchored at position 0: float32 softmax of "
                       f"gate + ape, probabilities cast to {act}, sum in {act}; pool_tail holds the LayerNorm'd "
                       "keys and gate logits of the incomplete pool"),
        "kda": (f"heads={c.linear_num_heads} head_dim={c.linear_head_dim} conv={c.linear_conv_kernel_dim} "
                f"{bound}; one-token rows: q, k, v, f_a, b, g_a in one GEMM and the block norms through the "
                "rms_norm kernel where Triton runs"),
        "kda_state": f"recurrent float32, conv tail {act} (last {c.linear_conv_kernel_dim - 1} inputs of [q|k|v])",
        "kda_algorithm": f"chunked {CHUNK} on the absolute grid from q, k, v in {act}; 1-token steps recurrent",
        "experts": ("routing kernel (float32 sigmoid, biased group-limited top-k, ties to the lower index); the "
                    "(row, expert) pairs through the kernels' grouped routed_experts (prefill tiles for a chunk, "
                    f"decode tiles for one-token rows; {TILES}), outputs in {act}, weighted and summed in float32 "
                    "in ascending expert order, rounded once; then the shared expert "
                    + ("as expert N of the grouped call" if c.n_shared_experts == 1 else "apart")),
    }


# ---------------------------------------------------------------- chat replies

@hookimpl
def family_chat_format(config: Mapping[str, Any]) -> ChatFormat:
    """GLM-5's replies: `<arg_key>`/`<arg_value>` tool calls (glm47) and `<think>` blocks, which its template opens
    in the generation prompt with thinking on (the tiny checkpoint's ChatML opens none, so its replies are content)."""
    return ChatFormat(tool_parser=tool_parser("glm47"), think_start="<think>", think_end="</think>")


# ---------------------------------------------------------------- refusals

@hookimpl
def family_refusals(config: Mapping[str, Any], settings: Settings) -> Sequence[str]:
    try:
        c = GlmConfig.from_dict(config)
    except (ValueError, TypeError) as err:
        return [f"the glm family cannot read config.json: {err}"]
    found = unsupported(config)
    if settings.dtype not in SERVED_DTYPES:
        found.append(f"--dtype {settings.dtype} is not served by the glm family: use bfloat16 or float32 (or auto); "
                     "the KDA decay, mHC mixes and DSA scores are not checked in other dtypes")
    if settings.context > c.max_position_embeddings:
        found.append(f"--context {settings.context} exceeds the checkpoint's max_position_embeddings "
                     f"{c.max_position_embeddings} (config.json); lower --context to at most "
                     f"{c.max_position_embeddings}")
    return found
