"""The qwen family's hook implementations: everything the core asks of a family, answered once at startup.

Registered by the entry point `qwen = "tensorfold_qwen.plugin"` in group `tensorfold` (pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tensorfold.chat.api import ChatFormat
from tensorfold.chat.tools import tool_parser
from tensorfold.checkpoint import Checkpoint
from tensorfold.hookspecs import hookimpl
from tensorfold.image import ImageFormat
from tensorfold.kernels.gated_delta.naive import CHUNK
from tensorfold.kernels.linear_norm import ONE_SLICE_FROM, ROWS_UP_TO, SPLIT_K
from tensorfold.kernels.moe import TILES
from tensorfold.kernels.moe.routing import ROUTER_SPLITS
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState, dtype_name
from tensorfold.settings import Settings
from tensorfold.shard import Shard, TensorParallel
from tensorfold.testing.tiny_checkpoint import write_tiny_config, write_tiny_weights
from tensorfold_qwen import decode, parallel
from tensorfold_qwen import load as loader
from tensorfold_qwen.config import FULL, MODEL_TYPES, SERVED_DTYPES, QwenConfig, unsupported
from tensorfold_qwen.model import CONV, KEYS, RECURRENT, VALUES, QwenModel

IMAGE_FORMAT = "qwen3_5-hybrid"
IMAGE_VERSION = 1          # bump when the meaning of a kept state changes (e.g. keys stored before RoPE)

TINY_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "dtype": "float32",
}
# The same model with a routed MoE in every layer (qwen3_5_moe_text): not the embedded default, but the tests'
# and the kit's MoE subject, written without transformers.
TINY_MOE_CHANGES: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "intermediate_size": None,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}


# ---------------------------------------------------------------- what the family serves

@hookimpl
def family_model_types() -> Sequence[str]:
    return list(MODEL_TYPES)


@hookimpl
def family_request_starts_switch() -> str:
    return "TF_QWEN_REQUEST_STARTS"


# ---------------------------------------------------------------- checkpoints and the model

@hookimpl
def family_load(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, shard: Shard) -> QwenModel:
    return loader.load(checkpoint, dtype, device, shard=shard)


@hookimpl
def family_tensor_parallel(config: Mapping[str, Any]) -> TensorParallel:
    return parallel.tensor_parallel(QwenConfig.from_dict(config))


@hookimpl
def family_make_tiny(directory: Path, seed: int) -> None:
    write_tiny(Path(directory), seed)


def write_tiny(directory: Path, seed: int, moe: bool = False, folded: bool = False) -> None:
    """A tiny deterministic Qwen3.5 text checkpoint (dense `qwen3_5_text`, or `qwen3_5_moe_text` with moe; folded:
    the shared expert as wide as the experts, so a Triton device runs it as one more expert, as 35B-A3B's)."""
    changes = {**TINY_CONFIG, **(TINY_MOE_CHANGES if moe or folded else {})}
    if folded:
        changes["shared_expert_intermediate_size"] = TINY_MOE_CHANGES["moe_intermediate_size"]
    config = write_tiny_config(directory, changes)
    write_tiny_weights(directory, loader.expected_shapes(QwenConfig.from_dict(config)), draw, seed)


def draw(name: str, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """One deterministic float32 weight, drawn so activations stay at unit scale and logits are far from flat:

    matrices (and the conv, the stacked experts) N(0, 1/fan_in) with fan_in the last dim; zero-centred norms
    0.1·N(0, 1) (they scale by 1 + w); the GDN output norm 1 + 0.1·N(0, 1); A_log = log U(0.5, 4) and
    dt_bias = -1 + 0.5·N(0, 1), so a token keeps between about 20% and 90% of the state it is handed.
    """
    shape = tuple(shape)
    if name.endswith("A_log"):
        return (0.5 + 3.5 * torch.rand(shape, generator=generator)).log()
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("dt_bias"):
        return -1.0 + 0.5 * noise
    if len(shape) >= 2:
        return noise * shape[-1] ** -0.5
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * noise
    return 0.1 * noise


# ---------------------------------------------------------------- memory and kept states

@hookimpl
def family_kv_layout(config: Mapping[str, Any], dtype: torch.dtype) -> Layout:
    c = QwenConfig.from_dict(config)
    act = dtype_name(dtype)
    attention = LayerLayout(kind="attention", rows=[RowState(KEYS, (c.kv_heads, c.head_dim), act),    # post norm+RoPE
                                                    RowState(VALUES, (c.kv_heads, c.head_dim), act)])
    gdn = LayerLayout(kind="gdn", fixed=[FixedState(CONV, (c.conv_dim, c.conv_kernel - 1), act),      # conv input tail
                                         FixedState(RECURRENT, (c.v_heads, c.k_dim, c.v_dim), "float32")])
    return Layout([attention if kind == FULL else gdn for kind in c.layer_types])


@hookimpl
def family_state_image(config: Mapping[str, Any], layout: Layout) -> ImageFormat:
    return ImageFormat.of_layout(IMAGE_FORMAT, IMAGE_VERSION, layout)


@hookimpl
def family_identity(config: Mapping[str, Any], dtype: torch.dtype) -> Mapping[str, str]:
    c = QwenConfig.from_dict(config)
    ffn = {"experts": experts_fact(c)} if c.moe else {"mlp": "gate and up in one GEMM where Triton runs"}
    return {
        **ffn,
        "format": f"{IMAGE_FORMAT}/{IMAGE_VERSION}",
        "dtype": dtype_name(dtype),
        "schedule": c.schedule,
        "attention": f"heads={c.heads} kv_heads={c.kv_heads} head_dim={c.head_dim}",
        "rope": f"default theta={c.rope_theta!r} rotary_dim={c.rotary_dim}",
        "keys": "post k_norm, post partial RoPE",
        "gdn": f"k_heads={c.k_heads}x{c.k_dim} v_heads={c.v_heads}x{c.v_dim} conv={c.conv_kernel}",
        "gdn_state": f"recurrent float32, conv tail {dtype_name(dtype)} (last {c.conv_kernel - 1} inputs)",
        "gdn_algorithm": f"chunked {CHUNK} on the absolute grid from q, k, v in {dtype_name(dtype)}, q and k "
                         "l2-normalised inside the chunked op; 1-token steps recurrent",
        "projections": projections_fact(),
    }


def projections_fact() -> str:
    """How one-row streams project on a Triton device (decode.py, kernels.linear_norm): a kept state made another
    way is not resumed."""
    inputs = (f"one K slice from {ONE_SLICE_FROM} output features, one launch" if decode.INPUT_GEMV
              else "a library GEMM")
    return (f"one-row streams (up to {ROWS_UP_TO}): the input projections {inputs}; the output projection a "
            f"{SPLIT_K}-slice split-K GEMV, its sum fused with the residual add and the norm")


def experts_fact(c: QwenConfig) -> str:
    """How a MoE layer's GPU path computes (mlp.moe_fused): a kept state made another way is not resumed."""
    folded = c.shared_intermediate_size == c.moe_intermediate_size
    shared = "the shared expert as expert N of the grouped experts" if folded else "the shared expert apart"
    router = (f"; one-row streams (up to {ROWS_UP_TO}): a split-K GEMV of {ROUTER_SPLITS} splits, the routing "
              "kernel on its summed parts" if folded else "")
    return (f"fused: router and shared gate in one GEMM, routing kernel (ties to the lowest index){router}, "
            f"{shared}; prefill chunks through the prefill tiles, one-row streams the decode tiles ({TILES})")


# ---------------------------------------------------------------- chat replies

@hookimpl
def family_chat_format(config: Mapping[str, Any]) -> ChatFormat:
    """Qwen3.5's replies: XML tool calls (qwen3_coder) and `<think>` blocks, which its template opens in the
    generation prompt with thinking on (the tiny checkpoint's ChatML opens none, so its replies are content)."""
    return ChatFormat(tool_parser=tool_parser("qwen3_coder"), think_start="<think>", think_end="</think>")


# ---------------------------------------------------------------- refusals

@hookimpl
def family_refusals(config: Mapping[str, Any], settings: Settings) -> Sequence[str]:
    try:
        c = QwenConfig.from_dict(config)
    except (ValueError, TypeError) as err:
        return [f"the qwen family cannot read config.json: {err}"]
    found = unsupported(config)
    if settings.dtype not in SERVED_DTYPES:
        found.append(f"--dtype {settings.dtype} is not served by the qwen family: use bfloat16 or float32 "
                     "(or auto); the GDN decay and gated norms are not checked in other dtypes")
    if settings.context > c.max_positions:
        found.append(f"--context {settings.context} exceeds the checkpoint's max_position_embeddings "
                     f"{c.max_positions} (config.json); lower --context to at most {c.max_positions}")
    return found

